"""Loading pretrained weights from a local file (``model.weights=path``), before the DDP wrap.

Accepts a plain state_dict (torchvision's ``.pth`` files are one), a ddplab
checkpoint (its ``model`` entry) or a dict with a ``state_dict`` entry, with
``module.`` (DDP/DP) or ``_orig_mod.`` (torch.compile) prefixes stripped.
Tensors whose shape differs — the classifier when ``num_classes`` differs,
the stem when ``small_input`` or ``in_channels`` differ — keep their fresh
initialisation, with a warning naming them: that is fine-tuning. Missing or
unexpected keys mean another architecture, and are an error.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("ddplab")


def _few(xs: list[str]) -> str:
    return ", ".join(xs[:8]) + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "")


def state_dict_mismatch(
    own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], shapes: bool = True
) -> str:
    """What keeps ``state`` from loading into a module whose state_dict is ``own``; "" if it fits.

    ``shapes=False`` ignores shape differences (fine-tuning keeps those tensors at their init).
    """
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    bad = (
        sorted(
            f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
            for k in set(own) & set(state)
            if own[k].shape != state[k].shape
        )
        if shapes
        else []
    )
    parts = [
        f"shape mismatch: {_few(bad)}" if bad else "",
        f"missing: {_few(missing)}" if missing else "",
        f"unexpected: {_few(unexpected)}" if unexpected else "",
    ]
    return "; ".join(p for p in parts if p)


def load_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Load ``path`` into ``model``; returns the keys left at their initialisation (shape mismatch)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model.weights={path}: no such file. Fix: the path of a saved state_dict "
            "(nothing is downloaded), or model.weights=null"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a text file, a truncated download, a pickle with code in it
        raise ValueError(
            f"model.weights={path}: not a readable torch state_dict file ({type(e).__name__}: "
            f"{str(e)[:160]}). Fix: the path of a saved state_dict, or model.weights=null"
        ) from e
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"model.weights={path}: not a state_dict (a dict of tensors)")
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in obj.items()}
    own = model.state_dict()
    problems = state_dict_mismatch(own, state, shapes=False)
    if problems:
        raise ValueError(
            f"model.weights={path} does not fit {type(model).__name__}: {problems}. "
            "Fix: the weights of this architecture"
        )
    skipped = [k for k in own if own[k].shape != state[k].shape]
    for k in skipped:
        log.warning(
            "model.weights: %s kept at its initialisation (file %s, model %s)",
            k,
            tuple(state[k].shape),
            tuple(own[k].shape),
        )
        state[k] = own[k]
    model.load_state_dict(state)
    log.info("model.weights: loaded %d tensors from %s", len(own) - len(skipped), path)
    return skipped
