"""MLflow beside TensorBoard (``logger=[tensorboard,mlflow]``; the ``mlflow`` extra): rank 0's writer sends
the same rank-reduced scalars, the composed config as params, the HParams entry and provenance as tags, to one
MLflow run per job (per sweep job, per study trial), grouped in an experiment named after the study or the
sweep; at a successful end, the run's exported model as the artifact ``model/`` (``mlflow.log_model``).

Training never waits for MLflow: every call goes through a queue to one background thread. A tracking server
that cannot be reached (down, hanging, failing with a 5xx) is said once, a warning naming the URI and the
cause; what MLflow misses waits in order and goes when the server is back (tried every ``mlflow.retry_s``).
What it still lacks at the end (``mlflow.close_timeout_s`` to drain) is said once: TensorBoard's record in the
run dir holds it, and ``python -m ddplab sync <run dir>`` sends it, each step once, as a resume does. A record
MLflow refuses (a 4xx: a bad value) is said once and skipped; the rest goes on.

A resumed run continues the same MLflow run (its id is kept in ``<run dir>/mlflow.json``), and each metric's
steps appear once: the steps a crashed attempt had already sent (after its last checkpoint, recomputed bitwise
by the resume) are not sent again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ddplab import redact
from ddplab.runtime import env
from ddplab.tracking_thread import BackgroundTracker

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


class MLflowWriter(BackgroundTracker):
    """Rank 0's MLflow run, fed by a background thread (see the module's docstring)."""

    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_dir: Path,
        close_timeout_s: float,
        log_model: bool = False,
        retry_s: float = 30.0,
        events: Path | None = None,
    ):
        super().__init__(run_dir, close_timeout_s, retry_s, events)
        self.uri, self.experiment = tracking_uri, experiment
        self.shown_uri = redact.text(tracking_uri) if tracking_uri else None  # what is written and said of it
        self.log_model = log_model  # at a FINISHED close: the run's exported model as the artifact model/
        self.run_id: str | None = None
        self._mlflow: Any = None  # the MlflowClient, the thread's alone
        # Checkpoints before the first step: a resume, decided here, before this run can write one of its own.
        self._resuming = any((run_dir / "checkpoints").glob("*.pt"))
        self.start()

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

    # ---------------------------------------------------------------- the thread's side
    def _end_fix(self) -> str:
        return (
            "TensorBoard's record in the run dir holds them: "
            f"python -m ddplab sync {self.run_dir} sends them, each step once"
        )

    def _refused(self, e: Exception) -> bool:
        return _refused(e)

    def _where(self) -> str:
        return self.shown_uri or "MLflow's default store"

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
            tags = {RUN_DIR_TAG: str(self.run_dir)}
            exp_id = self._experiment_id()
            self.run_id = client.create_run(exp_id, run_name=self.run_dir.name, tags=tags).info.run_id
        if self._recorded_run() != self.run_id:
            self._record()

    def _experiment_id(self) -> str:
        """The experiment's id, made where there is none as a model-training one (MLflow 3's UI opens on its
        runs, not GenAI traces); another job making it at once (a sweep's, a study's) is no failure."""
        client = self._client()
        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return client.create_experiment(self.experiment, tags=KIND)
        except Exception as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e):
                raise
            return client.get_experiment_by_name(self.experiment).experiment_id

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
        self._sent.update({m.key: step for m in fresh})  # each step once, whatever sends it again

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
            from ddplab.tracking_model import log_model

            said = log_model(self._client(), self.run_id, self.run_dir)
            if said:
                self._tags({"ddplab.model": said[:5000]})
        self._client().set_terminated(self.run_id, status)


KIND = {"mlflow.experimentKind": "custom_model_development"}  # MLflow's tag for an experiment's kind


def _refused(e: Exception) -> bool:
    """MLflow answered and refused this record (a 4xx but 429: a bad value, a closed run): retrying cannot
    help. Anything else (no answer, a timeout, a 5xx, too many requests) is an outage."""
    code = getattr(e, "get_http_status_code", lambda: None)()
    return isinstance(code, int) and 400 <= code < 500 and code != 429
