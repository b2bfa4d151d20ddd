"""Schemas of the ``task`` and ``callbacks`` groups: the shipped tasks' and callbacks' keys, defaults and
checks (a misspelt key fails while composing; a bad value is a ConfigError naming the key and the fix, before
any process group). A task or callback of a user's own needs no schema: its constructor checks its values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ddplab.config.errors import require


# ---------------------------------------------------------------------- tasks
@dataclass
class ClassificationTaskConfig:
    """Images and labels: cross-entropy loss, accuracy (the default task)."""

    _target_: str = "ddplab.task.ClassificationTask"


@dataclass
class RegressionTaskConfig:
    """MSE loss; exact val/mse and val/mae over any world size."""

    _target_: str = "ddplab.task.regression.RegressionTask"


@dataclass
class LanguageModelTaskConfig:
    """Next-byte prediction: mean negative log-likelihood per byte; val/perplexity."""

    _target_: str = "ddplab.task.lm.LanguageModelTask"


@dataclass
class VAETaskConfig:
    """Reconstruction + beta * KL; a grid of reconstructions in TensorBoard's Images tab."""

    _target_: str = "ddplab.task.vae.VAETask"
    beta: float = 1.0  # weight of the KL term
    num_images: int = 8  # reconstructions shown per evaluation

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(c.beta >= 0, f"{key}.beta", c.beta, "must be >= 0 (a KL weight)", f"pass {key}.beta=1.0")
        require(
            c.num_images >= 0, f"{key}.num_images", c.num_images, "must be >= 0", f"pass {key}.num_images=8"
        )


# ------------------------------------------------------------------ callbacks
@dataclass
class EMAConfig:
    _target_: str = "ddplab.callbacks.ema.EMA"
    decay: float = 0.999  # weight of the average's past: ema = decay * ema + (1 - decay) * w, each step
    warmup: bool = True  # the decay ramps up as (1 + n) / (10 + n) over the first updates
    evaluate: bool = True  # evaluated as val_ema/* (the objective may name it)

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(0.0 <= c.decay < 1.0, f"{key}.decay", c.decay, "must be in [0, 1)", f"pass {key}.decay=0.999")


@dataclass
class EarlyStoppingConfig:
    _target_: str = "ddplab.callbacks.early_stopping.EarlyStopping"
    monitor: str = "val/loss"  # any logged tag: val/*, val_ema/* after each evaluation, train/* at log steps
    patience: int = 3  # checks without improvement before the job stops
    min_delta: float = 0.0  # the least change that counts as an improvement
    mode: str = "auto"  # min | max | auto (the task says which metrics are better higher)
    divergence_threshold: Optional[float] = None  # stop at once past this value (null: never)
    check_finite: bool = True  # stop at once when the monitored value is NaN/Inf

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.mode in ("auto", "min", "max"),
            f"{key}.mode",
            c.mode,
            "not a mode",
            f"pass {key}.mode=auto (or min, max)",
        )
        require(c.patience >= 1, f"{key}.patience", c.patience, "must be >= 1", f"pass {key}.patience=3")


@dataclass
class ProfilerConfig:
    _target_: str = "ddplab.callbacks.profiler.Profiler"
    steps: list[int] = field(default_factory=lambda: [10, 15])  # optimizer steps first..last, 1-based
    memory_snapshot: bool = True  # CUDA only: memory-rank<r>.pickle (pytorch.org/memory_viz)

    @staticmethod
    def check(c: Any, key: str) -> None:
        ok = len(c.steps) == 2 and 1 <= c.steps[0] <= c.steps[1]
        require(
            ok,
            f"{key}.steps",
            list(c.steps),
            "need [first, last] with 1 <= first <= last",
            f"pass {key}.steps=[10,15]",
        )


@dataclass
class SamplesConfig:
    _target_: str = "ddplab.callbacks.samples.Samples"
    prompt: str = ""  # the text the model continues after each evaluation (the run's tokenizer encodes it)
    max_new_tokens: int = 32  # tokens written after it
    temperature: float = 0.0  # 0: greedy; else softmax(logits / temperature), from the sampler's own seed
    top_k: Optional[int] = None  # sample among the k likeliest only (null: all)
    seed: int = 0  # the sampler's generator, seeded alike at each evaluation (training's streams untouched)

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.max_new_tokens >= 1,
            f"{key}.max_new_tokens",
            c.max_new_tokens,
            "must be >= 1",
            f"pass {key}.max_new_tokens=32",
        )
        require(
            c.temperature >= 0,
            f"{key}.temperature",
            c.temperature,
            "must be >= 0 (0: greedy)",
            f"pass {key}.temperature=0",
        )
        require(
            c.top_k is None or c.top_k >= 1,
            f"{key}.top_k",
            c.top_k,
            "must be >= 1 or null",
            f"pass {key}.top_k=null",
        )
