"""Per-step collective and host-sync counts of a real job, and the budget between log steps they must keep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.jobs import REPO, assert_ok, run_cmd


def count_steps(
    tmp_path: Path, nproc: int, args: list[str], extra_env: dict[str, str] | None = None
) -> list[list[dict[str, int]]]:
    """Per-step collective/sync counts of every rank of `torchrun count_worker.py ARGS`."""
    worker = REPO / "tests" / "workers" / "count_worker.py"
    proc = run_cmd(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(worker),
            *args,
        ],
        tmp_path,
        timeout=180,
        extra_env={**(extra_env or {}), "COUNT_OUT": str(tmp_path / "counts")},
    )
    assert_ok(proc)
    return [json.loads((tmp_path / f"counts.{r}").read_text()) for r in range(nproc)]


def assert_quiet_between_log_steps(
    ranks: list[list[dict[str, int]]], steps_per_epoch: int, epochs: int, log_every: int
) -> None:
    """count_steps' result: one collective (and some host reads) after each log step; after any other step
    nothing at all — except the stop agreement's check, one tiny collective and one host read, about once a
    second of training (runtime.stopping.PERIOD_S): held to exactly that. Epoch ends (evaluation, checkpoint)
    are collectives by design and not checked."""
    from ddplab.runtime.stopping import PERIOD_S

    for rank, steps in enumerate(ranks):
        assert len(steps) == epochs * steps_per_epoch
        # steps[k] covers what ran after optimizer step k (1-based) and up to step k+1.
        for k in range(1, len(steps)):
            where = f"rank {rank}, between steps {k} and {k + 1}"
            if k % steps_per_epoch == 0:
                continue
            if k % log_every == 0:
                assert steps[k]["collectives"] == 1 and steps[k]["stop_checks"] == 0, (where, steps[k])
                assert steps[k]["syncs"] > 0, (where, steps[k])  # the counter works
            else:
                checks = steps[k]["stop_checks"]
                assert checks in (0, 1), (where, steps[k])
                assert {key: steps[k][key] for key in ("collectives", "syncs", "cuda_syncs")} == {
                    "collectives": checks,
                    "syncs": checks,
                    "cuda_syncs": 0,
                }, (where, steps[k])
        # The first check comes after step 1 and measures it; from then on one per PERIOD_S at most (an epoch
        # end's entry also holds its evaluation, which has a cadence of its own: one check per evaluation
        # here).
        checks = sum(s["stop_checks"] for k, s in enumerate(steps) if k % steps_per_epoch)
        seconds = steps[-1]["t"] - steps[0]["t"]
        assert 1 <= checks <= 2 + seconds / PERIOD_S, (rank, checks, seconds)
