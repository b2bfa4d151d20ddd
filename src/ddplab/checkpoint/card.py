"""The model card an export writes (README.md): what the model is, how it scored, what it was trained on and
how, and how to load it. No absolute path of the machine it was written on: the card travels."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

TITLE = " exported by ddplab"  # the model card's first line ends so: how an earlier export is known


def card(
    ck: dict[str, Any], path: Path, run_dir: Path | None, weights: str, files: list[str], fmt: str
) -> str:
    """README.md of the export: what it is, how it scored, what it was trained on and how (no absolute path:
    the card travels)."""
    cfg = OmegaConf.create(ck["meta"]["config"])
    res, loop = ck.get("results", {}), ck.get("loop", {})
    prov = (
        json.loads((run_dir / "provenance.json").read_text())
        if run_dir and (run_dir / "provenance.json").is_file()
        else {}
    )
    metrics = {
        **res.get("last_val", {}),
        **({"best " + str(cfg.get("objective")): res["best"]} if "best" in res else {}),
    }
    rows = "\n".join(f"| {k} | {v:.6g} |" for k, v in metrics.items() if isinstance(v, (int, float)))
    code = prov.get("code", {})
    return "\n".join(
        [
            f"# {cfg.model._target_.rsplit('.', 1)[-1]}{TITLE}",
            "",
            f"- model: `{cfg.model._target_}` (its config: `config.yaml`, `model:`)",
            f"- weights: {weights}",
            f"- files: {', '.join(f'`{f}`' for f in files)}",
            f"- from: `{within(path, run_dir)}` (step {loop.get('step')}, epoch {loop.get('epoch')}, "
            f"world size {ck['meta'].get('world_size')})",
            f"- data: `{cfg.dataset.get('_target_')}`; task `{cfg.task.get('_target_')}`",
            f"- code: {code.get('commit', 'unknown')}"
            f"{' (uncommitted changes)' if code.get('dirty') else ''}; "
            f"torch {prov.get('packages', {}).get('torch', torch.__version__)}",
            f"- command: `{' '.join(_portable(prov.get('command', []), prov.get('cwd'))) or 'unknown'}`",
            "",
            "| metric | value |",
            "|---|---|",
            rows or "| (none recorded) | |",
            "",
            _LOAD_HF if fmt == "hf" else _LOAD,
            "",
        ]
    )


_LOAD = (
    "Load: `model = hydra.utils.instantiate(OmegaConf.load('config.yaml').model)`, then "
    "`safetensors.torch.load_model(model, 'model.safetensors')` (or "
    "`model.load_state_dict(torch.load('model.pt'))`)."
)
_LOAD_HF = (
    "Load (transformers): `AutoModelForCausalLM.from_pretrained(folder)` (a classifier: "
    "`AutoModelForSequenceClassification`) and `AutoTokenizer.from_pretrained(folder)`, or "
    "`pipeline('text-generation', model=folder)`; `python -m ddplab generate folder --prompt TEXT` samples "
    "from it."
)


def within(path: Path, run_dir: Path | None) -> str:
    """``path`` as the run dir's own (``checkpoints/best.pt``), else its name."""
    return str(path.relative_to(run_dir)) if run_dir and path.is_relative_to(run_dir) else path.name


def _portable(command: list[str], cwd: str | None) -> list[str]:
    """The run's command without this machine's paths: ``python`` for the interpreter, a path under the
    run's working dir relative to it, any other absolute path as ``.../<its name>``."""

    def short(path: str) -> str:
        if cwd and path.startswith(cwd.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, cwd)
        return f".../{Path(path).name}" if os.path.isabs(path) else path

    out = []
    for i, arg in enumerate(command):
        key, eq, value = arg.partition("=") if not arg.startswith("/") else ("", "", arg)
        if i == 0 and Path(arg).name.startswith("python"):
            out.append("python")
        else:
            out.append(f"{key}{eq}{short(value)}" if value else arg)
    return out
