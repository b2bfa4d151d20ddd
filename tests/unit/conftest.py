"""The unit tier's one rule, kept by every test here: it starts no process (no subprocess, no fork, no
multiprocessing child — a DataLoader worker is one). A test that needs one belongs in tests/integration/."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest


def _refused(*_: object, **__: object) -> None:
    raise AssertionError(
        "a unit test starts no process (tests/unit/conftest.py). Fix: move the test to tests/integration/"
    )


@pytest.fixture(autouse=True)
def _starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refused)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused)
    monkeypatch.setattr(os, "fork", _refused)
