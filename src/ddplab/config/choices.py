"""Typed choices for config fields: an unknown option is rejected by OmegaConf while Hydra
composes, naming the key and listing the valid options (before any process starts)."""

from __future__ import annotations

from enum import Enum
from typing import Any


class Choice(str, Enum):
    """A str-valued enum whose members compare, hash, print and format as their value,
    so ``cfg.amp_dtype == "auto"`` and f-strings keep working on typed fields."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choice(name: str, *values: str) -> Any:
    """A Choice enum named ``name`` with ``values`` as both member names and values."""
    return Choice(name, {v: v for v in values}, module=__name__)


# OmegaConf (2.3) has no Literal; each of these is a module-level name so members pickle.
Strategy = choice("Strategy", "ddp", "none", "dp", "fsdp")
Backend = choice("Backend", "auto", "gloo", "nccl", "mpi")
Device = choice("Device", "auto", "cpu", "cuda")
CommHook = choice("CommHook", "none", "fp16", "bf16")
BatchScope = choice("BatchScope", "global", "per_rank")
AmpDtype = choice("AmpDtype", "auto", "bfloat16", "float16", "bf16", "fp16")
ProgressMode = choice("ProgressMode", "auto", "bar", "log", "none")
NonFinite = choice("NonFinite", "error", "skip")
Mode = choice("Mode", "train", "eval", "verify_resume", "study")
WandbMode = choice("WandbMode", "auto", "online", "offline")
CompileMode = choice(
    "CompileMode", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
)
Stats = choice("Stats", "imagenet", "cifar10", "cifar100", "mnist", "fashion_mnist")

# auto | true | false stays a checked str: Hydra parses `true` as a bool, and OmegaConf
# cannot type a field as "bool or one string" (a Union with an Enum rejects the string).
TRI_STATE = ("auto", "true", "false")
