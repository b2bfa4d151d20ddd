"""EMA of the weights: updated on the device after every optimizer step, evaluated as ``val_ema/*``,
checkpointed and restored bitwise; sharded like the parameters under FSDP."""

from __future__ import annotations

from typing import Any

import torch

from ddplab import compat
from ddplab.train.callback import Callback
from ddplab.train.state import State


class EMA(Callback):
    """``ema ← ema + (1 - d)·(param − ema)`` after each optimizer step, as one fused ``compat.lerp_all_``
    (torch's fused foreach lerp) over all parameters: a few kernels, no host sync, no collective.

    ``d`` warms up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates (``warmup=true``), so
    early weights do not dominate. Parameters are identical on every DDP rank, so each rank's
    EMA is too; under FSDP each rank keeps the EMA of its own shards (the strategy gathers full
    tensors only for checkpoints). Buffers (BatchNorm statistics) are the live model's.
    """

    def __init__(self, decay: float = 0.999, warmup: bool = True, evaluate: bool = True):
        if not 0.0 <= decay < 1.0:
            raise ValueError(
                f"callbacks.ema.decay={decay}: must be in [0, 1). Fix: callbacks.ema.decay=0.999"
            )
        self.decay, self.warmup, self.evaluate = decay, warmup, evaluate
        self.updates = 0  # host count: the warm-up decay needs no device read
        self.logged_names: tuple[str, ...] = ()

    def setup(self, state: State) -> None:
        self.strategy = state.strategy
        # Views of the parameters, made once: the optimizer updates them in place.
        self.live = [p.detach() for p in state.module.parameters() if p.is_floating_point()]
        self.shadow = [t.clone() for t in self.live]
        if self.evaluate:
            from ddplab.task import logged_names

            self.logged_names = tuple(f"val_ema/{m}" for m in logged_names(state.task))

    def current_decay(self) -> float:
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def on_step_end(self, state: State, step: int) -> None:
        compat.lerp_all_(self.shadow, self.live, 1.0 - self.current_decay())
        self.updates += 1

    @torch.no_grad()
    def on_eval_end(self, state: State, metrics: dict[str, float]) -> dict[str, float] | None:
        """Evaluate with the EMA weights swapped in (then swapped back): ``val_ema/*``."""
        if not self.evaluate:
            return None
        backup = [t.clone() for t in self.live]
        _copy(self.live, self.shadow)
        try:
            ema = state.evaluator.evaluate()
        finally:
            _copy(self.live, backup)
        return {"val_ema/" + k[len("val/") :]: v for k, v in ema.items() if k.startswith("val/")}

    def state_dict(self) -> dict[str, Any]:
        # Full tensors (a collective under FSDP: checkpoints are saved on every rank together).
        return {
            "shadow": self.strategy.whole_tensors(self.shadow),
            "updates": self.updates,
            "decay": self.decay,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if len(sd["shadow"]) != len(self.shadow):
            raise ValueError(
                f"callbacks.ema: the checkpoint holds {len(sd['shadow'])} EMA tensors, this model has "
                f"{len(self.shadow)}. Fix: resume with the model it was saved with"
            )
        self.strategy.load_whole_tensors(self.shadow, sd["shadow"])
        self.updates = int(sd["updates"])


def _copy(into: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    # One copy_ per tensor (evaluation time only): sharded parameters have no rule for _foreach_copy_.
    for t, v in zip(into, src):
        t.copy_(v)
