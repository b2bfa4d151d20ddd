"""Weights & Biases beside TensorBoard (``logger=[tensorboard,wandb]``; the ``wandb`` extra): rank 0's writer
sends what MLflow gets: the same rank-reduced scalars at the same steps, the composed config, the HParams
entry and provenance in the W&B run's config, ``wandb.tags`` as its tags, and at a successful end the run's
exported model as the artifact ``model-<run id>``. Runs of a study or a sweep share a W&B group.

Offline where W&B has no key (``wandb.mode=auto``), or could not start online within
``wandb.init_timeout_s``: the run's files are in ``<run dir>/wandb``, and the end line says how to send them
(``wandb sync``). W&B's thread discipline is MLflow's (ddplab.tracking_thread): training never waits for it.

A resumed run continues the same W&B run (its id is kept in ``<run dir>/wandb.json``), and each step is sent
once: the steps a crashed attempt had already sent (after its last checkpoint, recomputed bitwise by the
resume) are read from the W&B files in the run dir and not sent again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddplab import redact
from ddplab.runtime import env
from ddplab.tracking_thread import BackgroundTracker

ID_FILE = "wandb.json"
log = logging.getLogger("ddplab.tracking")  # the trackers' logger


class WandbWriter(BackgroundTracker):
    """Rank 0's W&B run, fed by a background thread (see the module's docstring)."""

    name = "wandb"

    def __init__(
        self, conf: Any, run_dir: Path, group: str | None, log_model: bool, events: Path | None = None
    ):
        super().__init__(run_dir, float(conf.close_timeout_s), float(conf.retry_s), events)
        self.project, self.entity = str(conf.project), conf.entity
        self.group, self.tags = group, [str(t) for t in conf.tags]
        self.init_timeout = float(conf.init_timeout_s)
        mode = str(conf.mode)
        self.mode = ("online" if env.wandb_online_possible() else "offline") if mode == "auto" else mode
        self.log_model = log_model
        self._child: _Child | None = None  # the W&B client's process, the thread's alone
        self.run_id: str | None = None
        self._last = -1  # the last step the W&B run holds: W&B takes steps in increasing order only
        self._row: set[str] = set()  # the keys it holds at that step (a step's val/* come after its train/*)
        self.start()

    # ---------------------------------------------------------------- the loop's side: never blocks
    def scalars(self, values: dict[str, float], step: int) -> None:
        self._q.put((self._metrics, (dict(values), step, 0)))

    def text(self, tag: str, value: str, step: int = 0) -> None:
        if tag in ("config", "provenance"):  # parsed on the thread: the loop only queues
            self._q.put((self._config_text, (tag, value)))
        elif step:  # a text of a step (samples at an evaluation): shown at that step, as TensorBoard does
            self._q.put((self._text, (tag, value, step)))

    def hparams(self, hparams: dict[str, Any], trial: str) -> None:
        values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        self._q.put((self._config, ({"hparams": values, "trial": trial},)))

    # ---------------------------------------------------------------- the thread's side
    def _where(self) -> str:
        return f"W&B ({self.mode})"

    def _end_fix(self) -> str:
        return (
            "TensorBoard's record in the run dir holds them: "
            f"python -m ddplab sync {self.run_dir} sends them, each step once"
        )

    def _open(self) -> None:
        self.run_id = self._recorded_run() or secrets.token_hex(4)  # not `random`: the rank's RNG is kept
        self._record()  # before the run starts: a crash in its first steps still resumes the same W&B run
        self._last, self._row = _last_row(self.run_dir, self.run_id)
        if self._child is not None:  # an earlier start failed (an outage): its process goes
            self._child.close()
        self._child = _Child()
        init = {
            "project": self.project,
            "entity": self.entity,
            "id": self.run_id,
            "resume": "allow",
            "dir": str(self.run_dir),
            "group": self.group,
            "tags": self.tags or None,
            "name": self.run_dir.name,
        }
        self.mode, why_offline = self._child.call("start", init, self._settings(), self.mode == "online")
        if why_offline:  # W&B's server did not answer: the run is logged to its files instead
            self._say(
                "outage",
                "wandb: could not start online (%s); this run is logged offline",
                redact.text(why_offline),
            )

    def _settings(self) -> dict[str, Any]:
        return {
            "silent": True,
            "console": "off",  # ddplab's console is its own: W&B must not wrap stdout/stderr
            "x_disable_stats": True,  # no system-metrics sampler beside the loop
            "x_disable_meta": True,
            "save_code": False,
            "disable_git": True,
            "disable_job_creation": True,
            "x_save_requirements": False,
            "init_timeout": self.init_timeout,
        }

    def _recorded_run(self) -> str | None:
        try:
            return str(json.loads((self.run_dir / ID_FILE).read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _record(self) -> None:
        """``wandb.json``, whole or not at all (a temp file renamed over it)."""
        id_file = self.run_dir / ID_FILE
        tmp = id_file.with_name(f".{ID_FILE}.tmp{os.getpid()}")
        try:
            tmp.write_text(
                json.dumps({"run_id": self.run_id, "project": self.project, "entity": self.entity}) + "\n"
            )
            os.replace(tmp, id_file)
        except OSError:
            tmp.unlink(missing_ok=True)  # the id is held here; a resume then starts another W&B run

    def _metrics(self, values: dict[str, float], step: int, ms: int) -> None:
        fresh = {k: float(v) for k, v in values.items() if step > self._last or k not in self._row}
        if step < self._last or not fresh:  # the W&B run holds these already (a resume's recomputed steps)
            return
        self._child.call("log", fresh, step)
        self._row = self._row | set(fresh) if step == self._last else set(fresh)
        self._last = step

    def _backfill(self, upto: int | None) -> None:
        """The steps of TensorBoard's record (up to ``upto``) past the last one the W&B run holds."""
        from ddplab.events import missing_steps

        for step, values in missing_steps(self.events, {}, upto):
            self._metrics(values, step, 0)

    def _config(self, values: dict[str, Any]) -> None:
        self._child.call("config", values)

    def _config_text(self, tag: str, value: str) -> None:
        self._config({tag: _parsed(tag, value)})

    def _text(self, tag: str, value: str, step: int) -> None:
        if step >= self._last and tag not in self._row:  # W&B refuses an earlier step
            self._child.call("html", tag, value, step)
            self._row = self._row | {tag} if step == self._last else {tag}
            self._last = step

    def _abandon(self) -> None:
        """W&B's client hangs (its thread is still in a call): its process is killed, not left behind (it
        ignores the job's SIGTERM, and its input stays open while this process lives)."""
        child = self._child
        if child is not None:
            child.proc.kill()

    def _finish(self, status: str) -> None:
        if status == "FINISHED" and self.log_model:
            from ddplab.tracking_model import exported

            with exported(self.run_dir, "wandb") as made:
                if made is not None:
                    self._child.call("artifact", f"model-{self.run_id}", str(made[0]), made[1][:1000])
        folder = self._child.call("finish", 0 if status == "FINISHED" else 1)
        self._child.close()
        self._child = None
        if self.mode == "offline":
            log.info("wandb: this run was logged offline; to send it to W&B: wandb sync %s", folder)


class _Child:
    """The W&B client's process (ddplab.tracking_wandb_proc): a call is a pickled frame to its stdin, its
    reply one from its stdout; a failure there is raised here, as the thread's call failing."""

    def __init__(self) -> None:
        where = str(Path(__file__).resolve().parents[1])  # ddplab as this process found it
        code = (
            f"import sys; sys.path.insert(0, {where!r}); from ddplab.tracking_wandb_proc import main; main()"
        )
        # Its own session: a stop signal to the job's process group (torchrun's agent signals each rank's
        # group) must not end it before it has ended the run; it ends when its input does.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def call(self, name: str, *args: Any) -> Any:
        pickle.dump((name, args), self.proc.stdin)
        self.proc.stdin.flush()
        reply = pickle.load(self.proc.stdout)  # EOFError: the process died (an outage: started again)
        if reply[0] == "error":
            raise WandbError(f"{reply[1]}: {reply[2]}")
        return reply[1]

    def close(self) -> None:
        """Its stdin closed: it ends the run if one is open (as failed) and exits (waited for briefly: no
        zombie is left; one that does not end goes on alone)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class WandbError(Exception):
    """A call failed in the W&B client's process (its type and message)."""


def _parsed(tag: str, value: str) -> Any:
    """The config (YAML) or provenance (JSON) text as values W&B's config table shows key by key."""
    import yaml

    try:
        return json.loads(value) if tag == "provenance" else yaml.safe_load(value)
    except Exception:  # noqa: BLE001 - a text that does not parse is shown as it is
        return value


def _last_row(run_dir: Path, run_id: str) -> tuple[int, set[str]]:
    from ddplab.wandb_files import last_row

    return last_row(run_dir, run_id)
