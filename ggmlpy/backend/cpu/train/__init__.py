"""Training ops: backward kernels, optimizer steps, the fused output layer and loss."""
