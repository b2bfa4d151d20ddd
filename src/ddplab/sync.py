"""``python -m ddplab sync <run dir>``: what the run's MLflow and W&B runs lack, from TensorBoard's record in
the run dir: the steps an outage kept from them (said at the run's end), each step once, then the run's
status. (A W&B run logged offline is sent with W&B's own ``wandb sync``, which its end line names.)

The MLflow run is the one ``<run dir>/mlflow.json`` names; the tracking URI is ``--tracking-uri``, else the
one recorded there (with its password masked: then ``MLFLOW_TRACKING_URI`` or ``--tracking-uri``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ddplab.errors import InputError


def sync(run_dir: Path, uri: str | None, timeout_s: float) -> str:
    """Send what the run's trackers lack; what was done, in words (a line naming the problem where it could
    not be): W&B's run where ``wandb.json`` names one, MLflow's where the run logged to MLflow."""
    said = [sync_wandb(run_dir, timeout_s)] if (run_dir / "wandb.json").is_file() else []
    if said and not (run_dir / "mlflow.json").is_file() and "mlflow" not in _loggers(run_dir):
        return said[0]
    return "\n".join([*said, sync_mlflow(run_dir, uri, timeout_s)])


def sync_wandb(run_dir: Path, timeout_s: float) -> str:
    """The steps of TensorBoard's record past the last one the W&B run holds, sent to it (its mode as the run
    had it: wandb.mode=auto goes online where W&B has a key)."""
    from ddplab.tracking_setup import wandb_environment
    from ddplab.tracking_wandb import WandbWriter

    cfg = stored_config(run_dir)
    wandb_environment()
    writer = WandbWriter(cfg.wandb, run_dir, None, log_model=False)
    writer.backfill()
    writer.close(_status(run_dir))
    return f"sync: W&B run {writer.run_id} ({writer.mode}) holds TensorBoard's record of {run_dir}"


def stored_config(run_dir: Path) -> Any:
    """The config the run's last checkpoint keeps (InputError where there is none)."""
    from omegaconf import OmegaConf

    from ddplab.checkpoint import export

    return OmegaConf.create(export.read(export.checkpoint_of(run_dir, "last"))["meta"]["config"])


def _loggers(run_dir: Path) -> list[str]:
    try:
        return list(stored_config(run_dir).get("logger") or [])
    except InputError:
        return []


def sync_mlflow(run_dir: Path, uri: str | None, timeout_s: float) -> str:
    """Send what the MLflow run lacks."""
    from ddplab.tracking import ID_FILE
    from ddplab.tracking_setup import mlflow_environment

    try:
        ids = json.loads((run_dir / ID_FILE).read_text())
    except (OSError, ValueError):  # the server was down from the start: the run's config says where to go
        ids = _from_config(run_dir)
    uri = uri or ids.get("tracking_uri")
    if uri and "***" in uri:  # recorded masked: the password is the user's to give again
        from ddplab.runtime import env

        uri = env.mlflow_tracking_uri()
        if not uri:
            raise InputError(
                f"sync {run_dir}: the recorded tracking URI has its password masked. Fix: --tracking-uri "
                "<the URI with it>, or MLFLOW_TRACKING_URI"
            )
    mlflow_environment()
    from ddplab.tracking import MLflowWriter

    status = _status(run_dir)
    writer = MLflowWriter(uri, str(ids.get("experiment")), run_dir, timeout_s, retry_s=timeout_s)
    writer.backfill()
    writer.close(status)
    return f"sync: MLflow run {writer.run_id} holds TensorBoard's record of {run_dir}, status {status}"


def _from_config(run_dir: Path) -> dict[str, str | None]:
    """The experiment and tracking URI of a run whose MLflow run was never made (its server down from the
    start), from the config its last checkpoint keeps."""
    from ddplab.tracking_setup import experiment_name

    try:
        cfg = stored_config(run_dir)
    except InputError:
        raise InputError(
            f"sync {run_dir}: neither mlflow.json nor a checkpoint there. Fix: the run dir of a run with "
            "logger=[tensorboard,mlflow]"
        ) from None
    return {
        "experiment": experiment_name(cfg, run_dir, False),
        "tracking_uri": cfg.mlflow.get("tracking_uri"),
    }


def _status(run_dir: Path) -> str:
    """The MLflow status of the run's end (result.json): FINISHED for a completed run, else FAILED (a resume
    sets it RUNNING again)."""
    try:
        said = json.loads((run_dir / "result.json").read_text()).get("status")
    except (OSError, ValueError):
        said = None
    return "FINISHED" if said == "completed" else "FAILED"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddplab sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run dir that logged to MLflow or W&B")
    ap.add_argument("--tracking-uri", help="the server (default: the one the run recorded)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds the server may take (default 120)")
    args = ap.parse_args(argv)
    try:
        said = sync(args.run_dir, args.tracking_uri, args.timeout)
    except InputError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(said)
    return 0
