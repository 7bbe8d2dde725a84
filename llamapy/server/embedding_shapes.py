"""Embedding answers: llama-server's native list (/embedding, /embeddings) and OpenAI's
`list` object (/v1/embeddings: `data`, `usage`, float lists or base64)."""
from __future__ import annotations

import base64

import numpy as np

from .engine import Embedded


def native_embeddings(results: list[Embedded]) -> list[dict]:
    """[{"index", "embedding": [[...]]}]: a vector per token (pooling none) or one pooled."""
    return [{"index": i, "embedding": [v.tolist() for v in r.vectors]} for i, r in enumerate(results)]


def openai_embeddings(results: list[Embedded], model: str, use_base64: bool) -> dict:
    """OpenAI's embeddings object; base64 is the float32 vector's little-endian bytes."""
    data = []
    for i, r in enumerate(results):
        vector = r.vectors[0]
        if use_base64:
            data.append({"embedding": base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii"),
                         "index": i, "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vector.tolist(), "index": i, "object": "embedding"})
    n_tokens = sum(r.n_tokens for r in results)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "data": data}
