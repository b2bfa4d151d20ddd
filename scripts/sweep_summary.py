"""Table of a sweep: each job's overrides vs its final and best metrics, best first.

    python scripts/sweep_summary.py multirun/2026-11-21/10-00-00
    python scripts/sweep_summary.py multirun/... --objective val/loss --minimize --csv summary.csv

Reads each job's result.json (written when the job ends, with its error if it
failed), falling back to its TensorBoard events for jobs that never finished.
Prints markdown; writes CSV to --csv (default: <sweep dir>/summary.csv).
A sweep writes this summary itself when it ends (ddplab.sweep.SweepSummary);
this script is for sweeps still running, interrupted, or made before that.
"""

import argparse
from pathlib import Path

from ddplab.sweep import summarize, to_csv, to_markdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path, help="multirun/<date>/<time>")
    ap.add_argument("--objective", default="val/acc")
    ap.add_argument(
        "--minimize",
        action="store_true",
        default=None,
        help="lower objective is better (default: as the jobs recorded it; a loss is minimised)",
    )
    ap.add_argument(
        "--csv", type=Path, default=None, help="CSV output path (default <sweep_dir>/summary.csv)"
    )
    args = ap.parse_args()
    if not args.sweep_dir.is_dir():
        raise SystemExit(f"{args.sweep_dir} is not a directory: pass a multirun/<date>/<time> folder")
    rows = summarize(args.sweep_dir, args.objective, args.minimize)
    if not rows:
        raise SystemExit(f"no job folders (0, 1, ...) in {args.sweep_dir}: is it a Hydra multirun dir?")
    print(to_markdown(rows, args.objective))
    out = args.csv or args.sweep_dir / "summary.csv"
    out.write_text(to_csv(rows))
    print(f"\nCSV: {out}")


if __name__ == "__main__":
    main()
