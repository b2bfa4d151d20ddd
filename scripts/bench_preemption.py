"""Signal-to-checkpoint time and steps lost on preemption, by step time and log interval.

For each (step time, log_every_n_steps) cell: a 2-rank ``torchrun --standalone`` digits run whose training
forward sleeps the step time (toy.SlowMLP, tests/toy_models.py), SIGTERM to torchrun's agent once rank 0 has
begun its N-th step, then:

* signal → checkpoint: seconds from the signal to the preemption checkpoint's file (its mtime);
* steps lost: steps completed before the signal that the checkpoint does not hold (goal 0);
* exit: seconds from the signal to torchrun's exit (torchrun SIGKILLs the ranks after 30 s: a stop
  that needs longer loses everything).

    python scripts/bench_preemption.py                        # the full table (about 6 min here)
    python scripts/bench_preemption.py --steps 0.5 --logs 10  # one cell
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(step_s: float, log_every: int, after: int, workdir: Path) -> dict[str, object]:
    run, trace, out = workdir / "run", workdir / "trace", workdir / "log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "train.py"),
        "model=mlp",
        "model._target_=toy.SlowMLP",
        f"+model.delay_s={step_s}",
        f"+model.trace={trace}",
        "num_epochs=50",
        f"log_every_n_steps={log_every}",
        "progress=log",
        f"hydra.run.dir={run}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    with open(out, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while _train_forwards(trace) < after + 1:  # steps 1..after done, step after+1 begun
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before the signal:\n{out.read_text()[-2000:]}")
            time.sleep(0.01)
        done = _train_forwards(trace) - 1
        t_signal = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        exit_s = time.time() - t_signal
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        res = json.loads((run / "result.json").read_text())
    except (OSError, ValueError):
        res = {}
    ckpt = res.get("checkpoint")
    saved = Path(ckpt).stat().st_mtime - t_signal if ckpt and Path(ckpt).exists() else None
    step = res.get("step") if res.get("status") == "preempted" else 0
    return {
        "step_s": step_s,
        "log_every": log_every,
        "done_at_signal": done,
        "checkpoint_step": step,
        "lost": max(0, done - (step or 0)),
        "signal_to_checkpoint_s": saved,
        "exit_s": exit_s,
        "status": res.get("status", "no result.json"),
    }


def _train_forwards(trace: Path) -> int:
    try:
        return sum(1 for line in trace.read_text().splitlines() if line.startswith("train"))
    except OSError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=float, nargs="+", default=[0.01, 0.5, 4.0, 10.0], help="step times, s")
    ap.add_argument("--logs", type=int, nargs="+", default=[1, 10, 100], help="log_every_n_steps values")
    args = ap.parse_args()
    rows = []
    print(
        "| step s | log every | steps done at signal | checkpoint step | steps lost | signal → checkpoint s "
        "| "
        "signal → exit s | status |\n|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for step_s in args.steps:
        for log_every in args.logs:
            # Signal well into the run: after ~2 s of steps, and at least after step 2 (right after a log step
            # when the log interval allows it: the old agreement's worst case).
            after = max(2, min(int(2.0 / step_s), 200))
            after = log_every if log_every <= after else after
            with tempfile.TemporaryDirectory(prefix="ddplab-bench-preempt-") as d:
                r = one(step_s, log_every, after, Path(d))
            rows.append(r)
            ck = "—" if r["signal_to_checkpoint_s"] is None else f"{r['signal_to_checkpoint_s']:.1f}"
            print(
                f"| {step_s:g} | {log_every} | {r['done_at_signal']} | {r['checkpoint_step'] or '—'} | "
                f"{r['lost']} | "
                f"{ck} | {r['exit_s']:.1f} | {r['status']} |",
                flush=True,
            )
    bad = [r for r in rows if r["lost"] or r["status"] != "preempted"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
