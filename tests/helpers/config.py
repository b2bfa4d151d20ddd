"""Shared by tests/unit/test_config.py and tests/integration/test_config.py."""

from __future__ import annotations

from helpers.jobs import CONF


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))
