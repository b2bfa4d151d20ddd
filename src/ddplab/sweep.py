"""Summaries of a multirun directory: overrides vs final/best metrics, failures with their errors."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from ddplab.rundir import read_overrides, read_result

COLUMNS = ["job", "status", "overrides", "objective", "best", "val/loss", "train/loss", "error"]


def _job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def _from_events(job: Path) -> dict[str, float]:
    if not (job / "tb").is_dir():
        return {}
    from ddplab.events import read_scalars

    return {tag: values[-1][1] for tag, values in read_scalars(job / "tb").items() if values}


def summarize(sweep_dir: Path, objective: str = "val/acc", minimize: bool = False) -> list[dict[str, Any]]:
    """One row per job, best first; failed and unfinished jobs last."""
    rows = []
    for job in _job_dirs(sweep_dir):
        overrides = " ".join(read_overrides(job) or [])
        result = read_result(job)
        if result is None:
            status, metrics, error = "unfinished", _from_events(job), ""
        else:
            status, metrics, error = result["status"], result.get("metrics") or {}, result.get("error", "")
            if status != "completed" and not metrics:
                metrics = _from_events(job)
        rows.append({
            "job": int(job.name), "status": status, "overrides": overrides,
            "objective": metrics.get(objective), "best": metrics.get("best/" + objective),
            "val/loss": metrics.get("val/loss"), "train/loss": metrics.get("train/loss"),
            "error": " ".join(str(error).split())[:300],
        })

    def key(r: dict[str, Any]) -> tuple:
        v = r["objective"]
        ok = r["status"] == "completed" and v is not None and not math.isnan(v)
        return (not ok, (v if minimize else -v) if ok else 0.0, r["job"])

    return sorted(rows, key=key)


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else ("" if v is None else str(v))


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
