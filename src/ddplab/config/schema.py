"""The top-level schema (``train.yaml`` merges over :class:`TrainConfig`) and its typed sub-configs
(``distributed`` and ``perf``: system.py). Each field's default is set here and nowhere else; each class
checks its own ranges in ``check`` (run by :func:`ddplab.config.validate`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ddplab.config.choices import AmpDtype, BatchScope, Mode, NonFinite, ProgressMode, WandbMode
from ddplab.config.errors import require
from ddplab.config.system import DistributedConfig, PerfConfig


def _installed(package: str) -> bool:
    """``package`` is importable as installed: found without running it, and not a mere folder of that name in
    the working dir (a namespace package, which imports and then lacks everything; MLflow's own ``mlflow/``
    data folder is one)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


@dataclass
class CheckpointConfig:
    # Also save every N optimizer steps (0: only at epoch ends). Each save is a
    # full state: a run killed at any step resumes bitwise-identically from it.
    every_n_steps: int = 0
    keep_last: int = 2  # step files kept (plus best.pt); last.pt always points at the newest
    save_best: bool = True  # best.pt: the checkpoint with the best `objective` so far
    enabled: bool = True  # false: write no checkpoints at all (debug runs)
    # true: the loop pauses only to copy the state to CPU memory; a background thread writes it (one in
    # flight; stops and the run's end wait for it). Costs one copy of the state in CPU memory.
    async_save: bool = False

    @staticmethod
    def check(c: Any, key: str = "checkpoint") -> None:
        require(
            c.every_n_steps >= 0,
            f"{key}.every_n_steps",
            c.every_n_steps,
            "must be >= 0 (0: epoch ends only)",
            f"pass {key}.every_n_steps=0",
        )
        require(c.keep_last >= 1, f"{key}.keep_last", c.keep_last, "must be >= 1", f"pass {key}.keep_last=2")


@dataclass
class VerifyConfig:
    """mode=verify_resume (ddplab.verify): where to preempt the job, at how many ranks to resume it."""

    stop_at: Optional[int] = None  # the optimizer step to preempt at; null: half the job's steps
    resume_nproc: Optional[int] = None  # ranks of the resumed run; null: distributed.nproc_per_node
    rtol: float = 1e-4  # tolerance of weights and losses when resume_nproc changes the world size

    @staticmethod
    def check(c: Any, key: str = "verify") -> None:
        for k in ("stop_at", "resume_nproc"):
            require(
                c.get(k) is None or c[k] >= 1,
                f"{key}.{k}",
                c.get(k),
                "must be >= 1 or null",
                f"pass {key}.{k}=null",
            )
        require(0 <= c.rtol < 1, f"{key}.rtol", c.rtol, "must be in [0, 1)", f"pass {key}.rtol=1e-4")


@dataclass
class StudyConfig:
    """mode=study (ddplab.study): this process is one worker of an Optuna study that any number of
    workers share through ``storage``; each asks for a trial, trains it as a normal run, tells the result."""

    name: str = "study"  # the study in the storage; reusing a name with another space is refused
    # trial run dirs <dir>/<number>/, summary.md; shared by the workers
    dir: str = "multirun/study-${study.name}"
    # null: sqlite:///<dir>/study.db; or journal:<file>, postgresql://..., mysql://...
    storage: Optional[str] = None
    n_trials: int = 16  # trials in the study, over all workers (running, finished or failed)
    # key -> expression, the Hydra Optuna sweeper's grammar: interval(lo, hi), tag(log, interval(lo, hi)),
    # tag(int, interval(lo, hi)), range(lo, hi[, step]), choice(a, b, ...)
    params: Any = field(default_factory=dict)
    # The Optuna sampler that proposes each trial's params (any optuna.samplers class by _target_; its seed is
    # the study's seed plus the worker's number).
    sampler: Any = field(
        default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "n_startup_trials": 5}
    )
    pruner: Any = None  # e.g. {_target_: optuna.pruners.MedianPruner, n_warmup_steps: 1}; null: never prune
    # a trial whose worker died (no result recorded) is resumed this many times, then failed
    max_retries: int = 2
    timeout_s: float = 20.0  # opening the storage (a database that does not answer) fails after this long

    @staticmethod
    def check(c: Any, key: str = "study") -> None:
        require(c.n_trials >= 1, f"{key}.n_trials", c.n_trials, "must be >= 1", f"pass {key}.n_trials=16")
        require(
            c.max_retries >= 0,
            f"{key}.max_retries",
            c.max_retries,
            "must be >= 0",
            f"pass {key}.max_retries=2",
        )
        require(c.timeout_s > 0, f"{key}.timeout_s", c.timeout_s, "must be > 0", f"pass {key}.timeout_s=20")
        require(
            bool(str(c.name).strip()) and "/" not in str(c.name),
            f"{key}.name",
            c.name,
            "must be a non-empty name without '/'",
            f"pass {key}.name=my_study",
        )


@dataclass
class MLflowConfig:
    """logger=[tensorboard,mlflow] (ddplab.tracking): rank 0's scalars, config and tags to an MLflow run
    too."""

    tracking_uri: Optional[str] = None  # null: MLflow's own (MLFLOW_TRACKING_URI, else its local store)
    experiment: Optional[str] = None  # null: the study's or the sweep's, else "ddplab"
    close_timeout_s: float = 30.0  # at the end, how long MLflow may take to receive what is still queued
    # while the server cannot be reached, how often the writer tries again (what it missed is sent then)
    retry_s: float = 30.0
    # at a successful end, the run's model (python -m ddplab export's folder) as model/
    log_model: bool = True

    @staticmethod
    def check(c: Any, key: str = "mlflow") -> None:
        require(
            c.close_timeout_s > 0,
            f"{key}.close_timeout_s",
            c.close_timeout_s,
            "must be > 0",
            f"pass {key}.close_timeout_s=30",
        )


@dataclass
class WandbConfig:
    """logger=[tensorboard,wandb] (ddplab.tracking_wandb): rank 0's scalars, config and tags to a Weights &
    Biases run too."""

    project: str = "ddplab"  # the W&B project the runs go to
    entity: Optional[str] = None  # the W&B team or user; null: the key's default
    # auto: online where W&B has a key (WANDB_API_KEY, `wandb login`) or WANDB_MODE is set, else offline (the
    # run's files in <run dir>/wandb, sent later with `wandb sync`); online; offline
    mode: WandbMode = WandbMode["auto"]
    group: Optional[str] = None  # null: the study's or the sweep's name, else none
    tags: list[str] = field(default_factory=list)  # the W&B run's tags
    init_timeout_s: float = 60.0  # online: how long W&B may take to start; past it the run is logged offline
    close_timeout_s: float = 30.0  # at the end, how long W&B may take to receive what is still queued
    retry_s: float = 30.0  # while W&B cannot take records, how often the writer tries again
    log_model: bool = True  # at a successful end, the run's model (export's folder) as an artifact

    @staticmethod
    def check(c: Any, key: str = "wandb") -> None:
        for k in ("init_timeout_s", "close_timeout_s", "retry_s"):
            require(c[k] > 0, f"{key}.{k}", c[k], "must be > 0", f"pass {key}.{k}=30")
        require(
            bool(str(c.project).strip()) and "/" not in str(c.project),
            f"{key}.project",
            c.project,
            "must be a non-empty name without '/'",
            f"pass {key}.project=my_project",
        )


LOGGERS = ("tensorboard", "mlflow", "wandb")


@dataclass
class TrainConfig:
    model: Any = MISSING
    dataset: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    # What a batch means: a Task class (``_target_``) and its arguments; conf/task/ (ddplab.task).
    task: Any = MISSING
    # name -> a Callback ``_target_`` and its arguments: 'callbacks=[ema,early_stopping]' (ddplab.callbacks).
    callbacks: Any = field(default_factory=dict)
    # train: the job trains; eval: evaluate the checkpoint `resume` names, with its own config, and stop;
    # verify_resume: run the job, and again preempted + resumed, and compare the two ends (ddplab.verify);
    # study: be one worker of an Optuna study, training its trials one after another (ddplab.study).
    mode: Mode = Mode["train"]
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # mode=verify_resume only
    study: StudyConfig = field(default_factory=StudyConfig)  # mode=study only
    perf: PerfConfig = field(default_factory=PerfConfig)
    # Where rank 0's scalars go: TensorBoard always (the run dir's record), MLflow too with
    # [tensorboard,mlflow], Weights & Biases with [tensorboard,wandb] (or all three).
    logger: Any = field(default_factory=lambda: ["tensorboard"])
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    seed: int = 0  # same on every rank for init and data order; dropout streams differ per rank
    # The run's length in epochs (and the lr schedule's); with max_steps too, whichever ends first (said at
    # start-up); null: by max_steps alone (ddplab.train.length).
    num_epochs: Optional[int] = 20
    # The run's length in optimizer steps (and the lr schedule's), or null: by num_epochs alone;
    # num_epochs=null max_steps=N trains by steps alone.
    max_steps: Optional[int] = None
    # Samples per optimizer micro-step summed over all ranks. Kept global so a
    # run means the same thing on 1 or 8 GPUs; each rank gets batch_size /
    # world_size. Set batch_size_scope=per_rank for the DDP-tutorial meaning.
    batch_size: int = 64
    # What batch_size counts: global (all ranks together: the same run on any world size) or per_rank (each
    # rank's own batch, as the DDP tutorials write it: the global batch grows with the world size).
    batch_size_scope: BatchScope = BatchScope["global"]
    grad_accum_steps: int = 1  # optimizer step every k micro-batches
    grad_clip: float = 0.0  # max global grad norm; 0 disables clipping
    amp: bool = False  # autocast: bf16 where native (Ampere+, AVX512-BF16/AMX), fp16 on older GPUs, else fp32
    amp_dtype: AmpDtype = AmpDtype.auto  # or bfloat16 | float16 (bf16 | fp16)
    log_every_n_steps: int = 10  # one collective per interval (and one at each epoch's end)
    eval_every_n_epochs: int = 1  # the last epoch is always evaluated
    # >0: evaluate every N optimizer steps (mid-epoch too) and at the run's last step, instead of at epoch
    # ends
    eval_every_n_steps: int = 0
    # null: start fresh; auto: continue from last.pt of this run dir (or, when
    # Hydra made up the dir, of the newest earlier run with the same overrides);
    # or a path to a checkpoint.
    resume: Optional[str] = None
    # Resuming with a config that trains differently (lr, batch, model, data, seed, ...) is refused,
    # listing the differences; true continues from the checkpoint with the new values applied.
    resume_apply_changes: bool = False
    # mode=eval builds the model, data, task and callbacks a checkpoint's own config names: only what ddplab
    # ships, torch.optim's classes or what this command names. true also builds any other _target_ in it (a
    # run dir you trust: it can run any code). docs/security.md.
    trust_stored_config: bool = False
    # Config keys whose values are secrets (dotted: [callbacks.upload.token]): masked (***) in everything
    # ddplab writes or prints. URIs' user info and keys named password/secret/api_key/... always are.
    redact_keys: list[str] = field(default_factory=list)
    # Stop (after checkpointing) once this many epochs are done, while the lr
    # schedule still spans num_epochs: for time-limited jobs and tests.
    stop_after_epochs: Optional[int] = None
    run_dir: Optional[str] = None  # null: Hydra's output dir (or outputs/<date>/<time>)
    # Debugging (debug=fast_dev_run): at most this many optimizer steps per epoch. null: every step.
    limit_train_steps: Optional[int] = None
    # Debugging (debug=fast_dev_run): at most this many evaluation batches per rank. null: the whole split.
    limit_val_batches: Optional[int] = None
    # Debugging (debug=overfit): train on the first N optimizer steps' samples only (the same ones each epoch,
    # shuffled) and evaluate on them too: a model that cannot fit them has a bug. 0: off.
    overfit_batches: int = 0
    progress: ProgressMode = ProgressMode.auto  # auto: a bar on a terminal, log lines otherwise
    # The validation metric that picks best.pt and is returned to sweepers; higher is
    # better, except for a loss (val/loss), which is minimised.
    objective: str = "val/acc"
    # NaN/Inf training loss: "error" stops at the step, naming it (checked on
    # the device, read at log steps: free); "skip" skips that optimizer step
    # (one host sync and a tiny collective per step).
    nonfinite_loss: NonFinite = NonFinite.error

    @staticmethod
    def check(c: Any, key: str = "") -> None:
        _check_loggers(list(c.logger or []))
        _check_lengths(c)
        # torch and numpy take seeds below 2**63 / 2**64; per-epoch seeds add up to ~1e6 * epochs.
        require(0 <= c.seed < 2**62, "seed", c.seed, "must be in [0, 2**62)", "pass seed=0")
        require(
            c.objective.split("/", 1)[0].startswith("val") and "/" in c.objective,
            "objective",
            c.objective,
            "must name a validation metric (best.pt and sweepers follow it)",
            "pass objective=val/acc",
        )
        require(
            c.grad_clip >= 0, "grad_clip", c.grad_clip, "must be >= 0 (0 disables)", "pass grad_clip=1.0 or 0"
        )
        require(
            str(c.mode) != "eval" or (c.resume and c.resume != "auto"),
            "resume",
            c.resume,
            "mode=eval evaluates a checkpoint: name it",
            "pass resume=<checkpoint .pt or run dir>",
        )


def _check_loggers(loggers: list[str]) -> None:
    require(
        set(loggers) <= set(LOGGERS) and "tensorboard" in loggers,
        "logger",
        loggers,
        f"one or more of {', '.join(LOGGERS)}, tensorboard among them (the run dir's own record)",
        "pass logger=[tensorboard,mlflow]",
    )
    # Here, on every rank before its process group: only rank 0 opens the MLflow run, and a rank 0 that
    # found MLflow missing there left its peers to blame a killed rank.
    require(
        "mlflow" not in loggers or _installed("mlflow"),
        "logger",
        loggers,
        "needs MLflow, which is not installed",
        "pip install 'ddplab[mlflow]', or logger=[tensorboard]",
    )
    require(
        "wandb" not in loggers or _installed("wandb"),
        "logger",
        loggers,
        "needs wandb, which is not installed",
        "pip install 'ddplab[wandb]', or logger=[tensorboard]",
    )


def _check_lengths(c: Any) -> None:
    """How long the job runs, in what batches, and how often it logs and evaluates: every count in range."""
    for k, lo, example in (
        ("batch_size", 1, 64),
        ("grad_accum_steps", 1, 1),
        ("log_every_n_steps", 1, 10),
        ("eval_every_n_epochs", 1, 1),
    ):
        require(c[k] >= lo, k, c[k], "must be > 0", f"pass {k}={example}")
    for k, example in (("num_epochs", 10), ("max_steps", 1000)):
        require(c[k] is None or c[k] >= 1, k, c[k], "must be > 0 or null", f"pass {k}={example}")
    require(
        c.num_epochs is not None or c.max_steps is not None,
        "num_epochs",
        None,
        "with max_steps=null too, the run would never end",
        "pass num_epochs=10 or max_steps=1000",
    )
    require(
        c.eval_every_n_steps >= 0,
        "eval_every_n_steps",
        c.eval_every_n_steps,
        "must be >= 0 (0: at epoch ends)",
        "pass eval_every_n_steps=500",
    )
    require(
        c.stop_after_epochs is None or c.stop_after_epochs > 0,
        "stop_after_epochs",
        c.stop_after_epochs,
        "must be > 0 or null",
        "drop the override",
    )
    for k in ("limit_train_steps", "limit_val_batches"):
        require(c[k] is None or c[k] > 0, k, c[k], "must be > 0 or null", f"pass {k}=null")
    require(
        c.overfit_batches >= 0,
        "overfit_batches",
        c.overfit_batches,
        "must be >= 0",
        "pass overfit_batches=0 (off)",
    )
