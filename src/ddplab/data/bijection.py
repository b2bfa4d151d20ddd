"""A seeded shuffle of ``range(n)`` in constant memory: ``order[i]`` computed for any ``i`` on demand.

A permutation tensor costs 8 bytes per sample (16 GB per rank for the windows of a 1 TB token file); this
costs a few integers. It is a balanced Feistel network over the smallest even-bit power of two that holds
``n`` (a bijection of that domain for any round function), cycle-walked back into ``range(n)``: an index that
lands outside is put through the network again until it lands inside, which keeps it a bijection of
``range(n)``. The domain is under 4n, so an index walks fewer than 4 times on average. Six rounds of a
splitmix64-style mix keyed by (seed, round) make the order look random; the same (n, seed) give the same order
on every machine."""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves about half the output bits."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class IndexBijection:
    """``order(positions)``: the shuffled index at each position, for an array of positions in
    ``range(n)``."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"IndexBijection of {n} indices: needs at least one")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + bits % 2) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        with np.errstate(over="ignore"):
            base = np.uint64(seed % 2**64) * _GOLDEN
            self.keys = [
                _mix(np.array([base + np.uint64(r + 1) * _GOLDEN], dtype=np.uint64))[0]
                for r in range(_ROUNDS)
            ]

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        with np.errstate(over="ignore"):
            for key in self.keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._network(np.asarray(positions, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():  # cycle-walking: back through the network until inside range(n)
            out[outside] = self._network(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)
