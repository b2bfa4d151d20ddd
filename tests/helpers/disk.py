"""A file system made full on purpose: the full-disk tests and the soak's disk_full fault share it (importable
in every rank: tests/ is on their PYTHONPATH)."""

from pathlib import Path


def fill(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full."""
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
