"""A stream's length, counted once and checked when given: ``dataset.num_samples`` against the files it was
counted on.

A streamed source (``dataset=hf dataset.streaming=true``) counts its samples with one pass at start-up and
advises ``dataset.num_samples=N`` to skip that pass next time. Kept after files were added to the folder, N
made every epoch train on the first N samples and never read the new files, and the run said ``completed``.
So each count is recorded with the file set's fingerprint (each file's name, size and modification time: a
stat each, no read), and a given N is checked against the record of the same source: other files than
those it was counted on, or another count, is one line naming what changed. The record lives in this
user's private ddplab directory (ddplab.runtime.env.private_dir): a machine that never counted the source
has nothing to check against, and an N larger than the files hold is still caught at the epoch's end.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ddplab.errors import InputError
from ddplab.runtime import env


def fingerprint(files: list[str]) -> list[list[Any]]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    return out


def _record_path(source: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(source, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return env.private_dir() / f"stream-count-{digest}.json"


def record(source: dict[str, Any], files: list[str], n: int) -> None:
    """Note that ``source`` (its path spec and how it is read) held ``n`` samples in ``files`` (best
    effort)."""
    path = _record_path(source)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"source": source, "files": fingerprint(files), "n": n}))
        tmp.replace(path)  # every rank counts the same: the last rename wins, all equal
    except OSError:
        tmp.unlink(missing_ok=True)


def check(source: dict[str, Any], files: list[str], n: int, key: str) -> None:
    """A given ``dataset.num_samples=n`` against the record of ``source``'s last count, where there is one."""
    try:
        rec = json.loads(_record_path(source).read_text())
    except (OSError, ValueError):
        return
    then = {f[0]: f for f in rec["files"]}
    now = {f[0]: f for f in fingerprint(files)}
    if then == now and rec["n"] == n:
        return
    fix = "Fix: drop dataset.num_samples (counted again at start-up), or set the count that line gives"
    if then != now:
        added = sorted(set(now) - set(then))
        gone = sorted(set(then) - set(now))
        changed = sorted(f for f in set(now) & set(then) if now[f] != then[f])
        what = "; ".join(
            f"{label}: {', '.join(Path(f).name for f in fs[:3])}{' ...' if len(fs) > 3 else ''}"
            for label, fs in (("added", added), ("removed", gone), ("changed", changed))
            if fs
        )
        raise InputError(
            f"dataset.num_samples={n}: it was counted ({rec['n']} samples) on other files than "
            f"dataset.{key} holds now ({what}); the epochs would stop short of them. {fix}"
        )
    raise InputError(
        f"dataset.num_samples={n}: dataset.{key}'s files held {rec['n']} samples when counted. {fix}"
    )
