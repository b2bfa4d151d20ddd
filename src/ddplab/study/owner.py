"""Who holds a study's trial, recorded in the study's storage: the one thing every worker of a study shares,
whatever ``study.dir`` each was given. A lock in a directory cannot say it: two workers given different dirs
would each find their own lock free and train the same trial.

A worker that claims a trial records itself as its owner (trial user attr ``ddplab:owner``: host, boot id,
pid namespace, pid and the process's start time, and the time of its last beat) and beats every ``BEAT_S``
until the trial is told. Another worker takes a RUNNING trial over only when its owner let go (preempted:
the record says at which step) or is provably gone: on the same machine, its process no longer exists;
elsewhere, it has not beaten for ``LEASE_S``. The trial's run dir is recorded when it is asked
(``ddplab:dir``): a resumer works there, or leaves the trial alone if it cannot reach that dir.

Claiming and asking happen under a lock that belongs to the storage (:func:`claim_lock`), so two workers
never take the same trial and ``study.n_trials`` stays exact.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ddplab.config.errors import ConfigError
from ddplab.study import storage

log = logging.getLogger("ddplab")

OWNER = "ddplab:owner"  # trial user attr: the worker holding it, or how the last one let go
DIR = "ddplab:dir"  # trial user attr: its run dir, fixed when it is asked
LEASE_S = 60.0  # a worker on another machine silent this long has died or lost its node
BEAT_S = 10.0  # how often a holding worker renews its record: a few beats fit in a lease


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _machine() -> str:
    """This kernel and pid namespace: where a pid means one process (containers on one host share the boot
    id but not their pids)."""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return f"{socket.gethostname()} boot {_read('/proc/sys/kernel/random/boot_id')} pidns {ns}"


def _started(pid: int) -> str:
    """The process's start time in clock ticks since boot: a pid reused by a later process differs."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


def me(**extra: Any) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "machine": _machine(),
        "pid": pid,
        "started": _started(pid),
        "beat": time.time(),
        **extra,
    }


def _alive_here(record: dict[str, Any]) -> bool:
    pid = int(record.get("pid", 0))
    if not Path("/proc/self/stat").exists():  # no /proc: signal 0 still says whether the pid exists
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return bool(_started(pid)) and _started(pid) == record.get("started")


@dataclass
class Verdict:
    free: bool  # another worker may take the trial over
    death: bool  # ... and its worker died (no preemption recorded after it took the trial)
    why: str


def verdict(record: dict[str, Any] | None, now: float) -> Verdict:
    """May a RUNNING trial whose owner record is ``record`` be taken over at ``now``, and why."""
    if not record:
        return Verdict(True, True, "its worker died before recording itself")
    if record.get("left") == "preempted":
        return Verdict(True, False, f"preempted at step {record.get('step')} by {record.get('signal')}")
    who = f"pid {record.get('pid')} on {record.get('host')}"
    if record.get("machine") == _machine():
        alive = _alive_here(record)
        return Verdict(not alive, not alive, f"its worker ({who}) {'is alive' if alive else 'died'}")
    silent = now - float(record.get("beat", 0))
    if silent <= LEASE_S:
        return Verdict(False, False, f"its worker ({who}) beat {silent:.0f}s ago")
    return Verdict(True, True, f"its worker ({who}, silent for {silent:.0f}s > lease {LEASE_S:.0f}s) died")


def progress(tdir: Path) -> str:
    """How far a dead worker's trial is known to have got: its newest checkpoint."""
    from ddplab.checkpoint.files import newest_step

    step = newest_step(tdir / "checkpoints")
    return f"after step {step}, its last checkpoint" if step is not None else "before its first checkpoint"


def reachable(tdir: Path, study: str, number: int) -> bool:
    """``tdir`` is this trial's run dir as this worker sees it (not a same-named dir on another disk)."""
    try:
        noted = json.loads((tdir / "trial.json").read_text())
    except (OSError, ValueError):
        return False
    return noted.get("study") == study and noted.get("number") == number


class Hold:
    """This worker's hold on a trial: its owner record in the storage, renewed by a thread until let go."""

    def __init__(self, trial: Any):
        self.trial = trial  # an optuna.Trial (ddplab.compat.optuna_trial)
        self.record = me()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Hold:
        self.trial.set_user_attr(OWNER, self.record)
        self._thread = threading.Thread(target=self._beat, name="ddplab-study-beat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        failing = False
        while not self._done.wait(BEAT_S):
            try:
                self.trial.set_user_attr(OWNER, {**self.record, "beat": time.time()})
                failing = False
            except Exception as e:  # the worker's own next storage call says what is wrong, in one line
                if not failing:  # the database's own error, not Optuna's wrapper ("... exceeding max length")
                    log.warning(
                        "trial %d: could not renew this worker's hold in the storage (%s); retrying",
                        self.trial.number,
                        storage.innermost(e),
                    )
                failing = True

    def release(self) -> None:
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def left(self, step: int, signal_name: str) -> None:
        """Preempted: the next worker resumes at once, and counts no death."""
        self.release()
        # not recorded: it is resumed as a death, from the same checkpoint
        with contextlib.suppress(Exception):
            self.trial.set_user_attr(
                OWNER, {**self.record, "left": "preempted", "step": step, "signal": signal_name}
            )

    def still_mine(self) -> bool:
        from ddplab import compat

        record = compat.frozen_trial(self.trial).user_attrs.get(OWNER) or {}
        return all(record.get(k) == self.record[k] for k in ("machine", "pid", "started"))


@contextlib.contextmanager
def claim_lock(url: str, timeout_s: float, fallback: Path) -> Iterator[None]:
    """Workers of one storage take turns to open the study and to claim or ask: a lock beside a file storage
    (SQLite, the journal), a database's own advisory lock, else one in ``fallback`` (the study dir). A dead
    holder's lock goes with it."""
    path = _lock_file(url)
    if url.startswith(("postgresql", "mysql", "mariadb")):
        with _db_lock(url, timeout_s):
            yield
        return
    lock = path or fallback / ".ask.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # no such dir: opening the storage says so, in one line
        yield
        return
    except OSError as e:  # claiming without the lock would let two workers take one trial: refuse instead
        raise ConfigError(
            f"study.storage={url}: cannot open its claim lock {lock} ({e.strerror}). Fix: make "
            f"{lock.parent} writable for every worker of the study"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _lock_file(url: str) -> Path | None:
    if url.startswith("journal:"):
        return Path(f"{url[len('journal:') :]}.ddplab-claim.lock")
    if url.startswith("sqlite"):
        from sqlalchemy.engine import make_url

        db = make_url(url).database
        return Path(f"{db}.ddplab-claim.lock") if db and db != ":memory:" else None
    return None


@contextlib.contextmanager
def _db_lock(url: str, timeout_s: float) -> Iterator[None]:
    """A session lock of the database server (dropped with the connection, so with a dead holder)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    pg = url.startswith("postgresql")
    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": max(1, int(timeout_s))})
    from sqlalchemy.exc import OperationalError

    try:
        conn = engine.connect()
    except OperationalError:  # unreachable: opening the storage says so, in one line
        engine.dispose()
        yield
        return
    try:
        conn.execute(
            text("SELECT pg_advisory_lock(7172023)" if pg else "SELECT GET_LOCK('ddplab-claim', -1)")
        )
        yield
    finally:
        with contextlib.suppress(Exception):
            conn.execute(
                text("SELECT pg_advisory_unlock(7172023)" if pg else "SELECT RELEASE_LOCK('ddplab-claim')")
            )
        conn.close()
        engine.dispose()


DEATHS = "ddplab:deaths"  # trial user attr: how often its worker died before recording anything


def count_death(study: Any, number: int) -> int:
    """One more death of trial ``number`` (its worker, or a rank of its job, killed before it recorded a
    result), read and written in the storage, where every worker counts them; the count now."""
    from ddplab import compat

    live = compat.optuna_trial(study, number)
    deaths = int(compat.frozen_trial(live).user_attrs.get(DEATHS, 0)) + 1
    live.set_user_attr(DEATHS, deaths)
    return deaths
