"""Checkpoint stalls: how long a save holds the training loop, synchronous against
``checkpoint.async_save=true``, at about 0.1, 1 and 2 GB of model + optimizer state.

    python scripts/bench_checkpoint.py                    # 0.1, 1, 2 GB; 3 saves each; a table
    python scripts/bench_checkpoint.py --gb 1 --saves 5   # one size
    python scripts/bench_checkpoint.py --dir /mnt/nfs/x   # checkpoints on another file system
    python scripts/bench_checkpoint.py --allocator system # glibc's defaults (perf.host_allocator=system)

Each (size, mode) is one ``python train.py``-equivalent run in its own process (its peak memory is its
own): the real trainer, ``model=mlp`` with hidden layers [H, H, H] sized so that the weights plus
SGD's momentum make the state, a checkpoint every 8 optimizer steps (12 above 1 GB: a write ends before
the next save). A callback records, per save:

  stall s    how long the save held the loop (sync: the whole write; async: the copy to CPU memory,
             and any wait for the previous write, also shown on its own)
  write s    the save's start to its file on disk (``checkpoints/save_seconds.json``)
  step s     median time of the optimizer steps after a save (async: they run while the write does)

  whole run  the run's wall time, start-up to exit (same steps, same saves): what the stall saved, net of
             the steps slowed by a write beside them (on a CPU-only machine they share the cores)

The first save of each run is left out of the medians (async: it allocates its buffers).
Reported also: the state's size, peak RSS of the process, and async's staging buffers.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD: list[dict[str, float]] = []


class SaveRecorder:
    """Per checkpoint: the loop's stall (the manager's ``last_stall_s``); per step: its time."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def on_step_end(self, state, step):
        now = time.perf_counter()
        RECORD.append({"step": step, "step_s": now - self.t})
        self.t = now

    def on_fit_start(self, state):
        # Each save as the loop makes it (on_save, with async_save, hears of a write only once it is on disk:
        # at the next save), so the stall is this save's and the next step's time starts after it.
        ck, inner = state.checkpoints, state.checkpoints.save

        def save(*args, **kwargs):
            path = inner(*args, **kwargs)
            if path:
                RECORD.append(
                    {
                        "save": state.loop.step,
                        "stall_s": ck.last_stall_s,
                        "wait_s": ck.last_wait_s,
                        "staging_bytes": ck.staging_bytes,
                    }
                )
                self.t = time.perf_counter()
            return path

        ck.save = save


def hidden_for(gb: float) -> int:
    """Hidden [H, H, H] has two HxH weight matrices (~2 H^2 fp32 numbers) plus their momentum: 16 H^2
    bytes."""
    return int(math.sqrt(gb * 2**30 / 16))


def every_for(gb: float) -> int:
    """Steps between saves: enough for a write to end before the next save (on 2 cores: a 2 GB write takes
    ~8 s, steps ~1 s), so the stall is the copy; a save that must wait anyway is counted in its stall."""
    return 8 if gb <= 1 else 12


def one(gb: float, mode: str, saves: int, where: Path, allocator: str = "tuned") -> dict[str, float]:
    sys.path.insert(0, str(REPO / "src"))
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    import ddplab
    from ddplab.config import register_configs

    register_configs()
    h = hidden_for(gb)
    ov = [
        "model=mlp",
        f"model.hidden=[{h},{h},{h}]",
        "model.dropout=0",
        "num_epochs=1",
        f"limit_train_steps={every_for(gb) * saves + 1}",
        f"checkpoint.every_n_steps={every_for(gb)}",
        f"checkpoint.keep_last={saves + 2}",
        "checkpoint.save_best=false",
        "limit_val_batches=1",
        "batch_size=32",
        "progress=none",
        f"checkpoint.async_save={mode == 'async'}",
        f"perf.host_allocator={allocator}",
        "+callbacks.rec._target_=__main__.SaveRecorder",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=ov)
    with open_dict(cfg):
        cfg.run_dir = str(where)
    t0 = time.perf_counter()
    ddplab.run(cfg)
    run_s = time.perf_counter() - t0
    written = json.loads((where / "checkpoints" / "save_seconds.json").read_text())
    saves_ = [r for r in RECORD if "save" in r][1:]
    steps = [r["step_s"] for i, r in enumerate(RECORD) if "step" in r and i and "save" in RECORD[i - 1]][1:]
    state_bytes = sum(p.stat().st_size for p in (where / "checkpoints").glob("step-*.pt")) / max(
        1, len(list((where / "checkpoints").glob("step-*.pt")))
    )
    return {
        "gb": gb,
        "mode": mode,
        "state_gb": state_bytes / 2**30,
        "stall_s": statistics.median(r["stall_s"] for r in saves_),
        "wait_s": max(r["wait_s"] for r in saves_),
        "write_s": statistics.median(v for k, v in written.items() if k.startswith("step-")),
        "step_after_save_s": statistics.median(steps) if steps else float("nan"),
        "staging_gb": max(r["staging_bytes"] for r in saves_) / 2**30,
        "run_s": run_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, nargs="*", default=[0.1, 1.0, 2.0])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the runs write (default: a temporary dir)")
    ap.add_argument("--allocator", choices=["tuned", "system"], default="tuned", help="perf.host_allocator")
    ap.add_argument("--one", nargs=2, metavar=("GB", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(float(a.one[0]), a.one[1], a.saves, a.dir, a.allocator)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for gb in a.gb:
            for mode in ("sync", "async"):
                where = Path(tmp) / f"{gb}-{mode}"
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        str(gb),
                        mode,
                        "--saves",
                        str(a.saves),
                        "--dir",
                        str(where),
                        "--allocator",
                        a.allocator,
                    ],
                    capture_output=True,
                    text=True,
                    cwd=tmp,
                    env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"},
                )
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{gb} GB {mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
                rows.append(json.loads(line[7:]))
                subprocess.run(["rm", "-rf", str(where)])
                print(f"done: {gb} GB {mode}", file=sys.stderr, flush=True)
    print(
        "| state | mode | loop stall per save | of it, waiting for the previous write (max) | write (save "
        "start "
        "to file on disk) | stall / sync stall | step after a save | whole run | staging buffers | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sync = next(x for x in rows if x["gb"] == r["gb"] and x["mode"] == "sync")
        print(
            f"| {r['state_gb']:.2f} GB | {r['mode']} | {r['stall_s']:.3f} s | {r['wait_s']:.2f} s | "
            f"{r['write_s']:.2f} s "
            f"| {100 * r['stall_s'] / sync['stall_s']:.1f} % | {r['step_after_save_s']:.2f} s | "
            f"{r['run_s']:.1f} s "
            f"| {r['staging_gb']:.2f} GB | {r['peak_rss_gb']:.2f} GB |"
        )


if __name__ == "__main__":
    main()
