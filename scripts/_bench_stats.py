"""The benchmarks' verdict: is a measured ratio or difference within its bound, beyond the machine's noise?

A median of a few rounds on a shared VM moves by 5-20 % between calls of the same command, so a single
figure cannot say whether ddplab is within its bound or only happened to be this time. The rounds are
paired (both sides measured back to back, alternating which goes first), so the question is asked of the
pairs: a bootstrap interval of their median (resampling whole pairs, seeded: the same pairs give the same
interval). The verdict is "holds" only where the whole interval is within the bound, "exceeded" only where
the whole interval is past it; otherwise the rounds were too few to tell, and the verdict says so.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

LEVEL = 0.95
DRAWS = 4000


def interval(
    xs: Sequence[float], level: float = LEVEL, draws: int = DRAWS, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of ``xs`` (each an independent pair's figure)."""
    if len(xs) < 2:
        raise ValueError(f"a noise interval needs at least 2 paired rounds, got {len(xs)}")
    rng = random.Random(seed)
    n = len(xs)
    medians = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(draws))
    tail = (1.0 - level) / 2
    return medians[int(tail * (draws - 1))], medians[int((1.0 - tail) * (draws - 1))]


def verdict(lo: float, hi: float, bound: float) -> str:
    """``holds`` (the whole interval ≤ bound), ``exceeded`` (all of it past), else ``undecided``."""
    if hi <= bound:
        return "holds"
    if lo > bound:
        return "exceeded"
    return "undecided: more rounds"


def judged(xs: Sequence[float], bound: float, fmt: str = "{:.3f}") -> str:
    """One table cell: the interval and the verdict against ``bound``, e.g. ``0.962–0.998: holds``."""
    if len(xs) < 2:
        return f"one round: no verdict (run ≥ 2; {len(xs)} given)"
    lo, hi = interval(xs)
    return f"{fmt.format(lo)}–{fmt.format(hi)}: {verdict(lo, hi, bound)}"
