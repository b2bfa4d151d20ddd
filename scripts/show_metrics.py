"""Print a run's logged scalars as a table: last value, min, max, and the step of the last one.

python scripts/show_metrics.py outputs/2026-11-21/10-00-00      # a run dir (reads <dir>/tb)
python scripts/show_metrics.py outputs/.../tb --prefix val/
"""

import argparse
from pathlib import Path

from ddplab.events import events_in, read_scalars


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run dir (or its events folder: tb/, or a sweep job's lr=0.1,...)")
    ap.add_argument("--prefix", default="", help="only tags starting with this, e.g. val/")
    args = ap.parse_args()
    log_dir = events_in(args.run)
    scalars = read_scalars(log_dir)
    if not scalars:
        raise SystemExit(f"no TensorBoard scalars under {log_dir}: is it a ddplab run dir?")
    print(f"| {'tag':28} | {'step':>6} | {'last':>12} | {'min':>12} | {'max':>12} |")
    print(f"|{'-' * 30}|{'-' * 8}|{'-' * 14}|{'-' * 14}|{'-' * 14}|")
    for tag in sorted(t for t in scalars if t.startswith(args.prefix)):
        values = [v for _, v in scalars[tag]]
        step = scalars[tag][-1][0]
        print(f"| {tag:28} | {step:>6} | {values[-1]:>12.6g} | {min(values):>12.6g} | {max(values):>12.6g} |")


if __name__ == "__main__":
    main()
