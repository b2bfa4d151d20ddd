"""MLflow beside TensorBoard (``logger=[tensorboard,mlflow]``; the ``mlflow`` extra): rank 0's writer sends
the same rank-reduced scalars, the composed config as params, the HParams entry and provenance as tags, to one
MLflow run per job (per sweep job, per study trial), grouped in an experiment named after the study or the
sweep; at a successful end, the run's exported model as the artifact ``model/`` (``mlflow.log_model``).

Training never waits for MLflow: every call goes through a queue to one background thread. A tracking server
that is down, slow or failing is said once (a warning naming the URI and the cause); from then on nothing more
is sent, and TensorBoard — written in the loop, as always — keeps the whole record. At the end the thread gets
``mlflow.close_timeout_s`` to drain; what is left is said and dropped.

A resumed run continues the same MLflow run (its id is kept in ``<run dir>/mlflow.json``), and each metric's
steps appear once: the steps a crashed attempt had already sent (after its last checkpoint, recomputed bitwise
by the resume) are not sent again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ddplab import redact
from ddplab.runtime import env
from ddplab.writers import NullWriter

log = logging.getLogger(__name__)
ID_FILE = "mlflow.json"
# each MLflow run's run dir: a resume finds its run by it when mlflow.json is gone
RUN_DIR_TAG = "ddplab.run_dir"
THREAD = "ddplab-mlflow"


def _not_our_retries(record: logging.LogRecord) -> bool:
    """urllib3's "Retrying (...)" warnings for the MLflow thread's calls: ddplab says a failed server once
    itself, after the retries (three lines before its one, otherwise). Other threads' retries stay."""
    return record.threadName != THREAD


logging.getLogger("urllib3.connectionpool").addFilter(_not_our_retries)
_STOP = object()


def flat_params(cfg_yaml: str) -> dict[str, str]:
    """The composed config as MLflow params: dotted keys, values as text (MLflow keeps at most 6000 chars)."""
    from ddplab.config.drift import flatten

    return {k: str(v)[:6000] for k, v in flatten(cfg_yaml).items()}


def _without_userinfo(uri: str | None) -> str | None:
    """An http(s) URI's user and password handed to MLflow as its own credentials (MLFLOW_TRACKING_USERNAME /
    _PASSWORD, unless set), the URI without them: MLflow prints the URI it was given ("View run ... at")."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri) if uri else None
    if parts is None or parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    info, host = parts.netloc.rsplit("@", 1)
    user, _, password = info.partition(":")
    env.offer_mlflow_credentials(unquote(user), unquote(password) if password else None)
    return urlunsplit(parts._replace(netloc=host))


class MLflowWriter(NullWriter):
    """Rank 0's MLflow run, fed by a background thread (see the module's docstring)."""

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_dir: Path,
        close_timeout_s: float,
        log_model: bool = False,
    ):
        self.uri, self.experiment, self.run_dir, self.timeout = (
            tracking_uri,
            experiment,
            run_dir,
            close_timeout_s,
        )
        self.shown_uri = redact.text(tracking_uri) if tracking_uri else None  # what is written and said of it
        self.log_model = log_model  # at a FINISHED close: the run's exported model as the artifact model/
        self.run_id: str | None = None
        self._mlflow: Any = None  # the MlflowClient, the thread's alone
        # metric -> the last step the MLflow run already holds (a resumed run)
        self._sent: dict[str, int] = {}
        # Checkpoints before the first step: a resume, decided here, before this run can write one of its own.
        self._resuming = any((run_dir / "checkpoints").glob("*.pt"))
        self._q: queue.Queue = queue.Queue()
        self._failed: str | None = None
        self._hurried = False  # close's wait shortened by hurry (a stop signal)
        self._said = threading.Lock()  # one warning a run, whichever side says it first
        self._thread = threading.Thread(target=self._drain, name=THREAD, daemon=True)
        self._thread.start()
        self._q.put((self._open, ()))

    # ---------------------------------------------------------------- the loop's side: never blocks
    def scalars(self, values: dict[str, float], step: int) -> None:
        self._q.put((self._metrics, (dict(values), step, int(time.time() * 1000))))

    def text(self, tag: str, value: str, step: int = 0) -> None:
        if tag == "config":
            self._q.put((self._params, (flat_params(value),)))
        elif tag == "provenance":
            self._q.put((self._provenance, (value,)))
        # a text of a step (samples at an evaluation): one file per step, as TensorBoard keeps one per step
        name = f"{tag}/{step:08d}.txt" if step else f"{tag}.txt"
        self._q.put((self._artifact_text, (value, name)))

    def hparams(self, hparams: dict[str, Any], trial: str) -> None:
        self._q.put((self._tags, ({f"hparam.{k}": str(v)[:5000] for k, v in hparams.items()},)))

    def close(self, status: str = "FINISHED") -> None:
        self._q.put((self._finish, (status,)))
        self._q.put((_STOP, ()))
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            within = (
                f"the {self.timeout:g} s a stop signal left of the launcher's grace"
                if self._hurried
                else f"mlflow.close_timeout_s={self.timeout:g} s"
            )
            self._say(
                "mlflow: %s did not take the run's last %d record(s) within %s; they are dropped "
                "(TensorBoard's record in the run dir is whole)",
                self.shown_uri or "MLflow",
                self._q.qsize(),
                within,
            )

    def drain(self) -> None:
        self.close("FAILED")  # a resume sets it RUNNING again

    def hurry(self, seconds: float) -> None:
        if seconds < self.timeout:
            self.timeout, self._hurried = seconds, True
            self.log_model = False  # an upload cut short would leave the MLflow run RUNNING for good

    def _say(self, msg: str, *args: Any) -> None:
        """The run's one warning about MLflow; after it, nothing more is sent or said."""
        if self._said.acquire(blocking=False):
            self._failed = self._failed or "said"
            log.warning(msg, *args)

    # ---------------------------------------------------------------- the thread's side
    def _drain(self) -> None:
        while True:
            fn, args = self._q.get()
            if fn is _STOP:
                return
            if self._failed:
                continue  # said once; the rest is dropped, never retried in the loop's time
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - any failure of the tracking side stays on this side
                said = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                why = f"{type(e).__name__}: {redact.text(said)}"  # a client's error may quote the URI
                self._say(
                    "mlflow: cannot log to %s (%s); MLflow logging stops for this run, TensorBoard's record "
                    "in the run dir is whole. Fix: check mlflow.tracking_uri and the server",
                    self.shown_uri or "MLflow's default store",
                    why,
                )

    def _client(self) -> Any:
        """One client for the run, made on the thread at its first call (the import included)."""
        if self._mlflow is None:
            from mlflow.tracking import MlflowClient

            self._mlflow = MlflowClient(tracking_uri=_without_userinfo(self.uri))
        return self._mlflow

    def _open(self) -> None:
        client = self._client()
        self.run_id = self._recorded_run() or (self._interrupted_run() if self._resuming else None)
        if self.run_id is not None:  # a resume (or a rerun in the same dir): the same MLflow run
            client.update_run(self.run_id, status="RUNNING")
            for key in client.get_run(self.run_id).data.metrics:
                self._sent[key] = max(m.step for m in client.get_metric_history(self.run_id, key))
        else:
            exp = client.get_experiment_by_name(self.experiment)
            # made a model-training experiment: MLflow 3's UI then opens on its runs, not on GenAI traces
            exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment, tags=KIND)
            tags = {RUN_DIR_TAG: str(self.run_dir)}
            self.run_id = client.create_run(exp_id, run_name=self.run_dir.name, tags=tags).info.run_id
        if self._recorded_run() != self.run_id:
            self._record()

    def _recorded_run(self) -> str | None:
        """The MLflow run id in ``mlflow.json``; None where there is none or it cannot be read (a file emptied
        by a full disk before writes were atomic)."""
        try:
            return str(json.loads((self.run_dir / ID_FILE).read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _interrupted_run(self) -> str | None:
        """A resume whose ``mlflow.json`` is missing or unreadable (its write met a full disk): the newest
        unfinished run of the experiment tagged with this run dir, so the resume still continues it."""
        if "'" in str(self.run_dir):  # MLflow's filter strings have no escape for a quote
            return None
        exp = self._client().get_experiment_by_name(self.experiment)
        if exp is None:
            return None
        found = self._client().search_runs(
            [exp.experiment_id],
            f"tags.`{RUN_DIR_TAG}` = '{self.run_dir}' and attributes.status != 'FINISHED'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return found[0].info.run_id if found else None

    def _record(self) -> None:
        """``mlflow.json``, whole or not at all (a temp file renamed over it). A failed write (a full disk)
        loses nothing now: the run id is held here, and a resume finds the run by its run dir tag."""
        id_file = self.run_dir / ID_FILE
        tmp = id_file.with_name(f".{ID_FILE}.tmp{os.getpid()}")
        try:
            tmp.write_text(
                json.dumps(
                    {"run_id": self.run_id, "experiment": self.experiment, "tracking_uri": self.shown_uri}
                )
                + "\n"
            )
            os.replace(tmp, id_file)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.debug("mlflow: could not write %s: %s", id_file, e)

    def _metrics(self, values: dict[str, float], step: int, ms: int) -> None:
        from mlflow.entities import Metric

        fresh = [Metric(k, float(v), ms, step) for k, v in values.items() if step > self._sent.get(k, -1)]
        for i in range(0, len(fresh), 1000):  # MLflow takes at most 1000 metrics a batch
            self._client().log_batch(self.run_id, metrics=fresh[i : i + 1000])

    def _params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        have = self._client().get_run(self.run_id).data.params  # a resumed run logged them already
        items = [Param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self._client().log_batch(self.run_id, params=items[i : i + 100])

    def _tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._client().log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def _provenance(self, text: str) -> None:
        prov = json.loads(text)
        code = prov.get("code") or {}
        self._tags(
            {
                "mlflow.source.git.commit": str(code.get("commit", "")),
                "ddplab.dirty": str(code.get("dirty")),
                "ddplab.command": " ".join(prov.get("command") or [])[:5000],
                "ddplab.torch": str((prov.get("packages") or {}).get("torch", "")),
            }
        )

    def _artifact_text(self, text: str, name: str) -> None:
        self._client().log_text(self.run_id, text, name)

    def _finish(self, status: str) -> None:
        if status == "FINISHED" and self.log_model:
            self._model()
        self._client().set_terminated(self.run_id, status)

    def _model(self) -> None:
        """The artifact ``model/``: what ``python -m ddplab export <run dir>`` writes (the best checkpoint's
        weights, EMA's where the run had EMA), config and model card: a folder transformers loads as is where
        the model has a transformers counterpart, else safetensors where installed."""
        import tempfile

        from ddplab.checkpoint import export
        from ddplab.errors import InputError

        with tempfile.TemporaryDirectory(prefix="ddplab-mlflow-") as tmp:
            try:
                # a transformers folder where the model has one (from_pretrained loads the artifact as is)
                out, said = export.export(self.run_dir, "auto", Path(tmp) / "model", trusted=True)  # its own
            # no checkpoint to export (checkpoints off): a run without a model artifact
            except InputError as e:
                log.info("mlflow: no model artifact: %s", e)
                return
            except Exception as e:  # the run's own record is whole; only the artifact is missing
                log.warning(
                    "mlflow: no model artifact: exporting %s failed (%s: %s). Fix: python -m ddplab export "
                    "%s, then mlflow artifacts log-artifacts",
                    self.run_dir,
                    type(e).__name__,
                    str(e).strip().splitlines()[0][:300] if str(e).strip() else "",
                    self.run_dir,
                )
                return
            self._client().log_artifacts(self.run_id, str(out), "model")
            fmt = next(f for f, name in _ARTIFACT_KINDS if (out / name).is_file())
        self._tags({"ddplab.model": f"model/ ({fmt}): {said}"[:5000]})


KIND = {"mlflow.experimentKind": "custom_model_development"}  # MLflow's tag for an experiment's kind


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
    return TeeWriter(tensorboard, mlflow_writer(cfg, run_dir, rundir.is_multirun(), log_model=not evaluating))


def mlflow_writer(cfg: Any, run_dir: Path, multirun: bool, log_model: bool = True) -> MLflowWriter:
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


# what the model artifact is, by the file that tells it (transformers' config.json first: its weights are
# model.safetensors too)
_ARTIFACT_KINDS = (("hf", "config.json"), ("safetensors", "model.safetensors"), ("state_dict", "model.pt"))
