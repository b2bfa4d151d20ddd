"""Rank 0 lets go of the run dir's lock at a job's end without an error where the run dir went read-only
(EROFS, a stale NFS handle), its descriptor closed all the same: its peers, waiting in the last barrier, are
not left to die of the lost connection. The job's record on a full disk:
tests/integration/test_completion_record.py."""

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
