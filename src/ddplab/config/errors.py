"""The error every config check raises: it names the key, the value, why, and the fix."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that composes but cannot work; the message names key and fix."""


def require(ok: bool, key: str, value: Any, why: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}. Fix: {fix}")
