"""CPU ranks, self-launched and under torchrun, keep what a step freed for the next step
(ddplab.runtime.allocator): no stream of page faults per step, where perf.host_allocator=system (the control,
under torchrun) has one; both settings train bitwise the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers.jobs import assert_ok, python_train, torchrun

from ddplab.data.tokens import write_tokens

# The language-model benchmark's job (scripts/bench_lm.py): TinyGPT, 2 ranks x 32 windows of 64 tokens.
LM = [
    "task=lm",
    "dataset=tokens",
    "dataset.block_size=64",
    "dataset.vocab_size=256",
    "model=gpt",
    "batch_size=64",
    "max_steps=45",
    "num_epochs=null",
    "progress=none",
]


def _run(tmp_path, launcher: str, setting: str) -> tuple[list[float], dict]:
    """Faults per step of each rank (steps 10-40) and the run's last checkpoint."""
    import numpy as np

    write_tokens(np.random.default_rng(0).integers(0, 256, 200_000), tmp_path / "t.bin", "uint16", 256)
    run = tmp_path / f"run-{setting}"
    args = LM + [
        f"dataset.path={tmp_path / 't.bin'}",
        f"perf.host_allocator={setting}",
        "+callbacks.pf._target_=toy.CountsPageFaults",
        f"+callbacks.pf.dir={tmp_path / setting}",
        f"hydra.run.dir={run}",
    ]
    (tmp_path / setting).mkdir()
    proc = (
        python_train(args + ["distributed.nproc_per_node=2"], tmp_path, timeout=180)
        if launcher == "self"
        else torchrun(2, args, tmp_path, timeout=180)
    )
    assert_ok(proc)
    faults = [float((tmp_path / setting / f"faults-rank{r}").read_text()) for r in (0, 1)]
    return faults, torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.dist
def test_a_self_launched_cpu_rank_takes_no_stream_of_page_faults_per_step(tmp_path):
    """Measured here: 1,270-1,690 faults per step per rank with glibc's defaults (the pages of the activations
    freed at one step's end mapped afresh at the next), 28-173 kept. Steps 10-40: the heap is built by then.
    Self-launched ranks are spawned processes: each sets its own thresholds."""
    faults, _ = _run(tmp_path, "self", "tuned")
    assert max(faults) < 300, faults


@pytest.mark.slow
@pytest.mark.dist
def test_under_torchrun_the_tuned_ranks_fault_no_pages_per_step_the_systems_do_and_both_train_the_same(
    tmp_path,
):
    """perf.host_allocator=system is the control (so the bound says something); where memory comes from never
    changes a number: the two runs' weights and optimizer states are bitwise the same.

    glibc's moving threshold depends on which blocks were freed first, so the system run's faults vary from
    run to run (per rank 625-1,690 a step measured; 1,627-3,180 over the two ranks): the control bounds their
    sum, the promise each tuned rank."""
    tuned, a = _run(tmp_path, "torchrun", "tuned")
    system, b = _run(tmp_path, "torchrun", "system")
    assert max(tuned) < 300 and sum(system) > 1000, (tuned, system)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(
        torch.cat([v.flatten() for s in a["optimizer"]["state"].values() for v in s.values()]),
        torch.cat([v.flatten() for s in b["optimizer"]["state"].values() for v in s.values()]),
    )
