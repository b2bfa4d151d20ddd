"""The errors a user's input raises: a config value (:class:`ConfigError`) or a file the job reads
(:class:`InputError`), each said in one line naming the key or file, why, and the fix, with exit code 2.
Dependency-free, so that ddplab.data (and a DataLoader worker unpickling a dataset) imports neither Hydra nor
OmegaConf to raise them; ``ddplab.config`` re-exports them for the config checks."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that composes but cannot work; the message names key and fix."""


class InputError(ValueError):
    """Data the job reads (a token file, an image) that cannot work, met while it runs; the message names the
    file, where in it, and the fix. It exits 2 in one line like a ConfigError, but it may show on one rank
    only, so the rank that meets it says it (the Session), with the epoch and step."""


class ResourceError(OSError):
    """The machine refused what the job needs (a full disk, a file system that will not take a write): the
    message says where, how much is left and the fix, so it is said in one line like an input error, but it
    exits 1: the config and the data are fine, and the same command works once the resource is back."""


class RecordWriteError(ResourceError):
    """The job completed but rank 0 could not write its record (result.json). Rank 0 tells every rank (a peer
    left waiting in the last barrier would die of the lost connection, with a traceback), and says it
    alone."""

    alike_on_every_rank = True


class VerifyFailed(RuntimeError):
    """verify_resume's verdict: the resumed run ended somewhere else than the uninterrupted one (the message
    says where and why). One line and exit 1, not a crash."""


def mark_said(e: BaseException) -> BaseException:
    """``e`` has been said to the user in its one line (by the Session of the rank that met it): the entry
    point exits with its code and says nothing more."""
    e.ddplab_said = True  # type: ignore[attr-defined]
    return e


def was_said(e: BaseException) -> bool:
    return bool(getattr(e, "ddplab_said", False))


def require(ok: bool, key: str, value: Any, why: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}. Fix: {fix}")
