"""The schema's sections on how the job runs on the machine: ``distributed`` (ranks, backend, strategy,
timeouts) and ``perf`` (loader workers, compile, host memory); part of
:class:`ddplab.config.schema.TrainConfig`."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from ddplab.config.choices import TRI_STATE, Backend, CommHook, CompileMode, Device, Strategy
from ddplab.config.errors import require


@dataclass
class DistributedConfig:
    # ddp: one process per device, gradients all-reduced (the default);
    # none: one process, no wrapper; dp: torch.nn.DataParallel, one process
    # over all visible GPUs (slower than ddp; kept to compare); fsdp: FSDP2
    # fully_shard, parameters/gradients/optimizer state sharded over ranks.
    strategy: Strategy = Strategy.ddp
    backend: Backend = Backend.auto  # auto: nccl when the device is CUDA, gloo otherwise
    device: Device = Device.auto  # auto: cuda:LOCAL_RANK when CUDA is available, else cpu
    init_method: str = "env://"  # or tcp://host:port, file:///shared/path
    # A rank that never arrives or dies fails the job after this many seconds
    # instead of hanging forever (torch's own default is 30 min for gloo).
    timeout_s: float = 300.0
    # DDP: a parameter may get no gradient in a step (a branch not taken); costs a graph walk per step. Off,
    # such a parameter is named at step 1 (DDP would otherwise fail cryptically at step 2).
    find_unused_parameters: bool = False
    # BatchNorm layers normalize with the statistics of the global batch (all ranks), not each rank's shard.
    sync_batchnorm: bool = False
    # DDP: the size of a gradient bucket, the unit all-reduced while the backward still runs.
    bucket_cap_mb: float = 25.0
    # DDP: rank 0's buffers (BatchNorm's running statistics) copied to every rank at each forward.
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = True  # grads alias DDP buckets: one copy less
    # >1: `python train.py` starts this many local ranks itself (free port per
    # job, so parallel sweep jobs never collide). Ignored under torchrun/SLURM.
    nproc_per_node: int = 1
    # Self-launch on CPU: more ranks than cores may share them (slower), to try a world size (exactness at 3
    # ranks) on a small machine. Off: such a job is refused (64 ranks on 2 cores start and stall). A GPU
    # takes one rank whatever this says.
    oversubscribe_cpu: bool = False
    max_restarts: int = 0  # self-launch only: restart the ranks this often after a failure
    # The autograd graph is the same every step (no data-dependent branches or
    # unused parameters): DDP can then skip per-step bookkeeping.
    static_graph: bool = False
    # Gradient compression before the all-reduce (halves gradient traffic;
    # helps when the network, not compute, is the limit). bf16 needs NCCL.
    comm_hook: CommHook = CommHook.none
    # fsdp: free the gathered parameters after forward (less memory, one more
    # all-gather in backward); false keeps them until backward (ZeRO-2-like).
    reshard_after_forward: bool = True

    @staticmethod
    def check(d: Any, key: str = "distributed") -> None:
        require(d.timeout_s > 0, f"{key}.timeout_s", d.timeout_s, "must be > 0", f"pass {key}.timeout_s=300")
        require(
            d.bucket_cap_mb > 0,
            f"{key}.bucket_cap_mb",
            d.bucket_cap_mb,
            "must be > 0",
            f"pass {key}.bucket_cap_mb=25",
        )
        require(
            d.nproc_per_node > 0,
            f"{key}.nproc_per_node",
            d.nproc_per_node,
            "must be >= 1",
            f"pass {key}.nproc_per_node=2 (or launch with torchrun)",
        )
        require(
            d.max_restarts >= 0,
            f"{key}.max_restarts",
            d.max_restarts,
            "must be >= 0",
            f"pass {key}.max_restarts=0",
        )
        require(
            d.init_method.split("://")[0] in ("env", "tcp", "file"),
            f"{key}.init_method",
            d.init_method,
            "unknown scheme",
            "use env://, tcp://HOST:PORT or file:///PATH",
        )
        if d.init_method.startswith("file://"):  # torch would wait 300 s for a file it can never create
            folder = os.path.dirname(d.init_method[len("file://") :]) or "."
            require(
                os.path.isdir(folder),
                f"{key}.init_method",
                d.init_method,
                f"its directory {folder} does not exist",
                "create it on a file system every rank sees, or use env:// (torchrun sets it up)",
            )


@dataclass
class PerfConfig:
    """Fast paths. Defaults are on where they help everywhere; the rest are opt-in."""

    # auto: in-memory datasets live on the training device and are batched by
    # indexing (no per-sample __getitem__ + collate) when they fit in a quarter
    # of its free memory; false: a DataLoader over the dataset, per sample.
    data_on_device: str = "auto"  # auto | true | false
    # NHWC activations: faster convolutions on tensor-core GPUs under amp.
    channels_last: bool = False
    # torch.compile the model (before the DDP wrap). First steps pay the compile.
    compile: bool = False
    compile_mode: Optional[CompileMode] = None  # null: torch's default
    compile_backend: str = "inductor"  # torch.compile's backend (inductor; eager or aot_eager to debug)
    # auto: fused optimizer kernels where the optimizer and device support
    # them (one kernel for all parameters), else torch's default.
    fused_optimizer: str = "auto"  # auto | true | false
    # Loader-based datasets only (data that is not an in-memory tensor pair).
    num_workers: int = 0
    pin_memory: bool = True  # with CUDA: page-locked batches, copied with non_blocking
    prefetch_factor: int = 2  # batches each worker keeps ready (torch's default); more absorbs slow decodes
    # Peak TFLOP/s of one device for vitals/mfu; null: looked up for known GPUs.
    peak_tflops: Optional[float] = None
    # tuned: a rank training on the CPU keeps the blocks a step freed for the next step (glibc's malloc
    # thresholds; no page faults per step; memory freed between phases is kept); system: the C library's
    # defaults.
    host_allocator: str = "tuned"  # tuned | system

    @staticmethod
    def check(pf: Any, key: str = "perf") -> None:
        for k in ("data_on_device", "fused_optimizer"):
            require(
                str(pf[k]).lower() in TRI_STATE,
                f"{key}.{k}",
                pf[k],
                "unknown choice",
                f"use {key}.{k}=auto, true or false",
            )
        require(
            pf.num_workers >= 0,
            f"{key}.num_workers",
            pf.num_workers,
            "must be >= 0",
            f"pass {key}.num_workers=4",
        )
        # A loader worker hands each batch's tensors over a unix socket that multiprocessing makes under the
        # temp dir (<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX); a socket path over 107 bytes fails in the worker
        # and the job waits for its batch forever (a long per-job TMPDIR does it).
        sock = len(os.path.join(tempfile.gettempdir(), "pymp-xxxxxxxx", "listener-xxxxxxxx"))
        require(
            pf.num_workers == 0 or sock <= 107,
            f"{key}.num_workers",
            pf.num_workers,
            f"loader workers pass batches over a unix socket under the temp dir {tempfile.gettempdir()}, "
            "whose "
            f"path would be {sock} bytes, over the 107 a socket path may have (the job would hang)",
            f"a shorter TMPDIR (at most {107 - (sock - len(tempfile.gettempdir()))} characters), or "
            f"{key}.num_workers=0",
        )
        require(
            pf.prefetch_factor >= 1,
            f"{key}.prefetch_factor",
            pf.prefetch_factor,
            "must be >= 1",
            f"pass {key}.prefetch_factor=2",
        )
        require(
            str(pf.host_allocator) in ("tuned", "system"),
            f"{key}.host_allocator",
            pf.host_allocator,
            "unknown choice",
            f"use {key}.host_allocator=tuned or system",
        )
        require(
            pf.peak_tflops is None or pf.peak_tflops > 0,
            f"{key}.peak_tflops",
            pf.peak_tflops,
            "must be > 0 or null",
            f"pass {key}.peak_tflops=null",
        )
