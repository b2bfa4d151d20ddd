"""The same search through Hydra's Optuna sweeper and through ddplab's study mode, side by side.

    python scripts/bench_study.py                 # 16 trials, 2 parallel slots, out: /tmp/bench_study
    python scripts/bench_study.py --trials 8 --out /tmp/b

One 16-point grid (GridSampler, so both run exactly the same trials, in their own order) of trials of
uneven length (num_epochs 5..60 on the digits convnet, one process each), run three ways:

    hydra     hparams_search=optuna, hydra/launcher=joblib: 2 jobs at a time, in batches of 2 (the sweeper
              asks for a batch, waits for all of it, tells, asks again)
    study     hparams_search=study, 2 workers started side by side, each asking when it is free
    pruned    the same study with optuna's MedianPruner

For each: the wall time; each trial's busy interval (its run dir's first file to its last write); the two
slots' idle time between trials (waiting for the batch) and after their last trial until the search
ended (the tail), as fractions of 2 x the search's span; the training time summed over trials; the best
val/acc. Needs the sweep extra and Hydra's sweeper: pip install --no-deps hydra-optuna-sweeper.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EPOCHS = [5, 15, 30, 60]
LRS = [0.01, 0.03, 0.1, 0.3]
COMMON = ["model=convnet", "progress=none", "checkpoint.keep_last=1"]


def space(key: str) -> str:
    """The grid as a dict override of ``key`` (added with ++: the presets' own params stay unless
    replaced)."""
    return (
        f"{key}={{num_epochs:'choice({','.join(map(str, EPOCHS))})',"
        f"optimizer.lr:'choice({','.join(map(str, LRS))})',optimizer.weight_decay:'choice(0.0001)'}}"
    )


def hydra_cmd(out: Path, n: int) -> list[list[str]]:
    """Hydra's sweeper through a preset written for the run (its params node takes no dict override)."""
    extra = out.parent / "extra_conf" / "hparams_search"
    extra.mkdir(parents=True, exist_ok=True)
    (extra / "bench_grid.yaml").write_text(f"""# @package _global_
defaults:
  - override /hydra/sweeper: optuna
  - override /hydra/sweeper/sampler: grid
  - override /hydra/launcher: joblib
hydra:
  mode: MULTIRUN
  launcher: {{n_jobs: 2}}
  sweeper:
    direction: maximize
    study_name: bench
    n_trials: {n}
    n_jobs: 2
    params:
      num_epochs: choice({",".join(map(str, EPOCHS))})
      optimizer.lr: choice({",".join(map(str, LRS))})
      optimizer.weight_decay: choice(0.0001)
""")
    return [
        [
            sys.executable,
            str(REPO / "train.py"),
            f"--config-dir={extra.parent}",
            "hparams_search=bench_grid",
            f"hydra.sweep.dir={out}",
            *COMMON,
        ]
    ]


def study_cmd(out: Path, n: int, pruner: bool) -> list[list[str]]:
    prune = (
        ["study.pruner.n_startup_trials=4", "study.pruner.n_warmup_steps=2"]
        if pruner
        else ["study.pruner=null"]
    )
    one = [
        sys.executable,
        str(REPO / "train.py"),
        "hparams_search=study",
        f"study.dir={out}",
        f"study.n_trials={n}",
        "study.sampler=null",
        "++study.sampler={_target_:optuna.samplers.GridSampler}",
        space("++study.params"),
        *prune,
        *COMMON,
    ]
    return [one, one]  # two workers, the same command


def run(cmds: list[list[str]], log: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    procs = [
        subprocess.Popen(c, cwd=log.parent, env=env, stdout=open(f"{log}.{i}", "w"), stderr=subprocess.STDOUT)
        for i, c in enumerate(cmds)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"exit codes {codes}; see {log}.*")
    return time.time() - t0


def intervals(sweep: Path) -> list[tuple[float, float, dict]]:
    """(start, end, result) of each trial: its dir's first file (Hydra's .hydra/, the study's trial.json)
    to the last write of anything in it."""
    out = []
    for job in sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()):
        files = [f for f in job.rglob("*") if f.is_file()]
        first = min(f.stat().st_mtime for f in files if f.name in ("trial.json", "overrides.yaml"))
        out.append(
            (first, max(f.stat().st_mtime for f in files), json.loads((job / "result.json").read_text()))
        )
    return sorted(out, key=lambda x: x[0])


def slots(spans: list[tuple[float, float, dict]], k: int = 2) -> dict[str, float]:
    """Assign trials to k slots in start order (each to the slot that came free first), then idle time."""
    free = [spans[0][0]] * k
    gaps = [0.0] * k
    for start, end, _ in spans:
        i = min(range(k), key=lambda j: free[j])
        gaps[i] += max(0.0, start - free[i])
        free[i] = end
    begin, finish = spans[0][0], max(e for _, e, _ in spans)
    tail = sum(finish - f for f in free)
    whole = k * (finish - begin)
    busy = sum(e - s for s, e, _ in spans)
    return {
        "span_s": finish - begin,
        "busy_s": busy,
        "idle_between": sum(gaps) / whole,
        "idle_tail": tail / whole,
        "idle_total": 1 - busy / whole,
    }


def summary(name: str, wall: float, sweep: Path) -> dict:
    spans = intervals(sweep)
    accs = [r.get("metrics", {}).get("val/acc") for *_, r in spans]
    states = [(r.get("trial") or {}).get("state", r["status"]) for *_, r in spans]
    return {
        "method": name,
        "wall_s": round(wall, 1),
        **{k: round(v, 3) for k, v in slots(spans).items()},
        "trials": len(spans),
        "pruned": states.count("PRUNED"),
        "best_val_acc": max(a for a in accs if a is not None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_study"))
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    rows = []
    for name, cmds in (
        ("hydra optuna sweeper, joblib n_jobs=2", hydra_cmd(a.out / "hydra", a.trials)),
        ("ddplab study, 2 workers", study_cmd(a.out / "study", a.trials, False)),
        ("ddplab study, 2 workers, MedianPruner", study_cmd(a.out / "pruned", a.trials, True)),
    ):
        sweep = a.out / ("hydra" if name.startswith("hydra") else "pruned" if "Pruner" in name else "study")
        wall = run(cmds, a.out / sweep.name)
        rows.append(summary(name, wall, sweep))
        print(json.dumps(rows[-1]), flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    base = rows[1]["busy_s"]
    print(
        f"\npruning saved {1 - rows[2]['busy_s'] / base:.1%} of the study's training time "
        f"({rows[2]['busy_s']:.0f} s vs {base:.0f} s summed over trials)"
    )


if __name__ == "__main__":
    main()
