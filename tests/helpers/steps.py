"""Shared by tests/unit/test_steps.py and tests/integration/test_steps.py."""

from __future__ import annotations

import pytest

from helpers import tokens


def _corpus(tmp_path_factory, mb: float) -> list[str]:
    return tokens.corpus(tmp_path_factory.mktemp("corpus") / "data", mb)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return _corpus(tmp_path_factory, 0.2)
