"""Typed config schemas and the checks Hydra's types cannot express.

Every yaml file under ``conf/`` is merged over one of these dataclasses, so a
misspelt key (``optimizer.lrr=0.1``) or a wrong type (``num_epochs=abc``) is
rejected by Hydra while composing, naming the dotted key, before any process
group exists. Range checks (``batch_size > 0`` ...) live in :func:`validate`,
which ``ddplab.run`` calls before touching torch.distributed.

Group configs that name a ``_target_`` keep their own schema so that a user can
point ``model=`` at any installed factory with a yaml file of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


# --------------------------------------------------------------------- models
@dataclass
class ModelConfig:
    """Keys every model option has; `weights` is ddplab's (see build.model), the rest go to the factory."""

    _target_: str = MISSING
    num_classes: int = MISSING
    in_channels: int = 1
    weights: Optional[str] = None  # local state_dict file (torchvision format), loaded before the wrap


@dataclass
class ResNetConfig(ModelConfig):
    _target_: str = "ddplab.models.resnet18"
    in_channels: int = 3
    # 3x3 stride-1 stem and no max-pool: keeps 8x8..32x32 images from being
    # pooled away to 1x1 before layer2. Only conv1's kernel shape changes, so
    # state_dict keys stay torchvision's.
    small_input: bool = False
    zero_init_residual: bool = False


@dataclass
class ConvNetConfig(ModelConfig):
    _target_: str = "ddplab.models.ConvNet"
    channels: list[int] = field(default_factory=lambda: [12, 24, 32])
    hidden: int = 256
    dropout: float = 0.5


@dataclass
class MLPConfig(ModelConfig):
    _target_: str = "ddplab.models.MLP"
    image_size: int = 8
    hidden: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.1


@dataclass
class KerasConvNetConfig(ModelConfig):
    """The Keras multi-GPU guide's convnet in Keras 3 (torch backend); needs `pip install keras`."""

    _target_: str = "ddplab.models.keras_convnet.keras_convnet"
    image_size: int = 8
    dropout: float = 0.5


@dataclass
class ViTConfig(ModelConfig):
    """torchvision's VisionTransformer layout; small by default (CPU-sized)."""

    _target_: str = "ddplab.models.VisionTransformer"
    in_channels: int = 3
    image_size: int = 32
    patch_size: int = 4  # must divide image_size
    num_layers: int = 4
    num_heads: int = 4
    hidden_dim: int = 128
    mlp_dim: int = 256
    dropout: float = 0.0
    attention_dropout: float = 0.0


# ------------------------------------------------------------------- datasets
@dataclass
class AugmentConfig:
    """Training-time augmentation, applied to whole batches on the training device."""

    crop_padding: int = 0  # >0: zero-pad by this many pixels, then crop back at a random offset
    hflip: bool = False  # random horizontal flip (wrong for digits/text: leave off there)


@dataclass
class DigitsConfig:
    """scikit-learn's 1,797 8x8 handwritten digits, split once with a fixed seed."""

    _target_: str = "ddplab.data.digits"
    val_fraction: float = 0.2
    split_seed: int = 0  # fixed, independent of `seed`: the val set never moves
    # Read by the model configs through interpolation; fixed by the data.
    num_classes: int = 10
    in_channels: int = 1
    image_size: int = 8
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class SyntheticConfig:
    """Random class-conditional images: learnable, any shape, any size."""

    _target_: str = "ddplab.data.synthetic"
    num_train: int = 1024
    num_val: int = 256
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    noise: float = 1.0  # std of the noise around each class's prototype image
    seed: int = 0
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class FilesConfig:
    """Datasets read from local files under `root` (nothing is downloaded)."""

    _target_: str = MISSING
    root: Optional[str] = None
    num_classes: int = 10
    in_channels: int = 1
    image_size: int = 28
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class MNISTConfig(FilesConfig):
    """MNIST's (or Fashion-MNIST's) four IDX files, gzipped or not."""

    _target_: str = "ddplab.data.mnist"


@dataclass
class CIFARConfig(FilesConfig):
    """CIFAR-10/100 python batches."""

    _target_: str = "ddplab.data.cifar10"
    in_channels: int = 3
    image_size: int = 32
    augment: AugmentConfig = field(default_factory=lambda: AugmentConfig(crop_padding=4, hflip=True))


@dataclass
class ImageFolderConfig(FilesConfig):
    """root/train/<class>/<image> and root/val/<class>/<image>, decoded with Pillow."""

    _target_: str = "ddplab.data.imagefolder"
    num_classes: int = MISSING  # the number of class folders (checked)
    in_channels: int = 3
    image_size: int = 224  # short side resized to this, centre crop to square
    train_dir: str = "train"
    val_dir: str = "val"
    stats: str = "imagenet"  # normalisation: imagenet | cifar10 | cifar100 | mnist | fashion_mnist
    augment: AugmentConfig = field(default_factory=lambda: AugmentConfig(crop_padding=0, hflip=True))


# ------------------------------------------------------------ optim / sched
@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True  # bound to the model's parameters by the trainer
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = True


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    eps: float = 1e-8


@dataclass
class CosineConfig:
    _target_: str = "ddplab.optim.cosine"
    _partial_: bool = True
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # final lr = min_lr_ratio * lr


@dataclass
class StepConfig:
    _target_: str = "ddplab.optim.step"
    _partial_: bool = True
    step_epochs: int = 30  # multiply the lr by gamma every step_epochs epochs
    gamma: float = 0.1
    warmup_steps: int = 0


@dataclass
class ConstantConfig:
    _target_: str = "ddplab.optim.constant"
    _partial_: bool = True
    warmup_steps: int = 0


# ---------------------------------------------------------------- distributed
@dataclass
class DistributedConfig:
    # ddp: one process per device, gradients all-reduced (the default);
    # none: one process, no wrapper; dp: torch.nn.DataParallel, one process
    # over all visible GPUs (slower than ddp; kept to compare); fsdp: FSDP2
    # fully_shard, parameters/gradients/optimizer state sharded over ranks.
    strategy: str = "ddp"
    backend: str = "auto"  # auto: nccl when the device is CUDA, gloo otherwise
    device: str = "auto"  # auto: cuda:LOCAL_RANK when CUDA is available, else cpu
    init_method: str = "env://"  # or tcp://host:port, file:///shared/path
    # A rank that never arrives or dies fails the job after this many seconds
    # instead of hanging forever (torch's own default is 30 min for gloo).
    timeout_s: float = 300.0
    find_unused_parameters: bool = False
    sync_batchnorm: bool = False
    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = True  # grads alias DDP buckets: one copy less
    # >1: `python train.py` starts this many local ranks itself (free port per
    # job, so parallel sweep jobs never collide). Ignored under torchrun/SLURM.
    nproc_per_node: int = 1
    max_restarts: int = 0  # self-launch only: restart the ranks this often after a failure
    # The autograd graph is the same every step (no data-dependent branches or
    # unused parameters): DDP can then skip per-step bookkeeping.
    static_graph: bool = False
    # Gradient compression before the all-reduce: none | fp16 | bf16 (halves
    # gradient traffic; helps when the network, not compute, is the limit).
    comm_hook: str = "none"
    # fsdp: free the gathered parameters after forward (less memory, one more
    # all-gather in backward); false keeps them until backward (ZeRO-2-like).
    reshard_after_forward: bool = True


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
    compile_mode: Optional[str] = None  # null (default) | reduce-overhead | max-autotune
    compile_backend: str = "inductor"
    # auto: fused optimizer kernels where the optimizer and device support
    # them (one kernel for all parameters), else torch's default.
    fused_optimizer: str = "auto"  # auto | true | false
    # Loader-based datasets only (data that is not an in-memory tensor pair).
    num_workers: int = 0
    pin_memory: bool = True  # with CUDA: page-locked batches, copied with non_blocking
    # Peak TFLOP/s of one device for perf/mfu; null: looked up for known GPUs.
    peak_tflops: Optional[float] = None


@dataclass
class CheckpointConfig:
    # Also save every N optimizer steps (0: only at epoch ends). Each save is a
    # full state: a run killed at any step resumes bitwise-identically from it.
    every_n_steps: int = 0
    keep_last: int = 2  # step files kept (plus best.pt); last.pt always points at the newest
    save_best: bool = True  # best.pt: the checkpoint with the best `objective` so far


# ------------------------------------------------------------------ top level
@dataclass
class TrainConfig:
    model: Any = MISSING
    dataset: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)

    seed: int = 0
    num_epochs: int = 10
    # Samples per optimizer micro-step summed over all ranks. Kept global so a
    # run means the same thing on 1 or 8 GPUs; each rank gets batch_size /
    # world_size. Set batch_size_scope=per_rank for the DDP-tutorial meaning.
    batch_size: int = 64
    batch_size_scope: str = "global"  # global | per_rank
    grad_accum_steps: int = 1  # optimizer step every k micro-batches
    grad_clip: float = 0.0  # max global grad norm; 0 disables clipping
    amp: bool = False
    amp_dtype: str = "auto"  # auto (bf16 where supported, else fp16 + GradScaler) | bfloat16 | float16
    log_every_n_steps: int = 10
    eval_every_n_epochs: int = 1
    # null: start fresh; auto: continue from last.pt of this run dir or of the
    # newest earlier run with the same overrides; or a path to a checkpoint.
    resume: Optional[str] = None
    # Stop (after checkpointing) once this many epochs are done, while the lr
    # schedule still spans num_epochs: for time-limited jobs and tests.
    stop_after_epochs: Optional[int] = None
    run_dir: Optional[str] = None  # null: Hydra's output dir (or outputs/<date>/<time>)
    progress: str = "auto"  # auto (bar on a terminal, log lines otherwise) | bar | log | none
    objective: str = "val/acc"  # metric returned to sweepers
    # NaN/Inf training loss: "error" stops at the step, naming it (checked on
    # the device, read at log steps: free); "skip" skips that optimizer step
    # (one host sync and a tiny collective per step).
    nonfinite_loss: str = "error"


_GROUPS = {
    "model": {"resnet_schema": ResNetConfig, "convnet_schema": ConvNetConfig, "mlp_schema": MLPConfig,
              "vit_schema": ViTConfig, "keras_convnet_schema": KerasConvNetConfig},
    "dataset": {"digits_schema": DigitsConfig, "synthetic_schema": SyntheticConfig, "mnist_schema": MNISTConfig,
                "cifar_schema": CIFARConfig, "imagefolder_schema": ImageFolderConfig},
    "optimizer": {"sgd_schema": SGDConfig, "adamw_schema": AdamWConfig},
    "scheduler": {"cosine_schema": CosineConfig, "step_schema": StepConfig, "constant_schema": ConstantConfig},
    "distributed": {"distributed_schema": DistributedConfig},
}


def register_configs() -> None:
    """Make the schemas visible to the yaml defaults lists (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schemas in _GROUPS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name.removesuffix("_schema"), node=node)


# `small_input: ${lt:${dataset.image_size},64}` in conf/model/resnet*.yaml
if not OmegaConf.has_resolver("lt"):
    OmegaConf.register_new_resolver("lt", lambda a, b: a < b)
register_configs()


# ------------------------------------------------------------------ validation
class ConfigError(ValueError):
    """A config value that composes but cannot work; the message names key and fix."""


def _check(ok: bool, key: str, value: Any, why: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}. Fix: {fix}")


def validate(cfg: DictConfig) -> None:
    """Range and choice checks, run on every rank before any process group starts."""
    _check(cfg.num_epochs > 0, "num_epochs", cfg.num_epochs, "must be > 0", "pass num_epochs=10")
    _check(cfg.batch_size > 0, "batch_size", cfg.batch_size, "must be > 0", "pass batch_size=64")
    _check(cfg.batch_size_scope in ("global", "per_rank"), "batch_size_scope", cfg.batch_size_scope,
           "unknown scope", "use batch_size_scope=global or batch_size_scope=per_rank")
    _check(cfg.grad_accum_steps > 0, "grad_accum_steps", cfg.grad_accum_steps, "must be >= 1", "pass grad_accum_steps=1")
    _check(cfg.grad_clip >= 0, "grad_clip", cfg.grad_clip, "must be >= 0 (0 disables)", "pass grad_clip=1.0 or 0")
    _check(cfg.log_every_n_steps > 0, "log_every_n_steps", cfg.log_every_n_steps, "must be > 0", "pass log_every_n_steps=10")
    _check(cfg.eval_every_n_epochs > 0, "eval_every_n_epochs", cfg.eval_every_n_epochs, "must be > 0",
           "pass eval_every_n_epochs=1")
    _check(cfg.amp_dtype in ("auto", "bfloat16", "float16", "bf16", "fp16"), "amp_dtype", cfg.amp_dtype,
           "unknown dtype", "use amp_dtype=auto, bfloat16 or float16")
    _check(cfg.progress in ("auto", "bar", "log", "none"), "progress", cfg.progress, "unknown mode",
           "use progress=auto, bar, log or none")
    _check(cfg.stop_after_epochs is None or cfg.stop_after_epochs > 0, "stop_after_epochs", cfg.stop_after_epochs,
           "must be > 0 or null", "drop the override")
    _check(cfg.nonfinite_loss in ("error", "skip"), "nonfinite_loss", cfg.nonfinite_loss, "unknown policy",
           "use nonfinite_loss=error or nonfinite_loss=skip")
    ck = cfg.checkpoint
    _check(ck.every_n_steps >= 0, "checkpoint.every_n_steps", ck.every_n_steps, "must be >= 0 (0: epoch ends only)",
           "pass checkpoint.every_n_steps=0")
    _check(ck.keep_last >= 1, "checkpoint.keep_last", ck.keep_last, "must be >= 1", "pass checkpoint.keep_last=2")
    root = cfg.dataset.get("root") if isinstance(cfg.dataset, DictConfig) else None
    _check(root is not None or "root" not in cfg.dataset, "dataset.root", root,
           f"{cfg.dataset.get('_target_', 'this dataset')} reads local files (nothing is downloaded)",
           "dataset.root=/path/to/the/files (README 'Datasets' says which files and where to get them)")
    if root:
        from pathlib import Path

        _check(Path(root).exists(), "dataset.root", root, "no such file or directory (nothing is downloaded)",
               "point dataset.root at the folder that holds the dataset's files")
    lr = cfg.optimizer.get("lr") if isinstance(cfg.optimizer, DictConfig) else None
    if lr is not None:
        _check(lr > 0, "optimizer.lr", lr, "must be > 0", "pass optimizer.lr=0.1")
    d = cfg.distributed
    _check(d.backend in ("auto", "gloo", "nccl", "mpi"), "distributed.backend", d.backend, "unknown backend",
           "use distributed.backend=auto (nccl on CUDA, gloo on CPU)")
    _check(d.device in ("auto", "cpu", "cuda"), "distributed.device", d.device, "unknown device",
           "use distributed.device=auto, cpu or cuda")
    _check(d.timeout_s > 0, "distributed.timeout_s", d.timeout_s, "must be > 0", "pass distributed.timeout_s=300")
    _check(d.bucket_cap_mb > 0, "distributed.bucket_cap_mb", d.bucket_cap_mb, "must be > 0",
           "pass distributed.bucket_cap_mb=25")
    _check(d.nproc_per_node > 0, "distributed.nproc_per_node", d.nproc_per_node, "must be >= 1",
           "pass distributed.nproc_per_node=2 (or launch with torchrun)")
    _check(d.max_restarts >= 0, "distributed.max_restarts", d.max_restarts, "must be >= 0",
           "pass distributed.max_restarts=0")
    _check(d.strategy in ("ddp", "none", "dp", "fsdp"), "distributed.strategy", d.strategy, "unknown strategy",
           "pick distributed=ddp, none, dp or fsdp")
    if d.strategy in ("none", "dp"):
        _check(d.nproc_per_node == 1, "distributed.nproc_per_node", d.nproc_per_node,
               f"distributed={d.strategy} runs one process", "distributed=ddp (or fsdp) for several processes")
    if d.strategy == "fsdp":
        _check(not d.sync_batchnorm, "distributed.sync_batchnorm", d.sync_batchnorm,
               "not supported with distributed=fsdp", "distributed.sync_batchnorm=false, or distributed=ddp")
        _check(not cfg.perf.compile, "perf.compile", cfg.perf.compile, "not wired for distributed=fsdp yet",
               "perf.compile=false, or distributed=ddp")
    _check(d.comm_hook in ("none", "fp16", "bf16"), "distributed.comm_hook", d.comm_hook, "unknown hook",
           "use distributed.comm_hook=none, fp16 or bf16")
    pf = cfg.perf
    for key in ("data_on_device", "fused_optimizer"):
        _check(str(pf[key]).lower() in ("auto", "true", "false"), f"perf.{key}", pf[key], "unknown choice",
               f"use perf.{key}=auto, true or false")
    _check(pf.compile_mode in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
           "perf.compile_mode", pf.compile_mode, "unknown mode", "use perf.compile_mode=null or reduce-overhead")
    _check(not pf.compile or d.bucket_cap_mb >= 1, "distributed.bucket_cap_mb", d.bucket_cap_mb,
           "with perf.compile=true buckets must hold at least DDP's 1 MB first bucket (dynamo splits the graph "
           "at bucket boundaries)", "pass distributed.bucket_cap_mb=25, or perf.compile=false")
    _check(pf.num_workers >= 0, "perf.num_workers", pf.num_workers, "must be >= 0", "pass perf.num_workers=4")
    _check(pf.peak_tflops is None or pf.peak_tflops > 0, "perf.peak_tflops", pf.peak_tflops, "must be > 0 or null",
           "pass perf.peak_tflops=null")
    aug = cfg.dataset.get("augment") if isinstance(cfg.dataset, DictConfig) else None
    if aug is not None:
        _check(aug.crop_padding >= 0, "dataset.augment.crop_padding", aug.crop_padding, "must be >= 0",
               "pass dataset.augment.crop_padding=4 (or 0: off)")
    _check(d.init_method.split("://")[0] in ("env", "tcp", "file"), "distributed.init_method", d.init_method,
           "unknown scheme", "use env://, tcp://HOST:PORT or file:///PATH")
