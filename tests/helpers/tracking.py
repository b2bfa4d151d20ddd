"""A real MLflow tracking server for the tests: `mlflow server` on 127.0.0.1 (a free port) with a SQLite
backend and a local artifact store, started once per session (tests/conftest.py: the ``mlflow_server`` fixture)
and killed after, whatever happened."""

from __future__ import annotations

import contextlib
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


def serve(folder: Path) -> Iterator[str]:
    """Start the server, yield its URI once /health answers, kill it (SIGKILL: nothing of it is kept)."""
    port = free_port()
    with open(folder / "server.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                                 f"sqlite:///{folder / 'db'}", "--artifacts-destination", str(folder / "artifacts"),
                                 "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                # no job runner: MLflow 3 starts four huey consumers (~250 MB each, polling all
                                # session) for GenAI jobs that tracking never uses
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    try:
        while True:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).read() == b"OK":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        served = ServerURI(uri)
        served.folder, served.pid = folder, proc.pid
        yield served
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test (or a soak fault) may have killed it already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
