"""Which writers a job gets (``logger=[tensorboard,mlflow,wandb]``): rank 0's TensorBoard writer, and
MLflow's (``ddplab.tracking``) and W&B's (``ddplab.tracking_wandb``) beside it; MLflow's experiment and W&B's
group for a job, a sweep, a study; the switches ddplab sets before MLflow or wandb is imported."""

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
    ``logger=[tensorboard,mlflow,wandb]`` rank 0's MLflow and W&B writers beside it (``evaluating``:
    mode=eval, no model to log)."""
    from ddplab import rundir
    from ddplab.writers import TeeWriter, make_writer

    tensorboard = make_writer(dist, log_dir)
    loggers = list(cfg.get("logger") or [])
    if not dist.is_main or loggers == ["tensorboard"]:
        return tensorboard
    multirun, events = rundir.is_multirun(), Path(log_dir)
    trackers = []
    if "mlflow" in loggers:
        trackers.append(mlflow_writer(cfg, run_dir, multirun, log_model=not evaluating, events=events))
    if "wandb" in loggers:
        trackers.append(wandb_writer(cfg, run_dir, multirun, log_model=not evaluating, events=events))
    return TeeWriter(tensorboard, *trackers)


def group_name(cfg: Any, run_dir: Path, multirun: bool) -> str | None:
    """wandb.group, else the study's (``study <name>``) or the sweep's (``sweep <date>/<time>``: its dir's
    last two parts); none for a single run."""
    if cfg.wandb.get("group"):
        return str(cfg.wandb.group)
    if "study" in (cfg.callbacks or {}):
        return f"study {cfg.study.name}"
    sweep = run_dir.parent.resolve()  # multirun/<date>/<time>: W&B's group names stay short (128 at most)
    return f"sweep {'/'.join(sweep.parts[-2:])}" if multirun else None


def wandb_writer(
    cfg: Any, run_dir: Path, multirun: bool, log_model: bool = True, events: Path | None = None
) -> Any:
    from ddplab.tracking_wandb import WandbWriter

    wandb_environment()
    return WandbWriter(
        cfg.wandb,
        run_dir,
        group_name(cfg, run_dir, multirun),
        bool(cfg.wandb.log_model) and log_model,
        events=events,
    )


def wandb_environment() -> None:
    """W&B's switches that ddplab sets where the user has not, before wandb is imported."""
    from ddplab.runtime import env

    env.library_default("WANDB_SILENT", "true")  # its banner and "View run at" lines: ddplab says its own
    # its anonymous usage reports (sentry) to the internet: nothing an offline cluster can send
    env.library_default("WANDB_ERROR_REPORTING", "false")


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
