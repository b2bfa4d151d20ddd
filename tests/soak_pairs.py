"""The soak's fixed pairwise plan (scripts/soak.py --pairwise): trials chosen so that every valid pair of
dimension values appears in one, dealt into parts for CI; and how much of that a set of trials covers."""

from __future__ import annotations

import itertools
from typing import Any

from soak_draw import draw, trial_seeds
from soak_plan import DIMENSIONS, Trial, allowed, dimensions, valid  # the trials it plans


def _pairs(trial: dict[str, Any]) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    names = [n for n in DIMENSIONS if n in trial]
    return {((a, trial[a]), (b, trial[b])) for a, b in itertools.combinations(names, 2)}


def valid_pairs() -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    return {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(DIMENSIONS, 2)
        for va in DIMENSIONS[a]
        for vb in DIMENSIONS[b]
        if allowed(a, va, b, vb)
    }


def _complete(start: dict[str, Any], uncovered: set, used: dict[tuple[str, Any], int]) -> dict[str, Any]:
    """``start`` filled one dimension at a time (largest first) with the allowed value that covers the most
    uncovered pairs (ties: the value the plan has used least, then the first: the padding spreads too)."""
    trial = dict(start)
    for name in sorted(DIMENSIONS, key=lambda n: -len(DIMENSIONS[n])):
        if name in trial:
            continue
        options = [v for v in DIMENSIONS[name] if valid({**trial, name: v})]
        trial[name] = max(
            options, key=lambda v: (len(_pairs({**trial, name: v}) & uncovered), -used[name, v])
        )
    return {n: trial[n] for n in DIMENSIONS}


def pairwise_plan(candidates: int = 5) -> list[dict[str, Any]]:
    """Greedy all-pairs: each next trial is the best of completions of the first ``candidates`` uncovered
    pairs (in a fixed order), until every allowed pair is covered. No randomness: the same plan every time.
    The greedy's length moves with ``candidates`` (40 trials at 1, 38 at 8, 11 and 20, 39 at 10, 12, 13 and
    15): 5 is among the fewest (37 trials; the bound is 28, the fault x phase pairs)."""
    order = {(n, v): (i, j) for i, n in enumerate(DIMENSIONS) for j, v in enumerate(DIMENSIONS[n])}
    uncovered, plan, used = valid_pairs(), [], {key: 0 for key in order}
    while uncovered:
        firsts = sorted(uncovered, key=lambda p: (order[p[0]], order[p[1]]))[:candidates]
        options = [_complete(dict(pair), uncovered, used) for pair in firsts]
        best = max(options, key=lambda t: len(_pairs(t) & uncovered))
        plan.append(best)
        uncovered -= _pairs(best)
        for key in best.items():
            used[key] += 1
    return plan


def plan_parts(n: int) -> list[list[int]]:
    """The pairwise plan dealt into ``n`` parts (indices into it), each holding every value of every dimension
    where ``n`` allows (up to 4), balanced by the processes their launches start. No randomness: a round-robin
    deal, improved by moving or swapping trials while that lowers (values some part lacks, the largest part's
    load, the sum of squared loads). ``n`` = 4m, m > 1: each of the 4-way deal's parts cut in m by load (CI:
    n = 16, so four consecutive parts hold every value, and the 16 every pair)."""
    plan = pairwise_plan()
    load = [1 if t["launcher"] == "single" else 1 + t["world"] for t in plan]  # the launcher and its ranks
    if n > 4 and n % 4 == 0:
        return [sub for p in plan_parts(4) for sub in _cut(p, n // 4, load)]
    values = [set(t.items()) for t in plan]
    every = set().union(*values)

    def score(deal: list[int]) -> tuple[int, int, int]:
        held, loads = [set() for _ in range(n)], [0] * n
        for i, p in enumerate(deal):
            held[p] |= values[i]
            loads[p] += load[i]
        return sum(len(every - h) for h in held), max(loads), sum(x * x for x in loads)

    deal, improved = [i % n for i in range(len(plan))], True
    while improved:
        improved = False
        for i in range(len(plan)):
            swaps = [
                [deal[j] if k == i else deal[i] if k == j else p for k, p in enumerate(deal)]
                for j in range(len(plan))
            ]
            for candidate in swaps + [deal[:i] + [p] + deal[i + 1 :] for p in range(n)]:
                if score(candidate) < score(deal):
                    deal, improved = candidate, True
    return [[i for i, p in enumerate(deal) if p == part] for part in range(n)]


def _cut(part: list[int], m: int, load: list[int]) -> list[list[int]]:
    """A part cut in ``m``, balanced by load: the heaviest trial first, each into the lightest cut so far."""
    cuts: list[list[int]] = [[] for _ in range(m)]
    for i in sorted(part, key=lambda i: (-load[i], i)):
        min(cuts, key=lambda c: (sum(load[j] for j in c), len(c))).append(i)
    return [sorted(c) for c in cuts]


def plan_trials(seed: int, long: bool = False, part: tuple[int, int] | None = None) -> list[Trial]:
    """The pairwise plan's trials, each with its remaining details from its own seed (drawn from ``seed``, for
    the whole plan: a trial is the same in a part); ``part`` (k, n): only the k-th of ``plan_parts(n)``."""
    plan = pairwise_plan()
    chosen = set(plan_parts(part[1])[part[0] - 1]) if part else set(range(len(plan)))
    trials = [
        draw(s, long, fixed)
        for i, (s, fixed) in enumerate(zip(trial_seeds(seed, len(plan)), plan))
        if i in chosen
    ]
    for t in trials:
        t.plan_seed = seed
    return trials


def coverage(trials: list[Trial]) -> str:
    """How many of the allowed pairs the trials cover, said as the plan prints it."""
    every = valid_pairs()
    seen = set().union(*(_pairs(dimensions(t)) for t in trials)) & every
    values = {(n, v) for t in trials for n, v in dimensions(t).items()}
    return (
        f"covers {len(seen)}/{len(every)} valid pairs of {len(DIMENSIONS)} dimensions in {len(trials)} "
        "trials, "
        f"{len(values)}/{sum(map(len, DIMENSIONS.values()))} of their values"
    )
