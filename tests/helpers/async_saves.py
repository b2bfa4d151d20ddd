"""Shared by the async checkpoint tests (tests/integration/test_async_checkpoints*.py): their overrides and
the step files a run wrote."""

from __future__ import annotations

from pathlib import Path

ASYNC = ["checkpoint.async_save=true"]


def _step_files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("*.pt"))
