"""Where a study lives: an Optuna storage opened from a URL, and the study in it, checked against this
worker's.

    sqlite:///multirun/study-x/study.db     one machine (the default: <study.dir>/study.db)
    journal:/shared/fs/study-x.log          Optuna's journal file: workers on hosts sharing a file system
    postgresql://user:pw@host/db            a cluster (pip install 'psycopg[binary]'); mysql+pymysql://... too

A storage that does not answer fails within ``study.timeout_s`` with one line naming the URL, never hangs.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import TracebackType
from typing import Any

from ddplab.config.errors import ConfigError
from ddplab.errors import ResourceError

log = logging.getLogger("ddplab")

SPACE_ATTR = "ddplab:space"  # the study's search space (space.signature), set by the worker that created it
DIRECTION_ATTR = "ddplab:objective"
# the config that trains its trials, outside the space (config.drift's keys)
TRAINING_ATTR = "ddplab:training"
# a worker whose storage failed under it: not a config error (2), not a preemption (128 + signal)
STORAGE_EXIT = 3


def default_url(study_dir: Path) -> str:
    """``<study_dir>/study.db`` as an SQLAlchemy URL, escaped: a ``?`` or ``#`` in a path would start the
    URL's query or fragment, and the database would silently go elsewhere."""
    from sqlalchemy.engine import URL

    return URL.create("sqlite", database=str(study_dir.absolute() / "study.db")).render_as_string(
        hide_password=False
    )


def open_storage(url: str, timeout_s: float) -> Any:
    """Optuna's storage for ``url`` (RDB or journal file); a ConfigError if it cannot be opened."""
    import optuna

    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            path = Path(url[len("journal:") :])
            if not path.parent.is_dir():
                raise FileNotFoundError(f"no directory {path.parent}")
            return JournalStorage(JournalFileBackend(str(path)))
        return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url, timeout_s))
    # the database's driver (Optuna re-raises it as "Failed to import DB access module")
    except ImportError as e:
        driver = (
            "'psycopg[binary]'"
            if "postgres" in url
            else "pymysql"
            if "mysql" in url
            else "the database's driver"
        )
        raise ConfigError(
            f"study.storage={url}: its driver is not installed ({' '.join(str(e).split())[:200]}). "
            f"Fix: pip install {driver}"
        ) from None
    except Exception as e:  # sqlalchemy's OperationalError, ArgumentError, a missing dir ...
        why = " ".join(str(getattr(e, "orig", None) or e).split())[:300]
        raise ConfigError(
            f"study.storage={url}: cannot open it ({type(e).__name__}: {why}). Fix: a reachable "
            "database URL (sqlite:///path/study.db, postgresql://user@host/db) or journal:<file on a "
            "shared file system>"
        ) from None


def _engine_kwargs(url: str, timeout_s: float) -> dict[str, Any]:
    """A bounded wait: the database's own connect timeout; SQLite's wait for another worker's write lock."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": max(timeout_s, 60.0)}}  # workers queue on SQLite's one writer
    if url.startswith("postgres"):
        return {"connect_args": {"connect_timeout": max(1, int(timeout_s))}}
    if url.startswith("mysql"):
        return {"connect_args": {"connect_timeout": max(1, int(timeout_s))}}
    return {}


# Keys config.drift calls harmless (a resume may change them) that change what a trial reports to the pruner:
# when it evaluates, on how much, and ddplab's callbacks (EMA adds val_ema/*, early stopping ends a trial
# early). A user's own callbacks are not compared (one may be a worker's alone: a notifier, a hold); the
# study's reporter (callbacks.study) is the worker's own.
REPORTING = ("eval_every_n_epochs", "eval_every_n_steps", "limit_val_batches", "callbacks")
SHIPPED_CALLBACKS = "ddplab.callbacks."


def training(cfg: Any, searched: dict[str, Any], world_size: int = 1) -> dict[str, Any]:
    """What decides how this worker's trials train and what they report, besides their params: config.drift's
    trajectory keys (the ones a resume must not change), the keys that change what is reported (REPORTING)
    and the batches each rank and the world see at this worker's world size, outside the searched keys, as
    plain JSON values. Two workers whose records differ would report numbers the pruner must not compare."""
    import json

    from ddplab.config.drift import flatten, trajectory
    from ddplab.train import batch_size

    def searched_key(k: str) -> bool:
        return any(k == s or k.startswith(f"{s}.") for s in searched)

    shipped = {
        name
        for name, node in (cfg.get("callbacks") or {}).items()
        if str((node or {}).get("_target_", "")).startswith(SHIPPED_CALLBACKS)
    }

    def reporting(k: str) -> bool:
        # an empty callbacks node is a leaf: no shipped callback, nothing to add
        if k.startswith("callbacks"):
            return k.startswith("callbacks.") and k.split(".")[1] in shipped
        return k in REPORTING

    keys = {**trajectory(cfg), **{k: v for k, v in flatten(cfg).items() if reporting(k)}}
    if not any(searched_key(k) for k in ("batch_size", "batch_size_scope")):
        world = batch_size.micro_batch(
            cfg.batch_size, getattr(cfg.batch_size_scope, "name", cfg.batch_size_scope), world_size
        )
        keys["(global batch)"] = world
        keys["(per-rank batch)"] = world // max(1, world_size)
    return json.loads(json.dumps({k: v for k, v in keys.items() if not searched_key(k)}, default=str))


def open_study(
    storage: Any, url: str, name: str, direction: str, space_sig: str, objective: str, trains: dict[str, Any]
) -> Any:
    """Create the study, or load it if another worker did; refuse one made with another space or objective,
    or whose trials train with another config."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True)
    attrs = study.user_attrs
    if TRAINING_ATTR not in attrs:  # we created it (or it predates this record): ours is the study's
        study.set_user_attr(TRAINING_ATTR, trains)
    elif attrs[TRAINING_ATTR] != trains:
        raise ConfigError(
            f"study.name={name} in {url} trains its trials with another config: "
            f"{_trained_apart(attrs[TRAINING_ATTR], trains)}. Fix: give this worker the same overrides "
            "as the study's other workers (study.* and launch/logging keys may differ), or a new "
            "study.name"
        )
    if SPACE_ATTR not in attrs:  # we created it (or a worker died before noting it): note ours
        study.set_user_attr(SPACE_ATTR, space_sig)
        study.set_user_attr(DIRECTION_ATTR, f"{objective} {direction}")
        return study
    from ddplab.study.space import differences

    if attrs[SPACE_ATTR] != space_sig:
        raise ConfigError(
            f"study.name={name} exists in {url} with another search space: "
            f"{differences(attrs[SPACE_ATTR], space_sig)}. Fix: a new study.name, or the same study.params"
        )
    if attrs.get(DIRECTION_ATTR) != f"{objective} {direction}":
        raise ConfigError(
            f"study.name={name} in {url} optimizes {attrs.get(DIRECTION_ATTR)}, not {objective} "
            f"{direction}. Fix: a new study.name, or objective={str(attrs.get(DIRECTION_ATTR)).split()[0]}"
        )
    return study


def _trained_apart(study: dict[str, Any], here: dict[str, Any], shown: int = 8) -> str:
    from ddplab.config.drift import ABSENT

    keys = sorted(k for k in set(study) | set(here) if study.get(k, ABSENT) != here.get(k, ABSENT))
    said = "; ".join(
        f"{k}: {study.get(k, ABSENT)!r} in the study, {here.get(k, ABSENT)!r} here" for k in keys[:shown]
    )
    return said + (f"; and {len(keys) - shown} more" if len(keys) > shown else "")


class StorageLost(ResourceError):
    """The study's storage failed under a running worker (a full disk, a file made read-only or deleted, a
    database gone): one line naming the storage, the innermost cause, and what became of the trial in hand. A
    resource the machine refused: a self-launched rank that meets it says it and exits like a full disk; the
    worker exits :data:`STORAGE_EXIT` (``ddplab.failure``). ``alike``: every rank of the worker ends with
    it."""

    exit_code = STORAGE_EXIT

    def __init__(self, url: str, error: BaseException, trial: str = "", alike: bool = False):
        self.url, self.cause = url, innermost(error)
        self.alike_on_every_rank = alike
        super().__init__(
            f"study.storage={url}: it failed under this worker ({self.cause}){'; ' + trial if trial else ''}"
            ". Fix: free space on it, make it writable or restore it, then start the workers again"
        )


def failed(e: BaseException) -> bool:
    """Did ``e`` come from the study's storage (here, or in a rank of the trial)?"""
    return _failed_here(e) or any("StorageLost: study.storage=" in str(x) for x in _chain(e))


def _failed_here(e: BaseException) -> bool:
    """Did ``e`` come from the study's storage? Optuna wraps a database error in its own ("invalid data ...
    exceeding max length", whatever the cause); the journal file raises plain OSErrors from its own code."""
    import optuna
    import sqlalchemy.exc

    for x in _chain(e):
        if isinstance(
            x, (StorageLost, optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)
        ):
            return True
        if isinstance(x, OSError) and any(
            _module(tb).startswith("optuna.storages") for tb in _frames(x.__traceback__)
        ):
            return True
    return False


def innermost(e: BaseException) -> str:
    """The real cause, as one short phrase: the first error in the chain that is the database driver's or the
    OS's own, not a wrapper of Optuna's or SQLAlchemy's (an error while handling another chains to that
    one)."""
    chain = list(_chain(e))
    for x in chain:
        if isinstance(x, StorageLost):
            return x.cause
        said = re.search(
            r"StorageLost: study\.storage=\S+: it failed under this worker \((.+?)\)(?:; |\. Fix)", str(x)
        )
        if said:  # a self-launched rank's line, handed to its worker as its text
            return said.group(1)
        if not type(x).__module__.startswith(("optuna", "sqlalchemy")):
            return _phrase(x)
    return _phrase(chain[-1])


def _phrase(x: BaseException) -> str:
    why = " ".join(str(x).split())[:200]
    return f"{type(x).__name__}: {why}" if why else type(x).__name__


def _chain(e: BaseException) -> Any:
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        yield x
        orig = getattr(x, "orig", None)  # SQLAlchemy keeps the driver's error here
        inner = x.__cause__ or (None if x.__suppress_context__ else x.__context__)
        x = orig if isinstance(orig, BaseException) else inner


def _frames(tb: TracebackType | None) -> Any:
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _module(tb: TracebackType) -> str:
    return str(tb.tb_frame.f_globals.get("__name__", ""))
