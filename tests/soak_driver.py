"""The soak driver's helpers (scripts/soak.py and its checks): a trial's processes described and killed, a
working dir's snapshot, TensorBoard events compared with the uninterrupted reference's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from soak_toy import _comm, trial_pids  # noqa: F401

# --------------------------------------------------------- the driver's helpers (scripts/soak.py)


def kill(pids: list[int]) -> None:
    """SIGKILL these (the trial's own) processes, by pid."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return str(pid)
    return f"{pid} {cmdline[:120]}"


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder``: (mtime, size) of files, (0, 0) of the rest."""
    out = {}
    for p in folder.rglob("*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        out[str(p.relative_to(folder))] = (st.st_mtime_ns, st.st_size) if p.is_file() else (0, 0)
    return out


def check_events(run: Path, ref: Path) -> list[str]:
    """Invariant 2, on TensorBoard's own reading of the events (purged steps dropped, as the dashboard
    does)."""
    from ddplab.events import read_scalars

    mine, theirs = read_scalars(events_dir(run)), read_scalars(events_dir(ref))
    dups = {tag: sorted({s for s, _ in pts if [x for x, _ in pts].count(s) > 1}) for tag, pts in mine.items()}
    dups = {tag: steps for tag, steps in dups.items() if steps}
    problems = (
        [f"steps logged more than once, in {len(dups)} tags: {dict(list(dups.items())[:3])}"] if dups else []
    )
    problems += [
        f"{tag}: {mine.get(tag)} vs the reference's {theirs.get(tag)}"
        for tag in ("val/loss", "val/acc")
        if mine.get(tag) != theirs.get(tag)
    ]
    for tag in ("train/loss", "train/acc"):
        problems += check_intervals(tag, dict(mine.get(tag, [])), dict(theirs.get(tag, [])))
    return problems


def events_dir(run: Path) -> Path:
    """The run's events dir: ``tb/``, or a study trial's, named after its params."""
    found = sorted({p.parent for p in run.glob("*/events.out.tfevents.*")})
    return found[0] if found else run / "tb"


def check_intervals(tag: str, mine: dict[int, float], ref: dict[int, float]) -> list[str]:
    """Each reference log interval (p, t] is logged once by the run, whole (bitwise) or split at a stop."""
    problems, prev = [], 0
    for t in sorted(ref):
        parts = [u for u in sorted(mine) if prev < u <= t]
        if not parts or parts[-1] != t:
            problems.append(f"{tag}: step {t} not logged (run logged {parts} in ({prev}, {t}])")
        elif parts == [t] and mine[t] != ref[t]:
            problems.append(f"{tag} at step {t}: {mine[t]!r} vs the reference's {ref[t]!r}")
        elif len(parts) > 1:
            bounds = [prev] + parts
            mean = sum(mine[u] * (u - p) for p, u in zip(bounds, parts)) / (t - prev)
            if abs(mean - ref[t]) > 1e-5 * max(1.0, abs(ref[t])):
                problems.append(
                    f"{tag} over ({prev}, {t}] split at {parts[:-1]}: mean {mean!r} vs {ref[t]!r}"
                )
        prev = t
    extra = [u for u in mine if u > prev]
    return problems + (
        [f"{tag}: logged at steps {extra}, after the reference's last log step"] if extra else []
    )
