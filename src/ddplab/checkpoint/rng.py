"""Random streams as checkpoint state: every rank's python / numpy / torch (/ CUDA) generators."""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Any, Iterator

import numpy as np
import torch

from ddplab.runtime.collectives import gather_object
from ddplab.runtime.group import Dist

log = logging.getLogger("ddplab")


def rng_state() -> dict[str, Any]:
    """This process's random streams, as plain lists/tensors (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's device's generator only (the one set_device chose): a resume where another set of GPUs
        # is visible, or ranks sit on other device indices, still restores it exactly.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # a checkpoint from before: every visible device's, by index
            here = torch.cuda.current_device()
            cuda = cuda[here] if here < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda.cpu())


@contextlib.contextmanager
def streams_kept() -> Iterator[None]:
    """Whatever runs inside draws from the streams, then they are back where they were: an evaluation (a
    task's visualize may sample) never moves training's randomness, so how often a run evaluates changes no
    weight."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class RNGStreams:
    """Stateful: saves every rank's streams (a gather: collective), restores this rank's.

    A restore matters only mid-epoch (at an epoch start the streams are
    re-seeded from (seed, epoch, rank)), so loading only stages the state;
    :meth:`restore` applies it when the loop resumes mid-epoch.
    """

    def __init__(self, dist: Dist):
        self.dist = dist
        self._staged: dict[str, Any] | None = None
        self.saved_world_size: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_object(rng_state(), self.dist)}  # one entry per rank

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ranks = sd.get("ranks") or []
        self.saved_world_size = len(ranks)
        self._staged = ranks[self.dist.rank] if len(ranks) == self.dist.world_size else None

    def start_epoch(self, seed: int, epoch: int, mid_epoch: bool) -> None:
        """Random streams for dropout and augmentation as (a part of) epoch ``epoch`` starts: per rank, from
        (seed, epoch, rank) only, so a resumed run replays them; mid-epoch (a resume), the saved streams
        continued exactly, if there are any for this world size."""
        if mid_epoch:
            self.restore()
            return
        seed_everything(seed + 1_000_003 * (epoch + 1) + self.dist.rank)

    def restore(self) -> bool:
        """Continue the saved streams exactly; False if there are none for this world size."""
        staged, self._staged = self._staged, None
        if staged is None:
            return False
        set_rng_state(staged)
        return True
