"""Sampler chains (llama.cpp's llama-sampling): CPU samplers over candidate arrays, and their
backend forms, ops appended to the model graph so only the chosen token leaves it."""
from .rng import DEFAULT_SEED, StdRng
from .samplers import (
                       Candidates,
                       Dist,
                       Greedy,
                       LogitBias,
                       MinP,
                       Penalties,
                       Sampler,
                       SamplerChain,
                       Temp,
                       TempExt,
                       TopK,
                       TopP,
                       Typical,
                       default_chain,
)

__all__ = ["Candidates", "DEFAULT_SEED", "Dist", "Greedy", "LogitBias", "MinP", "Penalties", "Sampler", "SamplerChain",
           "StdRng", "Temp", "TempExt", "TopK", "TopP", "Typical", "default_chain"]
