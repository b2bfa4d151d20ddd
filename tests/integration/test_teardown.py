"""The interpreter's teardown after a job (ddplab.runtime.teardown): cheap, and nothing left unwritten."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
from helpers.callbacks import BASE
from helpers.jobs import REPO, TRAIN, assert_ok, run_cmd, torchrun_cmd

# Registered before train.py's own handler, so it runs after it: what the teardown then finds.
_LAST_WORD = """
import atexit, gc, json, runpy, sys
said = sys.argv.pop(2)
atexit.register(lambda: open(said, "w").write(json.dumps({"frozen": gc.get_freeze_count()})))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.dist
def test_a_group_left_while_its_last_collective_still_runs_ends_every_rank(tmp_path):
    """Rank 0 leaves the process group while its last collective still runs (tests/workers/
    late_collective_worker.py: rank 1 joins it 2 s late). Before: at the exit's collection DDP's reducer
    dropped the group last, with the GIL held, and its destructor waited for gloo's worker, which waited for
    the GIL to free the collective's tensor: rank 0 never ended (CI's hang, caught there at random)."""
    run = tmp_path / "run"
    worker = REPO / "tests" / "workers" / "late_collective_worker.py"
    args = BASE + ["num_epochs=1", "limit_train_steps=2", "batch_size=48", f"hydra.run.dir={run}"]
    proc = run_cmd(torchrun_cmd(3, args, worker), tmp_path, timeout=90)  # 3 ranks: the hang CI met
    assert_ok(proc)
    assert json.loads((run / "result.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_a_finished_job_leaves_its_heap_frozen_for_the_teardown(tmp_path):
    """Before: the teardown's cyclic collections walked torch's whole heap (0.7-0.9 s of every exit here)."""
    said = tmp_path / "last.json"
    proc = run_cmd(
        [
            sys.executable,
            "-c",
            _LAST_WORD,
            str(TRAIN),
            str(said),
            "num_epochs=1",
            "limit_train_steps=1",
            "progress=none",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        timeout=120,
    )
    assert_ok(proc)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"
    # torch, its dynamo and Hydra hold far more than this many objects: the heap as a whole was frozen
    assert json.loads(said.read_text())["frozen"] > 100_000


def test_garbage_in_a_reference_cycle_is_still_finalized_at_exit(tmp_path):
    """The one collection before the freeze: an object that only a reference cycle holds still has its
    ``__del__`` run at exit, as in a plain interpreter (e.g. a user's writer that flushes there). Freezing
    alone never runs it: the file is never written."""
    out = tmp_path / "finalized.txt"
    code = textwrap.dedent(f"""
        from ddplab.runtime import teardown
        teardown.cheap_interpreter_exit()

        class Flusher:
            def __init__(self):
                self.me = self  # unreachable once made, alive only through its own cycle

            def __del__(self):
                with open({str(out)!r}, "w") as f:
                    f.write("x" * 1000)

        Flusher()
    """)
    assert_ok(run_cmd([sys.executable, "-c", code], tmp_path, timeout=60))
    assert out.read_text() == "x" * 1000


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("launcher", ["self", "torchrun"])
def test_every_rank_freezes_its_heap_at_exit_self_launched_or_under_torchrun(tmp_path, launcher):
    """A self-launched rank is a spawned process, not train.py: it makes its own exit cheap (before: only the
    launching process did; each rank's exit then took 0.7 s more)."""
    from helpers.jobs import python_train, torchrun

    args = [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=2",
        "progress=none",
        "+callbacks.freeze._target_=toy.NotesTheFreeze",
        f"+callbacks.freeze.dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = (
        python_train(args + ["distributed.nproc_per_node=2"], tmp_path, timeout=180)
        if launcher == "self"
        else torchrun(2, args, tmp_path, timeout=180)
    )
    assert_ok(proc)
    for rank in (0, 1):
        assert int((tmp_path / f"frozen-rank{rank}").read_text()) > 100_000, rank


@pytest.mark.slow
@pytest.mark.parametrize(
    "features",
    [
        [],
        ["optimizer=adamw", "amp=true", "grad_accum_steps=2", "callbacks=ema"],
        ["distributed.nproc_per_node=2", "distributed.comm_hook=fp16"],
    ],
    ids=["sgd", "adamw-amp-accum-ema", "ddp-x2"],
)
def test_a_job_that_compiles_nothing_never_imports_torchs_compiler(tmp_path, features):
    """torch's optimizers, manual_seed, FLOP counter and DDP's constructor import torch._dynamo at their first
    call: 2 s of CPU in every process (a 3-step job took 7.0 CPU-s, 4.6 without it and with bytecode; a
    self-launched 2-rank one's rank server imported it too). ``-X importtime`` lists every module each process
    imports, a rank server's too. (FSDP2's ranks import it anyway, for their fake tensors.)"""
    proc = run_cmd(
        [
            sys.executable,
            "-X",
            "importtime",
            str(TRAIN),
            "model=mlp",
            "max_steps=2",
            *features,
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        timeout=120,
    )
    assert_ok(proc)
    imported = re.findall(r"\|\s+(\S+)\s*$", proc.stderr, re.M)
    assert "torch.optim" in imported and "torch._dynamo" not in imported
