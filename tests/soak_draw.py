"""A soak trial drawn at random from its seed (scripts/soak.py --trials), within the plan's valid values."""

from __future__ import annotations

import math
import random
from typing import Any

from soak_plan import (
    ANY_STEP,
    BATCH,
    DATA,
    DATA_OF,
    FEATURES,
    LAUNCHERS,
    MODES,
    OTHER_FAULTS,
    PHASE_GROUPS,
    PHASES,
    SERVER_STATES,
    SIGNALS,
    SLURM,
    TARGETS,
    TIMINGS,
    TRAIN_SAMPLES,
    WORLDS,
    Trial,
    calls,
    dimensions,
    valid,
)


def draw(seed: int, long: bool = False, fixed: dict[str, Any] | None = None, slurm: bool = False) -> Trial:
    """The trial of ``seed``; ``fixed``: a plan trial's dimension values, in place of their draws. Every draw
    is made whatever is fixed, in the order it always had, so a seed's other details never move. ``slurm``:
    srun is a fourth launcher to draw from."""
    rng, fixed = random.Random(seed), fixed or {}
    launcher = fixed.get("launcher", rng.choice(LAUNCHERS + ((SLURM,) if slurm else ())))
    accum = fixed.get("accum", rng.randint(1, 3))
    lo, hi = TIMINGS[fixed["timing"]] if "timing" in fixed else ANY_STEP
    step_s = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    budget, cap = (60.0, 400) if long else (6.0, 60)
    total = max(3, min(cap, round(budget / step_s)))
    epochs = rng.randint(1, min(3, total))
    spe = min(TRAIN_SAMPLES // (BATCH * accum), math.ceil(total / epochs))
    log_every = round(math.exp(rng.uniform(0.0, math.log(100))))
    every_n = rng.randint(1, max(1, epochs * spe)) if rng.random() < 0.4 else 0
    fault = fixed.get("fault", rng.choice(SIGNALS))
    target = fixed.get("target", rng.choice(TARGETS if launcher != "single" else ("self",)))
    t = Trial(
        seed,
        launcher,
        step_s,
        epochs,
        spe,
        accum,
        log_every,
        every_n,
        fault,
        target,
        0,
        "",
        0,
        long,
        slurm=slurm,
    )
    t.rank = rng.randrange(t.world)
    t.data = DATA_OF[fixed["source"], fixed["access"]] if "source" in fixed else t.data
    phases = PHASE_GROUPS[fixed["phase"]] if "phase" in fixed else PHASES
    t.phase = rng.choice([p for p in phases if p != "between" or accum > 1])
    # the plan pairs input with every accum: accum 1 the fetch, 2 and 3 the boundary
    if fixed.get("phase") == "input":
        t.phase = "between" if accum > 1 else "data"
    t.k = rng.choice(calls(t))
    async_save = rng.random() < 0.5  # drawn after the rest: every earlier draw of a seed is what it was
    t.async_save = fixed["checkpoint"] == "async" if "checkpoint" in fixed else async_save
    strategy = rng.choice(("ddp", "fsdp"))
    t.strategy = fixed.get("strategy", "none" if launcher == "single" else strategy)
    data = rng.choice(DATA)
    t.data = DATA_OF[fixed["source"], fixed["access"]] if "source" in fixed else data
    t.k = min(t.k, max(calls(t)))  # the token file has fewer validation batches than the digits (one process)
    _draw_mode_and_fault(t, rng, fixed)
    _draw_world_and_feature(t, rng, fixed)
    # drawn last: every earlier draw of a seed is what it was
    tracking_u, server_u = rng.random(), rng.random()
    # W&B from what was "none" above 0.3: an earlier seed's MLflow trials are what they were
    drawn = "mlflow" if tracking_u < 0.3 else "wandb" if tracking_u < 0.45 else "none"
    t.tracking = fixed.get("tracking", drawn)
    t.server = SERVER_STATES[int(server_u * len(SERVER_STATES))]
    return t


def _draw_world_and_feature(t: Trial, rng: random.Random, fixed: dict[str, Any]) -> None:
    """The world size and the feature in play: drawn after everything else (a seed's earlier details stay),
    each from the values the trial's other dimensions allow; k and the epoch's length fitted to what they
    change."""
    world_u, feature_u = rng.random(), rng.random()
    worlds = [w for w in WORLDS if valid({**dimensions(t), "world": w})]
    t.ranks = fixed.get("world", worlds[int(world_u * len(worlds))]) if t.launcher != "single" else 2
    features = [f for f in FEATURES if valid({**dimensions(t), "feature": f})]
    t.feature = fixed.get("feature", features[int(feature_u * len(features))])
    t.steps_per_epoch = min(t.steps_per_epoch, TRAIN_SAMPLES // (t.batch * t.accum))
    t.k = min(t.k, max(calls(t)))


def _draw_mode_and_fault(t: Trial, rng: random.Random, fixed: dict[str, Any]) -> None:
    """The run mode, and for a quarter of drawn trials a fault other than a signal: drawn last (a seed's
    earlier details stay what they were), each from the values the trial's other dimensions allow."""
    mode_u, other_u, which_u = rng.random(), rng.random(), rng.random()
    now = dimensions(t)
    modes = [m for m in MODES if valid({**now, "mode": m})]
    t.mode = fixed.get("mode", modes[int(mode_u * len(modes))])
    if "fault" not in fixed and other_u < 0.25:
        others = [f for f in OTHER_FAULTS if valid({**dimensions(t), "target": "self", "fault": f})]
        t.fault, t.target, t.rank = others[int(which_u * len(others))], "self", t.rank


def trial_seeds(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**31) for _ in range(n)]
