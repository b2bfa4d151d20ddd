"""The optional extras (hf, mlflow) in tests, found without being imported: collecting a test module costs no
import of a heavy package (seconds: MLflow alone brings pandas, FastAPI, SQLAlchemy), and a package that is
installed but fails to import fails the tests that use it instead of skipping them."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest


def needs(module: str, extra: str) -> None:
    """Skip the calling test module where ``module`` is not installed, naming the extra that brings it."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"the {extra} extra: pip install 'ddplab[{extra}]'", allow_module_level=True)


class Lazy:
    """``module``, imported on its first use (``datasets.Dataset``)."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("_", "pytest")):  # pytest's own looks at a module's names while collecting it
            raise AttributeError(name)
        return getattr(importlib.import_module(self._module), name)


def lazy(module: str, extra: str) -> Lazy:
    needs(module, extra)
    return Lazy(module)
