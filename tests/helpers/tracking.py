"""A real MLflow tracking server for the tests: `mlflow server` on 127.0.0.1 (a free port) with a SQLite
backend and a local artifact store, one for the whole session (tests/conftest.py: the ``mlflow_server``
fixture): the first pytest worker that needs it starts it, the others find it (a server's start is ~13 CPU-s
and, on 2 loaded cores, ~45 s its caller waits); the process that started the workers kills it at the end.
``serve``: a server of one's own (scripts/soak.py)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from helpers.jobs import free_port


class ServerURI(str):
    """The server's URI; ``.folder`` holds everything it stored (its SQLite file and its artifacts)."""

    folder: Path
    pid: int  # the server's process (its process group's leader)


def shared(root: Path) -> ServerURI:
    """The session's server, started here if no worker has yet (``root``: the session's temp root, which
    every xdist worker's temp dir is under)."""
    with open(root / "mlflow.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter; the others wait for it, then read what it wrote
        record = root / "mlflow.json"
        if not record.exists():
            folder = root / "mlflow"
            folder.mkdir()
            uri, proc = _start(folder)
            record.write_text(json.dumps({"uri": uri, "pid": proc.pid, "folder": str(folder)}))
        got = json.loads(record.read_text())
    served = ServerURI(got["uri"])
    served.folder, served.pid = Path(got["folder"]), got["pid"]
    return served


def serve(folder: Path) -> Iterator[ServerURI]:
    """A server of the caller's own (scripts/soak.py: the soak run's, and a trial's that its fault kills):
    started, yielded once /health answers, killed after (SIGKILL: nothing of it is kept) and reaped."""
    uri, proc = _start(folder)
    try:
        served = ServerURI(uri)
        served.folder, served.pid = folder, proc.pid
        yield served
    finally:
        with contextlib.suppress(ProcessLookupError):  # a soak fault may have killed it already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def stop(root: Path) -> None:
    """Kill the session's server, if one was started (SIGKILL: nothing of it is kept)."""
    record = root / "mlflow.json"
    if record.exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)


def _start(folder: Path) -> tuple[str, subprocess.Popen]:
    """Start the server; its URI and process once /health answers (killed if it does not within 300 s: beside
    the suite's three workers and two soak trials, a soak trial's own server once took over 120 s)."""
    port = free_port()
    with open(folder / "server.log", "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{folder / 'db'}",
                "--artifacts-destination",
                str(folder / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # no job runner: MLflow 3 starts four huey consumers (~250 MB each, polling
            # all session) for GenAI jobs that tracking never uses
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
    uri, deadline = f"http://127.0.0.1:{port}", time.time() + 300
    while True:
        try:
            if urllib.request.urlopen(f"{uri}/health", timeout=2).read() == b"OK":
                return uri, proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)


# A tracked run of 12 steps logged every 2 (train/ and val/ at 6 and 12): MLflow's and W&B's tests alike.
TRACKED_RUN = ["model=mlp", "progress=none", "num_epochs=2", "limit_train_steps=6", "log_every_n_steps=2"]
