"""The random numbers of llama.cpp's samplers: std::mt19937 seeded with a 32-bit seed, read
through std::uniform_real_distribution<double>(0, 1) (libstdc++'s generate_canonical:
two 32-bit draws, low word first)."""
from __future__ import annotations

import time

import numpy as np

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a seed from the clock


def _mt_state(seed: int) -> np.ndarray:
    """std::mt19937's state after seed(s) (the reference init_genrand)."""
    key = np.empty(624, dtype=np.uint32)
    x = seed & 0xFFFFFFFF
    key[0] = x
    for i in range(1, 624):
        x = (1812433253 * (x ^ (x >> 30)) + i) & 0xFFFFFFFF
        key[i] = x
    return key


class StdRng:
    """std::mt19937 + uniform_real_distribution<double>(0, 1)."""

    def __init__(self, seed: int = DEFAULT_SEED) -> None:
        self.seed(seed)

    def seed(self, seed: int) -> None:
        if seed == DEFAULT_SEED:
            seed = time.time_ns() & 0xFFFFFFFF
        self.seed_cur = seed & 0xFFFFFFFF
        self._bg = np.random.MT19937(0)
        self._bg.state = {"bit_generator": "MT19937", "state": {"key": _mt_state(self.seed_cur), "pos": 624}}

    def next_u32(self) -> int:
        return int(self._bg.random_raw())

    def uniform(self) -> float:
        lo, hi = self._bg.random_raw(2)
        r = (float(lo) + float(hi) * 4294967296.0) / 18446744073709551616.0
        return r if r < 1.0 else float(np.nextafter(1.0, 0.0))

    def clone(self) -> "StdRng":
        other = StdRng.__new__(StdRng)
        other.seed_cur = self.seed_cur
        other._bg = np.random.MT19937(0)
        other._bg.state = self._bg.state
        return other
