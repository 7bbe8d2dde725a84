"""Which tasks llama-perplexity scores, in which order: its std::mt19937 seeded with 1 and the
two ways it draws from it, reproduced draw for draw.

- HellaSwag draws every task (all of them, or the first `n` draws) with libstdc++'s
  `uniform_int_distribution<size_t>` over the tasks not drawn yet (GCC 11+: Lemire's
  multiply-and-shift on one 32-bit draw, rejecting a few low products).
- Winogrande and the multiple-choice tasks draw `n` of them (when `0 < n < count`) by scaling
  a draw to the remaining count in float32, `int(2^-32 * float(draw) * float(left))`, and
  swap the last remaining task into the drawn one's place.

numpy's legacy `RandomState(seed)` is MT19937 seeded by init_genrand, as std::mt19937(seed);
`randint(0, 2^32)` returns its 32-bit outputs one by one.
"""
from __future__ import annotations

import numpy as np

SEED = 1  # llama-perplexity's: "kept hardcoded for now"
_TWO_POW_32 = 1 << 32
_SCALE = np.float32(1.0) / (np.float32(1.0) + np.float32(0xFFFFFFFF))  # 1 / (1 + (float)mt19937::max()) = 2^-32


class Mt19937:
    """std::mt19937(seed): `next()` is its next 32-bit output."""

    def __init__(self, seed: int = SEED) -> None:
        self._state = np.random.RandomState(seed)

    def next(self) -> int:
        return int(self._state.randint(0, _TWO_POW_32, dtype=np.uint64))


def uniform_below(rng: Mt19937, n: int) -> int:
    """libstdc++'s uniform_int_distribution<size_t>(0, n - 1)(rng) for a 32-bit engine and
    1 <= n <= 2^32: the high word of draw * n, drawing again while the low word falls in
    the first (2^32 - n) mod n values."""
    product = rng.next() * n
    low = product % _TWO_POW_32
    if low < n:
        threshold = (_TWO_POW_32 - n) % n
        while low < threshold:
            product = rng.next() * n
            low = product % _TWO_POW_32
    return product >> 32


def hellaswag_order(n_available: int, n_tasks: int) -> list[int]:
    """Indices of the HellaSwag tasks scored, in scoring order: min(n_tasks, n_available)
    draws, each among the tasks not drawn yet (so all tasks come shuffled)."""
    rng = Mt19937()
    left = list(range(n_available))
    return [left.pop(uniform_below(rng, len(left))) for _ in range(min(n_tasks, n_available))]


def scaled_sample(n_available: int, n_tasks: int) -> list[int]:
    """Indices of the Winogrande / multiple-choice tasks scored, in scoring order: all of
    them in file order unless 0 < n_tasks < n_available, else n_tasks scaled draws (module
    docstring)."""
    if not 0 < n_tasks < n_available:
        return list(range(n_available))
    rng = Mt19937()
    left = list(range(n_available))
    order = []
    for _ in range(n_tasks):
        scaled = _SCALE * np.float32(rng.next()) * np.float32(len(left))
        # float(draw) can round up to 2^32, making j == len(left): past llama.cpp's vector
        # (undefined there, one draw in 2^25); the last task here
        j = min(int(scaled), len(left) - 1)
        order.append(left[j])
        left[j] = left[-1]
        left.pop()
    return order
