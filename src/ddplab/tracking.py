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

import collections
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
# records held while the server cannot be reached; past it the oldest scalars go (TensorBoard has them)
MAX_BACKLOG = 100_000
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
        retry_s: float = 30.0,
        events: Path | None = None,
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
        self.retry_s = retry_s
        self.events = events or run_dir / "tb"  # TensorBoard's record: what MLflow missed is read back there
        self._backlog: collections.deque = collections.deque()  # the thread's: records not delivered yet
        self._down = False  # the server cannot be reached: the backlog waits, tried again at _next_try
        self._next_try = 0.0
        self._gap = False  # the backlog overflowed: its oldest scalars are TensorBoard's to send (backfill)
        self._hurried = False  # close's wait shortened by hurry (a stop signal)
        self._said: set[str] = set()  # what was said already: each kind of trouble once a run
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

    @property
    def down(self) -> bool:
        """Whether the server could not be reached at the last try (what it misses waits)."""
        return self._down

    def purge_after(self, step: int) -> None:
        """A resume: the steps up to ``step`` that MLflow lacks (a crashed attempt's outage) come from
        TensorBoard's record; the loop sends the rest."""
        self._q.put((self._backfill, (step,)))

    def backfill(self) -> None:
        """Every step of TensorBoard's record that the MLflow run lacks (``python -m ddplab sync``)."""
        self._q.put((self._backfill, (None,)))

    def close(self, status: str = "FINISHED") -> None:
        self._q.put((self._finish, (status,)))
        self._q.put((_STOP, ()))
        self._thread.join(self.timeout)
        self._said.update(("outage", "refused"))  # said after the end, a line would land in the next job's
        left = self._q.qsize() + len(self._backlog) if self._thread.is_alive() else len(self._backlog)
        if left:
            within = (
                f"the {self.timeout:g} s a stop signal left of the launcher's grace"
                if self._hurried
                else f"mlflow.close_timeout_s={self.timeout:g} s"
            )
            self._say(
                "end",
                "mlflow: %s did not take the run's last %d record(s) within %s; TensorBoard's record in the "
                "run dir holds them: python -m ddplab sync %s sends them, each step once",
                self.shown_uri or "MLflow",
                left,
                within,
                self.run_dir,
            )

    def drain(self) -> None:
        self.close("FAILED")  # a resume sets it RUNNING again

    def hurry(self, seconds: float) -> None:
        if seconds < self.timeout:
            self.timeout, self._hurried = seconds, True
            self.log_model = False  # an upload cut short would leave the MLflow run RUNNING for good

    def _say(self, kind: str, msg: str, *args: Any) -> None:
        """A warning about MLflow, once a run for each ``kind`` (an outage, a refused record, the end)."""
        if kind not in self._said:
            self._said.add(kind)
            log.warning(msg, *args)

    # ---------------------------------------------------------------- the thread's side
    def _drain(self) -> None:
        while True:
            wait = max(0.0, self._next_try - time.monotonic()) if self._backlog else None
            try:
                fn, args = self._q.get(timeout=wait)
            except queue.Empty:  # time to try the server again
                fn, args = None, ()
            if fn is _STOP:  # once more if a try is due: a server that failed moments ago is not waited on
                self._deliver()
                return
            if fn is not None:
                self._keep(fn, args)
            self._deliver()

    def _keep(self, fn: Any, args: tuple) -> None:
        self._backlog.append((fn, args))
        if len(self._backlog) > MAX_BACKLOG:  # the oldest scalars go: TensorBoard's record holds them
            oldest = next(i for i, (f, _) in enumerate(self._backlog) if f == self._metrics)
            del self._backlog[oldest]
            self._gap = True

    def _deliver(self) -> None:
        """The backlog, in order, while the server takes it; at the first record it cannot reach, an outage
        (tried again in retry_s)."""
        if self._down and time.monotonic() < self._next_try:
            return
        while self._backlog:
            fn, args = self._backlog[0]
            try:
                if self._down and self._gap:  # back after an overflow: the oldest missed steps first
                    self._backfill(None)
                    self._gap = False
                fn(*args)
            except Exception as e:  # noqa: BLE001 - any failure of the tracking side stays on this side
                if not _refused(e):
                    self._outage(e)
                    return
                if fn == self._open:  # no run to log to: nothing after it can go
                    self._stop_for_good(e)
                    return
                self._say(
                    "refused", "mlflow: %s refused a record (%s); it is skipped", self._where(), _why(e)
                )
            self._backlog.popleft()
            if self._down:
                self._down = False
                log.info("mlflow: %s is back; what it missed is being sent", self._where())

    def _outage(self, e: Exception) -> None:
        self._down, self._next_try = True, time.monotonic() + self.retry_s
        self._say(
            "outage",
            "mlflow: cannot reach %s (%s); training goes on, and what MLflow misses is sent when it is back "
            "(tried every mlflow.retry_s=%g s; TensorBoard's record in the run dir is whole)",
            self._where(),
            _why(e),
            self.retry_s,
        )

    def _stop_for_good(self, e: Exception) -> None:
        self._say(
            "refused",
            "mlflow: %s refused the run (%s); MLflow logging stops for this run, TensorBoard's record in the "
            "run dir is whole",
            self._where(),
            _why(e),
        )
        self._backlog.clear()
        self._keep = lambda fn, args: None  # type: ignore[method-assign]  # what comes after is dropped

    def _where(self) -> str:
        return self.shown_uri or "MLflow's default store"

    def _backfill(self, upto: int | None) -> None:
        """The steps of TensorBoard's record (up to ``upto``) the MLflow run lacks, in order."""
        from ddplab.events import missing_steps

        ms = int(time.time() * 1000)
        for step, values in missing_steps(self.events, self._sent, upto):
            self._metrics(values, step, ms)

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


def _why(e: Exception) -> str:
    said = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {redact.text(said)}"  # a client's error may quote the URI
