"""Shared by tests/unit/test_steps.py and tests/integration/test_steps.py."""

from __future__ import annotations

import sys

import pytest

from helpers.jobs import REPO, assert_ok, run_cmd


def _corpus(tmp_path_factory, mb: float) -> list[str]:
    out = tmp_path_factory.mktemp("corpus")
    assert_ok(
        run_cmd(
            [
                sys.executable,
                str(REPO / "scripts" / "make_tokens.py"),
                "--generated-mb",
                str(mb),
                "--out",
                str(out),
            ],
            out,
        )
    )
    return [f"dataset.path={out / 'train.bin'}", f"dataset.val_path={out / 'val.bin'}"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return _corpus(tmp_path_factory, 0.2)
