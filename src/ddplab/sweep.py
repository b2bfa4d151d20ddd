"""Summaries of a multirun directory: overrides vs final/best metrics, failures with their errors.

:class:`SweepSummary` (a Hydra callback, ``conf/train.yaml``) prints one and writes ``summary.md`` and
``summary.csv`` into the sweep dir when a sweep ends; ``scripts/sweep_summary.py`` does it for any
sweep dir, old ones included.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddplab.rundir import label, read_overrides, read_result, swept
from ddplab.train.reporting import shown
from ddplab.train.state import best_name

COLUMNS = ["job", "status", "swept", "objective", "best", "val/loss", "train/loss", "overrides", "error"]
log = logging.getLogger("ddplab")


def _job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )


def _from_events(job: Path) -> dict[str, float]:
    from ddplab.events import read_scalars

    return {tag: values[-1][1] for tag, values in read_scalars(job).items() if values}


def direction(sweep_dir: Path, objective: str) -> bool:
    """Whether lower ``objective`` is better, as the jobs recorded it (their task decides: a loss or
    an error is minimised); for older sweeps that did not record it, a loss is."""
    for job in _job_dirs(sweep_dir):
        noted = (read_result(job) or {}).get("objective") or {}
        if noted.get("name") == objective:
            return bool(noted["minimize"])
    return objective.rsplit("/", 1)[-1].endswith("loss")


def summarize(
    sweep_dir: Path, objective: str = "val/acc", minimize: bool | None = None
) -> list[dict[str, Any]]:
    """One row per job, best first; failed and unfinished jobs last. ``minimize``: None, as the jobs
    recorded it."""
    minimize = direction(sweep_dir, objective) if minimize is None else minimize
    rows = []
    for job in _job_dirs(sweep_dir):
        overrides = " ".join(read_overrides(job) or [])
        result, swept_values = read_result(job), label(swept(job), 60)
        if result is None:
            status, metrics, error = "unfinished", _from_events(job), ""
        else:
            status, metrics, error = result["status"], result.get("metrics") or {}, result.get("error", "")
            # A study's trial: the state the study was told (pruned; failed though the run completed).
            status = {"PRUNED": "pruned", "FAIL": "failed"}.get(
                (result.get("trial") or {}).get("state"), status
            )
            if status != "completed" and not metrics:
                metrics = _from_events(job)
        rows.append(
            {
                "job": int(job.name),
                "status": status,
                "overrides": overrides,
                "swept": swept_values,
                # older runs: best/…
                "objective": metrics.get(objective),
                "best": metrics.get(best_name(objective), metrics.get("best/" + objective)),
                "val/loss": metrics.get("val/loss"),
                "train/loss": metrics.get("train/loss"),
                "error": " ".join(str(error).split())[:300],
            }
        )

    def key(r: dict[str, Any]) -> tuple:
        v = r["objective"]
        ok = r["status"] == "completed" and v is not None and not math.isnan(v)
        return (not ok, (v if minimize else -v) if ok else 0.0, r["job"])

    return sorted(rows, key=key)


def _fmt(v: Any, digits: int = 6) -> str:
    return f"{v:.{digits}g}" if isinstance(v, float) else ("" if v is None else str(v))


def to_markdown(rows: list[dict[str, Any]], objective: str) -> str:
    head = [c if c != "objective" else objective for c in COLUMNS]
    head = [h if h != "best" else f"best {objective}" for h in head]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[c]).replace("|", "\\|") for c in COLUMNS) + " |")
    return "\n".join(lines)


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    for r in rows:
        w.writerow({c: _fmt(r[c]) for c in COLUMNS})
    return buf.getvalue()


def to_console(rows: list[dict[str, Any]], objective: str, minimize: bool, width: int = 85) -> list[str]:
    """The sweep's jobs as short console lines, best first (a failure's error shortened); 85 columns
    leave room for Hydra's log prefix, which these lines get."""
    done = sum(r["status"] == "completed" for r in rows)
    lines = [
        f"sweep: {len(rows)} jobs, {done} completed, {len(rows) - done} not; by {objective} "
        f"({'lower' if minimize else 'higher'} is better)",
        f"{'job':>4}  {'status':<10} {objective[-10:]:>10} {'best':>10}  swept",
    ]
    for r in rows:
        objective, best = _fmt(r["objective"], 4), _fmt(r["best"], 4)
        line = f"{r['job']:>4}  {r['status'][:10]:<10} {objective:>10} {best:>10}  {r['swept']}"
        if r["error"]:
            line += f"  {r['error']}"
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return lines


class SweepSummary(Callback):
    """At a sweep's end (in the process that ran the sweep: rank 0 of a torchrun sweep): its jobs
    sorted by the objective on the console, and as summary.md / summary.csv in the sweep dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from ddplab.runtime import env

        sweep_dir = Path(str(config.hydra.sweep.dir))
        if env.rank() != 0 or not sweep_dir.is_dir():  # other ranks swept in scratch dirs
            return
        objective = str(config.get("objective") or "val/acc")
        minimize = direction(sweep_dir, objective)
        rows = summarize(sweep_dir, objective, minimize)
        if not rows:
            return
        for line in to_console(rows, objective, minimize):
            log.info("%s", line)
        try:
            (sweep_dir / "summary.md").write_text(to_markdown(rows, objective) + "\n")
            (sweep_dir / "summary.csv").write_text(to_csv(rows))
        except OSError as e:  # the console has the table; Hydra would print a warning and its traceback
            log.error("could not write the sweep's summary in %s: %s", sweep_dir, e)
            return
        log.info("table: %s (and summary.csv)", shown(sweep_dir / "summary.md"))
