"""Step-paired timing for scripts/bench_overhead.py: the two sides take turns one optimizer step at a time.

Alternating whole epochs leaves ~1.5 s between the two sides' figures, and on a shared VM the machine's speed
moves by 10-20 % over such spans: per-epoch ratios spread 0.8-1.1 around 1.0, and 40 epochs a side could
not tell 1.00 from 1.01. Here the hand loop is a generator, and each ddplab optimizer step hands over to one
hand step (from a global optimizer-step hook, in the same thread, so that no second OpenMP team spins
beside the first): step k of one side is timed some 20 ms from step k of the other, under the same machine
state.

What each side's step time covers is one whole loop iteration:
  ddplab  from the end of its previous step's hook to its next optimizer step: zero_grad, the scheduler,
          its metrics, log interval, evaluation and checkpoint checks, then the batch, forward, backward
          and the optimizer step;
  hand    one ``next()`` of its generator: the batch, forward, backward, the step, zero_grad, the
          scheduler, its log step.
The first step of each epoch follows that epoch's predecessor's evaluation and checkpoint on both sides; it
is left out, as in the epoch-alternating mode.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator


class PairedSteps:
    """Runs one hand-loop step inside each of ddplab's optimizer steps and times both."""

    def __init__(self, hand_steps: Iterator[None]) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.hand_steps = hand_steps
        self.in_hand = False
        self.resumed = float("nan")  # when ddplab's current step began: the end of the previous hook
        self.ms: dict[str, list[float]] = {"hand": [], "ddplab": []}  # step k's time at index k
        self.first_step_s = float("nan")
        self.t0 = time.time()
        self.handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, *_: object) -> None:
        if self.in_hand:  # the hand loop's own optimizer step, within its turn
            return
        now = time.perf_counter()
        if not self.ms["ddplab"]:
            self.first_step_s = time.time() - self.t0
        self.ms["ddplab"].append((now - self.resumed) * 1e3)  # nan for the very first step
        self.in_hand = True
        try:
            t = time.perf_counter()
            next(self.hand_steps)
            self.ms["hand"].append((time.perf_counter() - t) * 1e3)
        finally:
            self.in_hand = False
        self.resumed = time.perf_counter()

    def finish(self) -> None:
        """The hand loop's last evaluation and checkpoint (it has no more steps)."""
        self.handle.remove()
        for _ in self.hand_steps:
            raise RuntimeError("the hand loop has more steps than ddplab's: the sides are not the same job")


def per_epoch(ms: dict[str, list[float]], steps_per_epoch: int) -> dict:
    """Each side's step times cut into epochs, each epoch's first left out (it follows an evaluation)."""
    if len(ms["hand"]) != len(ms["ddplab"]):
        raise SystemExit(f"{len(ms['ddplab'])} ddplab steps but {len(ms['hand'])} hand steps")
    spe = steps_per_epoch
    return summary({side: [xs[e + 1 : e + spe] for e in range(0, len(xs), spe)] for side, xs in ms.items()})


def summary(epochs: dict[str, list[list[float]]]) -> dict:
    """Per side, the step times of each epoch; epoch i of one side is paired with epoch i of the other.
    Medians and means over every step, and each pair's ratios ddplab / hand: of the median step (the step
    ratio) and of the steps' sum (the epoch ratio: the log steps in)."""
    every = {side: [t for epoch in epochs_ for t in epoch] for side, epochs_ in epochs.items()}
    pairs = list(zip(epochs["hand"], epochs["ddplab"]))
    ratios = sorted(statistics.median(d) / statistics.median(h) for h, d in pairs)
    return {
        "hand_step_ms": statistics.median(every["hand"]),
        "ddplab_step_ms": statistics.median(every["ddplab"]),
        "hand_mean_ms": statistics.fmean(every["hand"]),
        "ddplab_mean_ms": statistics.fmean(every["ddplab"]),
        "paired_min": ratios[0],
        "paired_max": ratios[-1],
        "paired_median": statistics.median(ratios),
        "paired": ratios,
        "epoch_ratios": sorted(math.fsum(d) / math.fsum(h) for h, d in pairs),
    }


def over_launches(runs: list[dict]) -> dict:
    """Several launches, each one round: its ratios are the medians of its epochs'. A process's own memory
    layout moves the ratio by about ±0.5 % (both sides' step times by up to 20 %), which no number of epochs
    within one process averages away: the verdict is asked of launches."""
    if len(runs) == 1:
        return runs[0]
    steps = sorted(r["paired_median"] for r in runs)
    return {
        **{k: statistics.median(r[k] for r in runs) for k in ("hand_step_ms", "ddplab_step_ms")},
        **{k: statistics.median(r[k] for r in runs) for k in ("hand_mean_ms", "ddplab_mean_ms")},
        "paired_min": steps[0],
        "paired_max": steps[-1],
        "paired_median": statistics.median(steps),
        "paired": steps,
        "epoch_ratios": sorted(statistics.median(r["epoch_ratios"]) for r in runs),
    }
