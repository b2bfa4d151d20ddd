"""distributed=fsdp: FSDP2 ``fully_shard`` — parameters, gradients and optimizer state sharded.

Parameters become DTensors: the clip's norm is one too, fused optimizers have
no kernels for them, and checkpoints are sharded (torch.distributed.checkpoint,
every rank writes its part into ``step-N.dcp/`` next to rank 0's ``step-N.pt``).
FSDP's forward all-gathers, so evaluation runs equal forwards on every rank.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from ddplab.checkpoint.files import CheckpointWriteError, free_space
from ddplab.config import ConfigError
from ddplab.strategy.base import Sidecars, Strategy

if TYPE_CHECKING:  # the type only: torch.distributed.checkpoint costs ~0.6 s to import
    from torch.distributed.checkpoint.stateful import Stateful


def _first_failure(e: BaseException) -> str:
    """DCP's CheckpointException as one line: which ranks failed, and the first one's error."""
    failures = getattr(e, "failures", None)
    if failures:
        first = failures[min(failures)][0]
        return f"rank(s) {sorted(failures)} failed to write: {type(first).__name__}: {str(first).strip()}"
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


@contextlib.contextmanager
def _written_or_removed(path: Path) -> Iterator[None]:
    """A failed sharded write removes its partial shards (they would keep a full disk full for the retry;
    the step file naming them was not written yet) and raises one line. DCP gathers every rank's write
    result, so all ranks raise here together."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as e:  # (torch's CheckpointException is a BaseException)
        shutil.rmtree(path, ignore_errors=True)
        raise CheckpointWriteError(
            f"could not write sharded checkpoint {path}: {_first_failure(e)} ({free_space(path.parent)} on "
            "its file system). The previous checkpoint is intact. Fix: free space (or point run_dir "
            "elsewhere), then run the same command with resume=auto"
        ) from None


class ShardedState:
    """Stateful: model + optimizer written by every rank into a sidecar directory (collective)."""

    SUFFIX = "dcp"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, sidecars: Sidecars):
        self.module, self.optimizer, self.sidecars = module, optimizer, sidecars

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        path = self.sidecars.sidecar_path(self.SUFFIX)
        with _written_or_removed(path):
            dcp.save(self._state(), checkpoint_id=str(path))
        return {"sidecar": path.name}

    def stage(self, group: Any) -> tuple[dict[str, Any], Callable[[], None]]:
        """checkpoint.async_save: DCP copies this rank's shards to CPU now and writes them in its own
        thread (collectives on ``group``, not the loop's). The entry, and a call that blocks until the
        shards are written (or raises as :meth:`state_dict` does)."""
        import torch.distributed.checkpoint as dcp

        path = self.sidecars.sidecar_path(self.SUFFIX)
        with _written_or_removed(path):
            future = dcp.async_save(self._state(), checkpoint_id=str(path), process_group=group)

        def finish() -> None:
            with _written_or_removed(path):
                future.result()

        return {"sidecar": path.name}, finish

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def check(self, ck: dict[str, Any], path: Path) -> None:
        if "sharded" not in ck:
            from ddplab.config.drift import flatten

            saved = (
                flatten(ck["meta"]["config"]).get("distributed.strategy", "ddp") if "meta" in ck else "ddp"
            )
            raise ConfigError(
                f"resume={path}: was saved without distributed=fsdp (full weights). Fix: resume it "
                f"with the strategy it was saved with (distributed={saved}), or resume=null"
            )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Read this rank's shards back (any world size: DCP reshards on load); collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = self.sidecars.resolve_sidecar(sd["sidecar"])
        if not (path / ".metadata").is_file():
            raise RuntimeError(f"resume: sharded checkpoint {path} is missing or incomplete (no .metadata)")
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


class FSDPStrategy(Strategy):
    name = "fsdp"
    one_file_checkpoints = False
    # FSDP2's sharding makes fake tensors, whose mode imports torch's compiler stack (2 s of CPU): in a rank
    # server, once for all the ranks.
    rank_imports = ("torch._dynamo",)
    counts_flops = False  # a forward outside the step would all-gather out of step with other ranks

    @classmethod
    def refuse(cls, cfg: DictConfig, world_size: int) -> None:
        if cfg.distributed.sync_batchnorm:
            raise ConfigError(
                "distributed.sync_batchnorm=True: not supported with distributed=fsdp. "
                "Fix: distributed.sync_batchnorm=false, or distributed=ddp"
            )
        if cfg.perf.compile:
            raise ConfigError(
                "perf.compile=True: not wired for distributed=fsdp yet. "
                "Fix: perf.compile=false, or distributed=ddp"
            )
        if cfg.perf.channels_last:  # channels_last conv weights are not contiguous; fully_shard refuses them
            raise ConfigError(
                "perf.channels_last=True: FSDP shards only contiguous parameters. "
                "Fix: perf.channels_last=false, or distributed=ddp"
            )

    def wrap(self, module: nn.Module) -> nn.Module:
        """Each top-level child with parameters is one unit (its all-gather overlaps the previous
        unit's compute) — or the blocks a model names itself (``fsdp_units()``: a Hugging Face model's
        decoder layers) — then the root takes whatever parameters are left. In place: the module
        that evaluation and checkpoints use is the sharded one too."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The mesh on the training device: fully_shard's own default is the host's accelerator, cuda on a GPU
        # host even for distributed.device=cpu, whose parameters it then refuses.
        mesh = init_device_mesh(self.dist.device.type, (self.dist.world_size,))
        reshard = self.d.reshard_after_forward
        units = module.fsdp_units() if hasattr(module, "fsdp_units") else list(module.children())
        for child in units:
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        return module

    def fused_mode(self, mode: str) -> str:
        return "false" if str(mode).lower() == "auto" else mode  # torch has no fused kernels for DTensors

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def grad_norm(self, norm: Tensor) -> Tensor:
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def checkpoint_entries(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, sidecars: Sidecars
    ) -> dict[str, Stateful]:
        return {"sharded": ShardedState(module, optimizer, sidecars)}

    def whole_tensors(self, tensors: list[Tensor]) -> list[Tensor]:
        # DTensor shards → the whole tensor on every rank (an all-gather each; checkpoint time only).
        return [
            t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()
            for t in tensors
        ]

    def load_whole_tensors(self, into: list[Tensor], full: list[Tensor]) -> None:
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for t, f in zip(into, full):
                if hasattr(t, "device_mesh"):  # this rank's shard of the whole tensor
                    t.copy_(distribute_tensor(f.to(t.device), t.device_mesh, t.placements))
                else:
                    t.copy_(f.to(t.device))

    def finish_eval(
        self, module: nn.Module, forwards_done: int, forwards_needed: int, forward: Callable[[], Any]
    ) -> None:
        # Every rank must run as many all-gathering forwards as rank 0 (the largest
        # shard): extra forwards on one sample, results dropped.
        for _ in range(forwards_needed - forwards_done):
            forward()
