"""Which writers a job gets (``logger=[tensorboard,mlflow]``): rank 0's TensorBoard writer, and MLflow's
(``ddplab.tracking``) beside it; MLflow's experiment for a job, a sweep, a study; the MLflow switches ddplab
sets before MLflow is imported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddplab.tracking import MLflowWriter


def experiment_name(cfg: Any, run_dir: Path, multirun: bool) -> str:
    """mlflow.experiment, else the study's (``study <name>``), the sweep's (``sweep <its dir>``), or
    ddplab."""
    if cfg.mlflow.get("experiment"):
        return str(cfg.mlflow.experiment)
    if "study" in (cfg.callbacks or {}):
        return f"study {cfg.study.name}"
    if multirun:
        return f"sweep {run_dir.parent.resolve()}"
    return "ddplab"


def writer_for(dist: Any, log_dir: str, cfg: Any, run_dir: Path, evaluating: bool = False) -> Any:
    """The job's writer: rank 0's TensorBoard writer (a do-nothing one elsewhere), and with
    ``logger=[tensorboard,mlflow]`` rank 0's MLflow writer beside it (``evaluating``: mode=eval, no model to
    log)."""
    from ddplab import rundir
    from ddplab.writers import TeeWriter, make_writer

    tensorboard = make_writer(dist, log_dir)
    if not dist.is_main or "mlflow" not in list(cfg.get("logger") or []):
        return tensorboard
    mlflow = mlflow_writer(cfg, run_dir, rundir.is_multirun(), log_model=not evaluating, events=Path(log_dir))
    return TeeWriter(tensorboard, mlflow)


def mlflow_writer(
    cfg: Any, run_dir: Path, multirun: bool, log_model: bool = True, events: Path | None = None
) -> MLflowWriter:
    mlflow_environment()
    try:
        import mlflow  # noqa: F401
    except ImportError:
        from ddplab.errors import ConfigError

        raise ConfigError(
            "logger=[...,mlflow] needs MLflow, which is not installed. Fix: pip install "
            "'ddplab[mlflow]', or logger=[tensorboard]"
        ) from None
    return MLflowWriter(
        cfg.mlflow.get("tracking_uri"),
        experiment_name(cfg, run_dir, multirun),
        run_dir,
        float(cfg.mlflow.close_timeout_s),
        bool(cfg.mlflow.log_model) and log_model,
        retry_s=float(cfg.mlflow.retry_s),
        events=events,
    )


def mlflow_environment() -> None:
    """MLflow's switches that ddplab sets where the user has not, before MLflow is imported (it reads some
    then)."""
    from ddplab.runtime import env

    # Its usage telemetry (on by default outside CI): a thread MLflow starts at import fetches a config from
    # the internet, then changes the process environment while this writer's thread sends (requests reads it
    # for proxies): one KeyError ended MLflow logging for a run (the soak's trial 1864753826). Offline
    # clusters gain nothing from it. MLFLOW_DISABLE_TELEMETRY=false keeps it.
    env.library_default("MLFLOW_DISABLE_TELEMETRY", "true")
    # A server that is down must not hold the thread for minutes (MLflow's defaults: 7 retries, 120 s each,
    # backoff doubling from 2 s).
    env.library_default("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")  # a dropped connection is retried, briefly
    env.library_default("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    env.library_default("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # No jitter: urllib3 and MLflow draw it from Python's global `random`, from this writer's thread at any
    # moment, so the rank's RNG (which its checkpoint holds, and user code draws from) would follow the
    # server's health.
    env.library_default("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
