"""A file system made full on purpose: the full-disk tests and the soak's disk_full fault share it (importable
in every rank: tests/ is on their PYTHONPATH)."""

import contextlib
from pathlib import Path


def fill(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full. Unbuffered: a buffer left unwritten would raise
    again as the file closed. Already full (another rank's write got there first: the soak's seed 4908357, an
    FSDP rank's shards), not even the file can be made: that is the fault too. Never raises."""
    try:
        f = open(path, "ab", buffering=0)
    except OSError:
        return
    with contextlib.closing(f), contextlib.suppress(OSError):
        while f.write(b"\0" * 65536):
            pass
