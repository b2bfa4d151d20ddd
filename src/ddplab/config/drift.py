"""Config drift on resume: which differences between a checkpoint's config and the current
one change what the run computes, and the refusal that lists them.

Resuming with ``optimizer.lr=0.5`` used to train on at the checkpoint's lr while the new
run dir claimed 0.5. Now every key that shapes the trajectory (model, data, optimizer,
schedule, batch, seed, precision, length) must match; ``resume_apply_changes=true`` is the
explicit way to continue with new values, which the trainer then really applies.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab.config.errors import ConfigError

# Keys (or key prefixes ending in ".") that never change the numbers a run computes: where it
# runs, how it is launched, logged, checkpointed and how long this invocation lasts.
HARMLESS = (
    "resume",
    "resume_apply_changes",
    "run_dir",
    "stop_after_epochs",
    "progress",
    "log_every_n_steps",
    "eval_every_n_epochs",
    "eval_every_n_steps",
    "objective",
    "nonfinite_loss",
    "checkpoint.",
    "distributed.",
    "perf.",
    "hparams_search.",
    "hydra.",
    "mode",
    "limit_val_batches",
    "callbacks.",
    "verify.",
    "study.",
    "logger",
    "mlflow.",
    "wandb.",
    "redact_keys",
    "trust_stored_config",
)
ABSENT = "<absent>"


def flatten(cfg: Any) -> dict[str, Any]:
    """Dotted keys → plain values of a resolved config (a DictConfig, a dict or its YAML text)."""
    if isinstance(cfg, str):
        cfg = OmegaConf.create(cfg)
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(cfg, "")
    return out


def _matters(key: str) -> bool:
    # "callbacks." also covers an empty "callbacks" node (flattened as a leaf: {}); a bare name covers only
    # itself and its children ("mode", not "model.hidden")
    return not any(
        key == h.rstrip(".") or key.startswith(h if h.endswith(".") else h + ".") for h in HARMLESS
    )


def trajectory(cfg: Any) -> dict[str, Any]:
    """The keys that decide what the run computes, with their values; secrets masked, as a checkpoint stores
    them (ddplab.redact), so a stored config and the live one compare equal, a rotated token included."""
    from ddplab import redact

    flat = flatten(cfg)
    keys = tuple(flat.get("redact_keys") or ()) + redact.active()
    return {
        k: (
            redact.MASK
            if redact.is_secret_key(k, keys) and v is not None
            else redact.text(v, keys)
            if isinstance(v, str)
            else v
        )
        for k, v in flat.items()
        if _matters(k)
    }


def trajectory_digest(cfg: Any) -> str:
    """Short hash of :func:`trajectory`: equal for two configs that train the same run, whatever their
    harmless keys (``resume=auto`` finds earlier runs of the same command by it)."""
    blob = json.dumps(trajectory(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def differences(saved: Any, current: Any) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, current value) for every trajectory key that differs."""
    old, new = trajectory(saved), trajectory(current)
    keys = sorted(set(old) | set(new))
    return [
        (k, old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys if old.get(k, ABSENT) != new.get(k, ABSENT)
    ]


def describe(diffs: list[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {k}: {a!r} in the checkpoint -> {b!r} now" for k, a, b in diffs)


def check_diffs(diffs: list[tuple[str, Any, Any]], current: Any, source: str) -> list[tuple[str, Any, Any]]:
    """``diffs`` (see :func:`differences`) when the user opted in to apply them; ConfigError otherwise."""
    if diffs and not current.resume_apply_changes:
        raise ConfigError(
            f"resume={current.resume}: {source} was trained with a different config; resuming would "
            f"silently keep its values for:\n{describe(diffs)}\nFix: drop these overrides to continue that "
            "run "
            "as it was, start a new run (resume=null, another run dir), or pass resume_apply_changes=true to "
            "continue from the checkpoint with the new values (recorded in the run dir's config_changes.yaml)"
        )
    return diffs
