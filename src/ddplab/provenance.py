"""Provenance: what exactly ran — code version (git commit, and the diff when the tree was dirty),
package versions, hosts and devices per rank, launcher, ranks per host, command line — written by
rank 0 to ``<run dir>/provenance.json`` (and ``provenance.diff``) and shown in TensorBoard's Text tab.

Gathered once at start-up from the rank table's one collective; git is asked with a short timeout
(a missing git or a tree that is no repository is recorded as such, never an error).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddplab import redact
from ddplab.runtime import env

PACKAGES = (
    "ddplab",
    "torch",
    "hydra-core",
    "omegaconf",
    "tensorboard",
    "numpy",
    "scikit-learn",
    "hydra-submitit-launcher",
    "submitit",
)


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_version(where: Path) -> dict[str, Any]:
    """The git commit of the code at ``where`` and whether (and how) the tree differs from it."""
    commit = _git(["rev-parse", "HEAD"], where)
    if commit is None:
        return {"repo": None, "note": f"{where} is not in a git repository (or git is missing)"}
    status = _git(["status", "--porcelain", "--untracked-files=no"], where) or ""
    return {
        "repo": (_git(["rev-parse", "--show-toplevel"], where) or "").strip(),
        "commit": commit.strip(),
        "dirty": bool(status.strip()),
        "changed": status.split("\n")[:50] if status.strip() else [],
        "diff": _git(["diff", "HEAD"], where) if status.strip() else None,
    }


def _code() -> dict[str, Any]:
    """The version of the code that ran: the script's repository (train.py, a user's own script), else, where
    the script lies in none (``python -m pytest`` from a venv outside the checkout, ``python -m ddplab``),
    ddplab's own checkout's."""
    script = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else Path.cwd()
    found = code_version(script)
    if found.get("repo") is None:
        here = code_version(Path(__file__).resolve().parent)
        if here.get("repo") is not None:
            return here
    return found


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    # The module that ran, with its build label (2.11.0+cu130): a wheel's metadata may say only 2.11.0.
    out["torch"] = torch.__version__
    out["cuda"] = str(torch.version.cuda)
    if torch.cuda.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
        out["gpu"] = torch.cuda.get_device_name()
        try:
            import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py, where installed

            pynvml.nvmlInit()
            out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            pass
    return out


def collect(
    ranks: list[dict[str, Any]], backend: str | None, secret_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What ran, where and how; the command line with its secrets masked (ddplab.redact)."""
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": [redact.text(a, secret_keys) for a in (sys.executable, *sys.argv)],
        "cwd": str(Path.cwd()),
        "code": _code(),
        "packages": _versions(),
        "launcher": env.launcher(),
        "world": {
            "size": len(ranks),
            "backend": backend,
            "hosts": sorted({r["host"] for r in ranks}),
            "ranks": ranks,
        },
    }


def write(run_dir: Path, prov: dict[str, Any]) -> str:
    """``provenance.json`` (+ ``provenance.diff`` for a dirty tree); returns the text for TensorBoard."""
    diff = prov["code"].pop("diff", None)
    if diff:
        (run_dir / "provenance.diff").write_text(diff)
        prov["code"]["diff_file"] = "provenance.diff"
    text = json.dumps(prov, indent=2, default=str)
    # whole or not at all: a reader that sees the file (a test waiting for the ranks, a watcher) reads it all
    tmp = run_dir / f".provenance.json.tmp{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, run_dir / "provenance.json")
    return text
