"""The server's bounds on what clients may make it hold, in one place the command line reads
without the server's dependencies (its --max-body and --lora-max defaults)."""

# llama-server has no body limit; 16 MiB is ~4 million tokens of text, far beyond any context a
# request can fill, and bounds the memory and parsing time one request can take (413 past it)
DEFAULT_MAX_BODY = 16 * 1024 * 1024

# llama-server has no bound (nor loads while serving); 16 adapters of a 7B model at rank 16 are
# ~0.5 GB, and each step groups its batches by the adapters' scales (409 past it)
DEFAULT_MAX_ADAPTERS = 16
