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


def load_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Load ``path`` into ``model``; returns the keys left at their initialisation (shape mismatch)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model.weights={path}: no such file. Fix: the path of a saved state_dict "
                                "(nothing is downloaded), or model.weights=null")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"model.weights={path}: not a state_dict (a dict of tensors)")
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in obj.items()}
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"model.weights={path} does not fit {type(model).__name__}: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}. Fix: the weights of this architecture")
    skipped = [k for k in own if own[k].shape != state[k].shape]
    for k in skipped:
        log.warning("model.weights: %s kept at its initialisation (file %s, model %s)", k,
                    tuple(state[k].shape), tuple(own[k].shape))
        state[k] = own[k]
    model.load_state_dict(state)
    log.info("model.weights: loaded %d tensors from %s", len(own) - len(skipped), path)
    return skipped
