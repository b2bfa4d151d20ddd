"""Where a study lives: an Optuna storage opened from a URL, and the study in it, checked against this worker's.

    sqlite:///multirun/study-x/study.db     one machine (the default: <study.dir>/study.db)
    journal:/shared/fs/study-x.log          Optuna's journal file: workers on hosts sharing a file system
    postgresql://user:pw@host/db            a cluster (pip install 'psycopg[binary]'); mysql+pymysql://... too

A storage that does not answer fails within ``study.timeout_s`` with one line naming the URL, never hangs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ddplab.config.errors import ConfigError

log = logging.getLogger("ddplab")

SPACE_ATTR = "ddplab:space"  # the study's search space (space.signature), set by the worker that created it
DIRECTION_ATTR = "ddplab:objective"


def default_url(study_dir: Path) -> str:
    return f"sqlite:///{study_dir.absolute() / 'study.db'}"


def open_storage(url: str, timeout_s: float) -> Any:
    """Optuna's storage for ``url`` (RDB or journal file); a ConfigError if it cannot be opened."""
    import optuna

    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            path = Path(url[len("journal:"):])
            if not path.parent.is_dir():
                raise FileNotFoundError(f"no directory {path.parent}")
            return JournalStorage(JournalFileBackend(str(path)))
        return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url, timeout_s))
    except ImportError as e:  # the database's driver (Optuna re-raises it as "Failed to import DB access module")
        driver = "'psycopg[binary]'" if "postgres" in url else "pymysql" if "mysql" in url else "the database's driver"
        raise ConfigError(f"study.storage={url}: its driver is not installed ({' '.join(str(e).split())[:200]}). "
                          f"Fix: pip install {driver}") from None
    except Exception as e:  # sqlalchemy's OperationalError, ArgumentError, a missing dir ...
        why = " ".join(str(getattr(e, "orig", None) or e).split())[:300]
        raise ConfigError(f"study.storage={url}: cannot open it ({type(e).__name__}: {why}). Fix: a reachable "
                          "database URL (sqlite:///path/study.db, postgresql://user@host/db) or journal:<file on a "
                          "shared file system>") from None


def _engine_kwargs(url: str, timeout_s: float) -> dict[str, Any]:
    """A bounded wait: the database's own connect timeout; SQLite's wait for another worker's write lock."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": max(timeout_s, 60.0)}}  # workers queue on SQLite's one writer
    if url.startswith("postgres"):
        return {"connect_args": {"connect_timeout": max(1, int(timeout_s))}}
    if url.startswith("mysql"):
        return {"connect_args": {"connect_timeout": max(1, int(timeout_s))}}
    return {}


def open_study(storage: Any, url: str, name: str, direction: str, space_sig: str, objective: str) -> Any:
    """Create the study, or load it if another worker did; refuse one made with another space or objective."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True)
    attrs = study.user_attrs
    if SPACE_ATTR not in attrs:  # we created it (or a worker died before noting it): note ours
        study.set_user_attr(SPACE_ATTR, space_sig)
        study.set_user_attr(DIRECTION_ATTR, f"{objective} {direction}")
        return study
    from ddplab.study.space import differences

    if attrs[SPACE_ATTR] != space_sig:
        raise ConfigError(f"study.name={name} exists in {url} with another search space: "
                          f"{differences(attrs[SPACE_ATTR], space_sig)}. Fix: a new study.name, or the same study.params")
    if attrs.get(DIRECTION_ATTR) != f"{objective} {direction}":
        raise ConfigError(f"study.name={name} in {url} optimizes {attrs.get(DIRECTION_ATTR)}, not {objective} "
                          f"{direction}. Fix: a new study.name, or objective={str(attrs.get(DIRECTION_ATTR)).split()[0]}")
    return study
