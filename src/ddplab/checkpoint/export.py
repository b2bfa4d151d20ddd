"""Getting the trained model out: ``python -m ddplab export <run dir or checkpoint> --to
safetensors|state_dict|hf|auto``.

A checkpoint (``last.pt``, ``best.pt``) is ddplab's resume format — model, optimizer, RNG, loop, callbacks —
and only ddplab reads it. An export is the model alone, for serving stacks and other code: its weights (the
EMA's when the run kept one, said so), the model's config (the checkpoint's own, so
``hydra.utils.instantiate`` of it builds the module the weights load into) and a model card (metrics, data,
provenance, the command). FSDP checkpoints are read back whole from their shards, in this one process."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict

from ddplab.checkpoint import card as model_card
from ddplab.checkpoint.files import BEST, LAST
from ddplab.errors import InputError

# hf: a folder transformers loads as is (checkpoint/hf_export.py); auto: hf where the model has a transformers
# counterpart, else safetensors where installed, else state_dict
FORMATS = ("safetensors", "state_dict", "hf", "peft", "auto")
FILES = {"safetensors": "model.safetensors", "state_dict": "model.pt"}


def checkpoint_of(source: Path, which: str) -> Path:
    """The checkpoint ``source`` names: the file itself, or a run dir's ``checkpoints/<which>.pt``
    (``auto``: best.pt where the run kept one, else last.pt)."""
    if source.is_file():
        return source
    ckpts = source / "checkpoints"
    names = {"auto": [BEST, LAST], "best": [BEST], "last": [LAST]}[which]
    for name in names:
        if (ckpts / name).is_file():
            return ckpts / name
    raise InputError(
        f"export {source}: no {' or '.join(names)} in {ckpts}. Fix: a run dir that saved checkpoints "
        "(checkpoint.enabled=true), or the path of a checkpoint file"
    )


def read(path: Path) -> dict[str, Any]:
    """The checkpoint, an FSDP one's ``sharded`` entry replaced by the whole model its shards hold."""
    from ddplab.checkpoint.files import CheckpointReadError, load

    try:
        ck = load(path)
    except CheckpointReadError as e:
        raise InputError(
            f"export {path}: not a ddplab checkpoint ({str(e.__cause__)[:120]}). Fix: a run's "
            "checkpoints/last.pt or best.pt"
        ) from None
    if not isinstance(ck, dict) or "meta" not in ck or "model" not in ck and "sharded" not in ck:
        raise InputError(
            f"export {path}: not a ddplab checkpoint (no meta/model entries). Fix: a run's "
            "checkpoints/last.pt or best.pt"
        )
    if "sharded" in ck:
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path.parent / ck.pop("sharded")["sidecar"]), Path(tmp) / "whole.pt")
            ck["model"] = torch.load(Path(tmp) / "whole.pt", map_location="cpu", weights_only=True)["model"]
    return ck


def ema_entry(ck: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(name, state) of the checkpoint's EMA callback, if the run kept one."""
    for key, value in ck.items():
        if key.startswith("callbacks.") and isinstance(value, dict) and {"shadow", "decay"} <= value.keys():
            return key, value
    return None


def build(ck: dict[str, Any], weights: str, trusted: bool = False) -> tuple[torch.nn.Module, str, Any]:
    """The run's model (from the checkpoint's own config) with the checkpoint's weights: the EMA's where
    ``weights`` is ema, or auto and the run kept one. Also what was loaded, said in words, and the config
    whose ``model`` node ``hydra.utils.instantiate`` builds it from (ddplab's ``model.weights`` left out)."""
    from ddplab import build as builder
    from ddplab.config import trust
    from ddplab.models.weights import state_dict_mismatch

    cfg = OmegaConf.create(ck["meta"]["config"])  # parsing YAML builds nothing
    refused = (
        None if trusted else trust.refusal("export", {"model": cfg.get("model")}, switch="--trust-config")
    )
    if refused:  # checked before anything it names is imported
        raise InputError(refused)
    with open_dict(cfg.model):
        # ddplab's key (a file it loads), not the model's: the weights go in below
        cfg.model.pop("weights", None)
    # counted from the data: read off the head
    if "num_classes" in cfg.model and cfg.model.num_classes is None:
        cfg.model.num_classes = int(
            next(t.shape[0] for k, t in reversed(ck["model"].items()) if t.dim() >= 1)
        )
    model = builder.model(cfg)
    if not isinstance(model, torch.nn.Module):
        raise InputError(
            f"export: the checkpoint's model._target_={cfg.model._target_!r} built a "
            f"{type(model).__name__}, not a torch.nn.Module. Fix: export a checkpoint ddplab wrote"
        )
    bad = state_dict_mismatch(model.state_dict(), ck["model"])
    if bad:
        raise InputError(
            f"export: the checkpoint's weights do not fit the model its config builds ({bad}). Fix: "
            "export with the ddplab version the run was trained with"
        )
    model.load_state_dict(ck["model"])
    return model, _ema_or_trained(model, ck, weights), cfg


def _ema_or_trained(model: torch.nn.Module, ck: dict[str, Any], weights: str) -> str:
    """The EMA's weights copied into ``model`` where ``weights`` says so and the run kept one; which, in
    words."""
    ema = ema_entry(ck)
    if weights == "ema" and ema is None:
        raise InputError("export --weights ema: the run kept no EMA (callbacks=[ema]). Fix: --weights raw")
    if ema is None or weights == "raw":
        return "the trained weights" + (f" (the run's EMA, {ema[0]}, not used: --weights raw)" if ema else "")
    floats = [p for p in model.parameters() if p.is_floating_point()]  # the EMA's order (callbacks/ema.py)
    shadow = ema[1]["shadow"]
    if len(shadow) != len(floats):
        raise InputError(
            f"export: {ema[0]} holds {len(shadow)} tensors, the model {len(floats)} parameters. "
            "Fix: --weights raw"
        )
    with torch.no_grad():
        for p, s in zip(floats, shadow):
            p.copy_(s)
    return (
        f"the EMA of the weights ({ema[0]}: decay {ema[1]['decay']}, {int(ema[1]['updates'])} updates; "
        "--weights raw for the trained weights)"
    )


def write_weights(model: torch.nn.Module, out: Path, fmt: str, meta: dict[str, str]) -> Path:
    path = out / FILES[fmt]
    if fmt == "state_dict":
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
        return path
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise InputError(
            "export --to safetensors needs safetensors, which is not installed. "
            "Fix: pip install 'ddplab[hf]', or --to state_dict"
        ) from None
    save_model(model, str(path), metadata=meta)  # tied weights once (safetensors refuses shared memory)
    return path


def write_hf(
    model: torch.nn.Module, cfg: Any, run_dir: Path | None, out: Path, fmt: str = "hf"
) -> tuple[list[str], str]:
    """A folder ``from_pretrained`` and ``pipeline`` load as is: the transformers model, the run's tokenizer
    (where the run names one), special-token ids of its vocabulary. The files, and what was written, in
    words."""
    from ddplab.checkpoint import hf_export
    from ddplab.data import tokenizer as tz

    tok, where = tz.of_run(cfg, run_dir) or (None, "")
    if fmt == "peft":
        files = hf_export.save_adapters(model, tok, out, hf_export.context_of(model.hf))
        with_tok = f"with {where}" if tok else "without a tokenizer (the run's ids came as ids)"
        return files, f"; PeftModel.from_pretrained(base, folder) loads the adapters, {with_tok}"
    hf = hf_export.transformers_model(model)
    files = hf_export.save(hf, tok, out, hf_export.context_of(hf))
    with_tok = f"with {where}" if tok else "without a tokenizer (the run's ids came as ids)"
    return files, f"; from_pretrained loads the folder, {with_tok}"


def resolved(fmt: str, model: torch.nn.Module) -> str:
    """``auto``: hf where the model has a transformers counterpart, else safetensors where installed."""
    if fmt != "auto":
        return fmt
    import importlib.util

    from ddplab.checkpoint.hf_export import maps

    if importlib.util.find_spec("transformers") and maps(model):
        return "hf"
    return "safetensors" if importlib.util.find_spec("safetensors") else "state_dict"


def export(
    source: Path,
    fmt: str,
    out: Path | None = None,
    weights: str = "auto",
    which: str = "auto",
    trusted: bool = False,
) -> tuple[Path, str]:
    """Write ``source``'s model (a run dir or a checkpoint) to ``out`` (default: <run dir>/export); the folder
    and which weights it holds, in words. ``trusted``: build whatever the checkpoint's config names (the
    run's own job exporting itself, or ``--trust-config``); else only what ddplab ships (config/trust.py)."""
    if fmt not in FORMATS:
        raise InputError(
            f"export --to {fmt}: not a format ddplab writes. Fix: --to one of {', '.join(FORMATS)}"
        )
    path = checkpoint_of(source, which)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    out = out or (run_dir or path.parent) / "export"
    _check_owned(out)
    ck = read(path)
    model, said, cfg = build(ck, weights, trusted)
    fmt = resolved(fmt, model)
    meta = {
        "ddplab_checkpoint": model_card.within(path, run_dir),
        "ddplab_step": str(ck.get("loop", {}).get("step")),
        "weights": said[:200],
    }
    # the whole export, then one rename into place
    fresh = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    try:
        if fmt in ("hf", "peft"):
            files, note = write_hf(model, cfg, run_dir, fresh, fmt)
            said += note
        else:
            files = [write_weights(model, fresh, fmt, meta).name]
        (fresh / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        files.append("config.yaml")
        (fresh / "README.md").write_text(model_card.card(ck, path, run_dir, said, files, fmt))
        _replace(out, fresh)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return out, said


def _check_owned(out: Path) -> None:
    """An export owns its folder: a new or empty one, or an earlier export (replaced whole, so no file of it
    is left beside the new one: a stale model.pt beside model.safetensors, or a from_pretrained folder
    whose old weights shadow the new). Anything else is refused before any work."""
    if out.exists() and not out.is_dir():
        raise InputError(
            f"export --out {out}: is a file, not a folder. Fix: --out a new folder (the export "
            "writes several files)"
        )
    if not out.is_dir() or not any(out.iterdir()):
        return
    card_file = out / "README.md"
    first = card_file.read_text(errors="replace").split("\n", 1)[0] if card_file.is_file() else ""
    if not first.endswith(model_card.TITLE):
        names = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise InputError(
            f"export --out {out}: holds files an export did not write ({names}). Fix: --out a new "
            "or empty folder (an earlier export's folder is replaced whole)"
        )


def _replace(out: Path, fresh: Path) -> None:
    """``fresh`` becomes ``out``; an earlier export there is removed whole, never mixed with this one."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    fresh.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def add_build_flags(ap: argparse.ArgumentParser) -> None:
    """--weights and --trust-config: how a run's model is built from its checkpoint (export's, generate's)."""
    ap.add_argument(
        "--weights",
        choices=("auto", "ema", "raw"),
        default="auto",
        help="auto: the EMA's where the run kept one; raw: the trained weights",
    )
    ap.add_argument(
        "--trust-config",
        action="store_true",
        help="build any _target_ the checkpoint's config names (it can run any code: only for a run "
        "dir you trust); without it, only what ddplab ships (docs/security.md)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddplab export", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="a run dir (its checkpoints/) or a checkpoint file")
    ap.add_argument(
        "--to",
        default="safetensors",
        help=f"one of {', '.join(FORMATS)} (default safetensors; hf: a folder transformers loads as is, with "
        "the run's tokenizer (a LoRA run's adapters merged); peft: a LoRA run's adapter folder; auto: hf "
        "where the model has a transformers counterpart)",
    )
    ap.add_argument("--out", type=Path, help="the folder to write (default: <run dir>/export)")
    ap.add_argument(
        "--which",
        choices=("auto", "best", "last"),
        default="auto",
        help="a run dir's checkpoint (auto: best.pt where there is one)",
    )
    add_build_flags(ap)
    args = ap.parse_args(argv)
    try:
        out, said = export(args.source, args.to, args.out, args.weights, args.which, args.trust_config)
    except (InputError, FileNotFoundError) as e:  # a one-line cause and its fix; exit 2, like a config error
        print(str(e) if str(e).startswith("export") else f"export: {e}", file=sys.stderr)
        return 2
    print(f"export: {out}: {said}")
    return 0
