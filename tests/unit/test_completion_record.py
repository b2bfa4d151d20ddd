"""A job's end on a disk that refuses writes. Its record of completion (result.json): the job fails in one
line, every rank alike, nothing writes another record in its place, and ``resume=auto`` records the completion
once there is room (found by the soak, seed 4908357, twice in CI). What else rank 0 alone writes as a job or a
study ends (the run dir's lock, a study's HParams rows and summary) never stops it with a traceback while its
peers wait."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest


def test_a_run_dir_gone_read_only_lets_go_of_its_lock_without_an_error(tmp_path, monkeypatch):
    """rank 0 releases the run dir's lock after its peers entered the last barrier: an OSError there (a run
    dir remounted read-only, a stale NFS handle) left them to die of the lost connection, with tracebacks."""
    from ddplab import rundir

    lock = rundir.RunDirLock(tmp_path)
    assert lock.acquire() is None
    fd = lock._fd

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    lock.release()  # raised OSError [Errno 30]
    assert lock._fd is None
    with pytest.raises(OSError):  # and the descriptor is closed all the same
        __import__("os").fstat(fd)
