"""The Strategy interface, and what every strategy shares (device placement, SyncBN, compile,
full-state checkpoints, BN-buffer sync before evaluation).

A Strategy owns everything that differs between none / dp / ddp / fsdp:
wrapping, the no-sync context for accumulation, what a checkpoint of the
model/optimizer looks like (full or sharded), grad-norm handling, evaluation
lockstep, refusals and its one-line description. It must not run the loop,
choose file names or read the environment; no other module may branch on
``distributed.strategy``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Protocol

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from ddplab.config import ConfigError
from ddplab.models.weights import state_dict_mismatch
from ddplab.runtime import collectives
from ddplab.runtime.group import Dist
from ddplab.syncbn import convert_sync_batchnorm

if TYPE_CHECKING:  # the type only: torch.distributed.checkpoint costs ~0.6 s to import
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger("ddplab")


class Sidecars(Protocol):
    """Where state that every rank writes itself goes (the CheckpointManager implements it)."""

    def sidecar_path(self, suffix: str) -> Path: ...

    def resolve_sidecar(self, name: str) -> Path: ...


class ModuleState:
    """Stateful: the full (unsharded) state_dict, fit-checked before anything is loaded."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def check(self, ck: dict[str, Any], path: Path) -> None:
        if "model" not in ck and "sharded" in ck:
            raise ConfigError(
                f"resume={path}: was saved with distributed=fsdp (sharded weights). Fix: resume it "
                "with distributed=fsdp, as it was saved, or resume=null"
            )
        if "model" in ck:
            problems = state_dict_mismatch(self.module.state_dict(), ck["model"])
            if problems:
                raise ConfigError(
                    f"resume={path}: does not fit this model ({problems}). Fix: resume "
                    "with the model config it was saved with (see its meta.config entry), "
                    "or resume=null to start fresh"
                )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.module.load_state_dict(sd)


class Strategy:
    name: ClassVar[str]
    one_process: ClassVar[bool] = False  # refuses to be one of several launched ranks
    counts_flops: ClassVar[bool] = True  # a FLOP-counting forward outside the step is safe
    one_file_checkpoints: ClassVar[bool] = True  # a checkpoint is one .pt (fsdp: a folder of DCP shards)
    # Modules every rank of this strategy imports whatever the job: a self-launch's rank server imports
    # them once for all its ranks (job._self_launch); compat.defer_dynamo imports them before it looks.
    rank_imports: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: DictConfig, dist: Dist):
        self.d, self.perf, self.dist = cfg.distributed, cfg.perf, dist

    @classmethod
    def refuse(cls, cfg: DictConfig, world_size: int) -> None:
        """Raise ConfigError, before any process group exists, for setups this strategy cannot run."""

    # ------------------------------------------------------------ the module
    def prepare(self, module: nn.Module) -> nn.Module:
        """The plain module on its device, as checkpoints and evaluation see it."""
        if self.d.sync_batchnorm and self.dist.is_distributed:
            module = convert_sync_batchnorm(module, self.dist.device)  # before any wrapper, as DDP requires
        module = module.to(self.dist.device)
        if self.perf.channels_last:
            module = module.to(memory_format=torch.channels_last)  # 4-D weights only; the rest is untouched
        return module

    def wrap(self, module: nn.Module) -> nn.Module:
        """What the training step calls (compiled when perf.compile)."""
        return self._compiled(module)

    def _compiled(self, module: nn.Module) -> nn.Module:
        pf = self.perf
        if not pf.compile:
            return module
        return torch.compile(
            module, mode=None if pf.compile_mode is None else str(pf.compile_mode), backend=pf.compile_backend
        )

    def fused_mode(self, mode: str) -> str:
        """perf.fused_optimizer as this strategy can honour it."""
        return mode

    # -------------------------------------------------------------- the step
    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Around a micro-batch whose gradients must stay local (accumulation)."""
        return contextlib.nullcontext()

    def after_first_backward(self, module: nn.Module) -> None:
        """Once, after the first backward: catch what would fail cryptically later."""

    def grad_norm(self, norm: Tensor) -> Tensor:
        """The clip's total norm as a plain tensor on this rank."""
        return norm

    # -------------------------------------------------------- checkpoints
    def checkpoint_entries(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, sidecars: Sidecars
    ) -> dict[str, Stateful]:
        return {"model": ModuleState(module), "optimizer": optimizer}

    # --------------------------------------------------------- evaluation
    def before_eval(self, module: nn.Module) -> None:
        if self.dist.is_distributed and self.d.broadcast_buffers:
            # Without SyncBN each rank's BN running stats drifted on its own
            # shard; evaluate every shard with rank 0's, the ones checkpointed.
            collectives.broadcast_buffers(module, self.dist)

    def finish_eval(
        self, module: nn.Module, forwards_done: int, forwards_needed: int, forward: Callable[[], Any]
    ) -> None:
        """After this rank's evaluation batches: extra forwards, where the strategy needs lockstep."""

    def whole_tensors(self, tensors: list[Tensor]) -> list[Tensor]:
        """Whole, plain copies of tensors shaped like the parameters (for a checkpoint); every rank calls
        it."""
        return [t.detach().clone() for t in tensors]

    def load_whole_tensors(self, into: list[Tensor], full: list[Tensor]) -> None:
        """Copy whole tensors (from a checkpoint) into tensors shaped like the parameters."""
        with torch.no_grad():
            for t, f in zip(into, full):
                t.copy_(f.to(t.device))

    def describe(self) -> list[str]:
        """Parts of the one-line model description that this strategy contributes."""
        return []
