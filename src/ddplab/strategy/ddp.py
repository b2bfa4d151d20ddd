"""distributed=ddp: one process per device, gradients all-reduced by DistributedDataParallel.

Order is fixed here: SyncBN and channels_last on the plain module (prepare),
then ``torch.compile``, then the DDP wrap (DDP registers its gradient hooks
on the compiled module's parameters), then the comm hook.
"""

from __future__ import annotations

import inspect
import logging
from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import compat
from ddplab.config import ConfigError
from ddplab.runtime import collectives
from ddplab.strategy.base import Strategy

log = logging.getLogger("ddplab")


def _buffer_sync_kwarg(on: bool) -> dict[str, bool]:
    """torch >= 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": on}
    return {"broadcast_buffers": on}


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, module: nn.Module) -> nn.Module:
        d, dist = self.d, self.dist
        compiled = self._compiled(module)
        with compat.ddp_reducer_without_dynamo():  # DDP asks torch's compiler config: 2 s of CPU to import
            ddp = DDP(
                compiled,
                device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                find_unused_parameters=d.find_unused_parameters,
                bucket_cap_mb=d.bucket_cap_mb,
                gradient_as_bucket_view=d.gradient_as_bucket_view,
                static_graph=d.static_graph,
                **_buffer_sync_kwarg(d.broadcast_buffers),
            )
        if d.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            if d.comm_hook == "bf16" and dist.backend != "nccl":
                raise ConfigError(
                    f"distributed.comm_hook=bf16: torch's bf16 compression needs NCCL (CUDA), this "
                    f"job runs {dist.backend}. Fix: distributed.comm_hook=fp16 (works on gloo) or none"
                )
            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[
                d.comm_hook
            ]
            ddp.register_comm_hook(state=None, hook=hook)  # state=None: the default process group
        # The buckets the whole run reduces in, fixed before step 1 in every process: a restarted one then
        # adds the ranks' gradients in the order the process it replaces did (bitwise resume at 3+ ranks).
        if not compat.settle_ddp_buckets(ddp) and d.static_graph and dist.world_size >= 3:
            log.warning(
                "distributed.static_graph=true: DDP learns its gradient buckets in the first step, so a "
                "run resumed at %d ranks equals the uninterrupted one to rounding (~1e-7), not bitwise. "
                "Fix: distributed.static_graph=false for bitwise resume",
                dist.world_size,
            )
        return ddp

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return model.no_sync()

    def after_first_backward(self, module: nn.Module) -> None:
        """Name parameters that got no gradient in the first step (unless find_unused_parameters).

        Plain DDP waits for every parameter's gradient; one that never comes
        leaves its bucket unreduced, and the next iteration dies with
        "Expected to have finished reduction in the prior iteration" (or the
        step silently uses un-averaged gradients). One flag all-reduce, once.
        """
        if self.d.find_unused_parameters:
            return
        unused = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
        if not collectives.any_rank(bool(unused), self.dist):
            return
        names = ", ".join(unused[:10]) + (f" (+{len(unused) - 10} more)" if len(unused) > 10 else "")
        raise RuntimeError(
            f"parameter(s) that received no gradient in the first step: {names or '(on another rank)'}. "
            "DDP needs a gradient for every parameter each step. Fix: "
            "distributed.find_unused_parameters=true "
            "(costs a graph traversal per step), or freeze them (requires_grad=False) or remove them."
        )

    def describe(self) -> list[str]:
        d = self.d
        return ["static graph"] * d.static_graph + [f"{d.comm_hook} gradient compression"] * (
            d.comm_hook != "none"
        )
