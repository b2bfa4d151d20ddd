"""Checkpoints, kill-and-resume, elastic restarts, and bad input (issue: nothing lost, nothing hangs)."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.compare import assert_same_checkpoint
from helpers.jobs import (
    assert_ok,
    compose_cfg,
    job_dirs,
    job_env,
    python_train,
    ranks,
    read_scalars,
    torchrun,
)

import ddplab

FAULTY = [
    "model=mlp",
    "model._target_=toy.FaultyMLP",
    "num_epochs=2",
    "checkpoint.every_n_steps=5",
    "log_every_n_steps=5",
    "progress=none",
]  # mlp has dropout: RNG state must be restored too


@pytest.fixture(autouse=True)
def fresh_faults():
    import toy

    toy._FAULTED.clear()  # in-process runs share toy's once-per-process fault memory


def final_state(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def steps_of(run_dir, tag="train/loss"):
    return [s for s, _ in read_scalars(run_dir / "tb")[tag]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    ddplab.run(compose_cfg(FAULTY + ["+model.fault_call=1000000"], run_dir=d))
    return d


# Checkpoints every 5 steps and at each epoch end (22 steps/epoch): each crash resumes from another one.
@pytest.mark.parametrize(
    "kill_at,resumed",
    [
        (8, "0 epoch(s), 5 step(s)"),  # mid-epoch 1
        # first step after the epoch edge
        (23, "1 epoch(s), 22 step(s)"),
        (38, "1 epoch(s), 35 step(s)"),
    ],
)  # mid-epoch 2
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
@pytest.mark.xdist_group("checkpoints_uninterrupted")  # the three cases on one worker: `uninterrupted` once
def test_in_process_crash_and_resume_is_bitwise_equal(tmp_path, uninterrupted, kill_at, resumed, caplog):
    args = FAULTY + [f"+model.fault_call={kill_at}", "+model.fault_rank=0"]
    with pytest.raises(RuntimeError, match="injected crash"):
        ddplab.run(compose_cfg(args, run_dir=tmp_path))
    assert (tmp_path / "result.json").read_text().count('"failed"') == 1
    caplog.clear()
    with caplog.at_level("INFO", logger="ddplab"):
        out = ddplab.run(compose_cfg(args + ["resume=auto"], run_dir=tmp_path))
    assert f"{resumed} done" in caplog.text
    assert out["step"] == 44
    assert_same_checkpoint(final_state(uninterrupted), final_state(tmp_path))
    # TensorBoard: every step once, and the same steps as the uninterrupted run.
    assert steps_of(tmp_path) == steps_of(uninterrupted)
    full = dict(read_scalars(uninterrupted / "tb")["train/loss"])
    for step, v in read_scalars(tmp_path / "tb")["train/loss"]:
        assert v == full[step]


# A rank SIGKILLed under torchrun --max-restarts, restarted and resumed bitwise with each step logged once: at
# 3 ranks in tests/test_resume_world_sizes.py (its 2-rank twin here checked nothing that one does not).


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_checkpoint_closes_the_log_interval_so_resume_loses_no_metrics(tmp_path):
    """Logs every 5 steps, checkpoints every 7: each checkpoint step logs too, so a run that crashes after
    a checkpoint and resumes has every interval's metrics once, equal to the uninterrupted run's."""
    args = [
        "model=mlp",
        "model._target_=toy.FaultyMLP",
        "num_epochs=1",
        "log_every_n_steps=5",
        "checkpoint.every_n_steps=7",
        "progress=none",
        "+model.fault_rank=0",
    ]
    ddplab.run(compose_cfg(args + ["+model.fault_call=1000000"], run_dir=tmp_path / "full"))
    assert steps_of(tmp_path / "full") == [5, 7, 10, 14, 15, 20, 21, 22]
    part = tmp_path / "part"
    with pytest.raises(RuntimeError, match="injected crash"):  # at step 12: steps 8-10 were logged, 11 not
        ddplab.run(compose_cfg(args + ["+model.fault_call=12"], run_dir=part))
    ddplab.run(compose_cfg(args + ["+model.fault_call=12", "resume=auto"], run_dir=part))  # from step 7
    full = read_scalars(tmp_path / "full" / "tb")["train/loss"]
    assert read_scalars(part / "tb")["train/loss"] == full  # same steps, same values, each once


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_checkpoint_rotation_keeps_last_k_and_best(tmp_path):
    ddplab.run(
        compose_cfg(
            [
                "model=mlp",
                "num_epochs=3",
                "checkpoint.every_n_steps=10",
                "checkpoint.keep_last=2",
                "progress=none",
            ],
            run_dir=tmp_path,
        )
    )
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.glob("step-*.pt")) == ["step-00000060.pt", "step-00000066.pt"]
    last, best = final_state(tmp_path), torch.load(ck / "best.pt", weights_only=True)
    assert last["loop"]["step"] == 66 and best["results"]["best"] == last["results"]["best"]
    assert best["results"]["last_val"]["val/acc"] == best["results"]["best"]
    # Full state is there: RNG per rank, sampler position, config.
    assert {"python", "numpy", "torch"} <= set(last["rng"]["ranks"][0]) and last["loop"]["sampler"][
        "seed"
    ] == 0
    assert "model:" in last["meta"]["config"] and last["meta"]["world_size"] == 1


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_writer_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    script = f"""
import os, torch
from pathlib import Path
from ddplab import checkpoint
d = Path({str(tmp_path)!r})
checkpoint.save({{"step": 1, "w": torch.ones(1000)}}, d, 1, keep_last=2, is_best=False)
real = torch.save
def dying_save(obj, f):
    f.write(b"PK\\x03\\x04 half a checkpoint")
    f.flush()
    os._exit(9)  # killed mid-write
torch.save = dying_save
checkpoint.save({{"step": 2, "w": torch.zeros(1000)}}, d, 2, keep_last=2, is_best=False)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], env=job_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 9
    ck = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ck["step"] == 1 and torch.equal(ck["w"], torch.ones(1000))
    assert list(tmp_path.glob(".step-00000002.pt.tmp*"))  # the half-written file never replaced anything


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_corrupt_last_checkpoint_falls_back_to_previous(tmp_path, caplog):
    args = ["model=mlp", "num_epochs=2", "checkpoint.every_n_steps=10", "progress=none"]
    ddplab.run(compose_cfg(args + ["stop_after_epochs=1"], run_dir=tmp_path))
    ck = tmp_path / "checkpoints"
    (ck / "last.pt").unlink()
    newest = sorted(ck.glob("step-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    bad = tmp_path / "bad.pt"
    bad.write_bytes(newest.read_bytes())  # (rotation will delete `newest` once training goes on)
    out = ddplab.run(compose_cfg(args + ["resume=auto"], run_dir=tmp_path))
    assert out["step"] == 44
    assert (
        f"cannot read checkpoint {newest}" in caplog.text and "trying the previous checkpoint" in caplog.text
    )
    with pytest.raises(RuntimeError, match=f"resume: cannot read checkpoint {bad} \\(truncated or corrupt"):
        ddplab.run(compose_cfg(args + [f"resume={bad}"], run_dir=tmp_path / "explicit"))


# ------------------------------------------------------------------ bad input
@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_checkpoint_of_another_model_lists_the_keys(tmp_path):
    ddplab.run(compose_cfg(["model=mlp", "num_epochs=1", "progress=none"], run_dir=tmp_path / "a"))
    ck = tmp_path / "a" / "checkpoints" / "last.pt"
    from ddplab.config import ConfigError  # exit 2 in one line, like any config that cannot work

    with pytest.raises(ConfigError) as e:
        ddplab.run(
            compose_cfg(
                ["model=mlp", "model.hidden=[128,256]", "num_epochs=1", f"resume={ck}"],
                run_dir=tmp_path / "b",
            )
        )
    msg = str(e.value)
    assert "does not fit this model" in msg and "net.1.weight: checkpoint (256, 64) vs model (128, 64)" in msg
    assert "Fix:" in msg
    with pytest.raises(
        ConfigError,
        match=rf"^resume={ck}: does not fit.*missing: features\.0\.weight.*unexpected: net\.1\.bias",
    ):
        ddplab.run(compose_cfg(["model=convnet", "num_epochs=1", f"resume={ck}"], run_dir=tmp_path / "c"))


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_nan_loss_stops_at_that_step_or_is_skipped(tmp_path):
    args = [
        "model=mlp",
        "model._target_=toy.FaultyMLP",
        "+model.fault=nonfinite",
        "+model.fault_call=7",
        "+model.fault_rank=0",
        "num_epochs=1",
        "log_every_n_steps=5",
        "progress=none",
    ]
    from ddplab.train.metrics import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"NaN/Inf at step 7 .*Fix: lower optimizer.lr"):
        ddplab.run(compose_cfg(args, run_dir=tmp_path / "stop"))
    import toy

    toy._FAULTED.clear()  # fault again in the skip run
    out = ddplab.run(compose_cfg(args + ["nonfinite_loss=skip"], run_dir=tmp_path / "skip"))
    s = read_scalars(tmp_path / "skip" / "tb")
    assert s["vitals/skipped_steps"][-1][1] == 1.0
    assert out["step"] == 21 and out["val/acc"] > 0.5  # 22 batches, one step skipped, weights intact


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_fp16_scaler_skips_are_counted_not_errors(tmp_path):
    """An Inf gradient (finite loss) at step 7: the GradScaler skips that one step and halves its scale;
    the run goes on and the skip is counted in the interval that holds it."""
    base = [
        "model=mlp",
        "num_epochs=1",
        "amp=true",
        "amp_dtype=float16",
        "log_every_n_steps=5",
        "progress=none",
    ]
    ddplab.run(compose_cfg(base, run_dir=tmp_path / "ref"))
    out = ddplab.run(
        compose_cfg(
            base
            + [
                "model._target_=toy.FaultyMLP",
                "+model.fault=infgrad",
                "+model.fault_call=7",
                "+model.fault_rank=0",
            ],
            run_dir=tmp_path / "inf",
        )
    )
    ref, s = read_scalars(tmp_path / "ref" / "tb"), read_scalars(tmp_path / "inf" / "tb")
    assert s["train/fp16_skipped_steps"] == [(5, 0.0), (10, 1.0), (15, 0.0), (20, 0.0), (22, 0.0)]
    assert [v for _, v in ref["train/fp16_skipped_steps"]] == [0.0] * 5  # no overflow of its own
    scale, ref_scale = dict(s["vitals/loss_scale"]), dict(ref["vitals/loss_scale"])
    assert scale[5] == ref_scale[5] == 65536.0 and scale[10] == ref_scale[10] / 2 == 32768.0
    assert out["step"] == 22 and math.isfinite(out["train/loss"])  # not an error: every step still counted


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu(tmp_path):
    from ddplab.config import ConfigError

    with pytest.raises(ConfigError, match=r"distributed.device=cuda but torch sees no CUDA GPU.*Fix:"):
        ddplab.run(compose_cfg(["distributed.device=cuda"], run_dir=tmp_path))


@pytest.mark.slow
def test_bad_input_exits_nonzero_with_a_message(tmp_path):
    proc = python_train(["resume=/nonexistent/last.pt"], tmp_path)
    assert proc.returncode != 0
    assert "resume=/nonexistent/last.pt: no checkpoint at /nonexistent/last.pt" in proc.stdout + proc.stderr


@pytest.mark.dist
def test_self_launched_job_restarts_after_a_killed_rank(tmp_path):
    proc = python_train(
        FAULTY
        + [
            "+model.fault_call=17",
            "+model.fault=kill",
            "+model.fault_rank=1",
            "distributed.nproc_per_node=2",
            "distributed.max_restarts=1",
        ],
        tmp_path,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "15 step(s) done" in out
    run = job_dirs(tmp_path)[0]
    assert final_state(run)["loop"]["step"] == 44
    assert steps_of(run) == [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]


@pytest.mark.dist
def test_mid_epoch_resume_on_another_world_size_warns_about_random_streams(tmp_path):
    args = [
        "model=mlp",
        "model._target_=toy.FaultyMLP",
        "num_epochs=1",
        "checkpoint.every_n_steps=5",
        "progress=log",
        "run_dir=run",
        "+model.fault_rank=0",
        "distributed.timeout_s=30",
    ]
    crashed = torchrun(2, args + ["+model.fault_call=8"], tmp_path)  # checkpoint at step 5, crash at 8
    assert crashed.returncode != 0 and "injected crash" in crashed.stdout + crashed.stderr
    # Switching the injected fault off changes a model key: a deliberate change, so the opt-in says so.
    proc = python_train(
        args + ["+model.fault_call=1000000", "resume=auto", "resume_apply_changes=true"], tmp_path
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "0 epoch(s), 5 step(s) done" in out
    assert "resuming mid-epoch on 1 rank(s) from a 2-rank checkpoint" in out and "draw new streams" in out
    assert final_state(tmp_path / "run")["loop"]["step"] == 22


@pytest.mark.dist
def test_resume_on_a_different_world_size(tmp_path):
    """Same global batch, same global order: a 2-rank run resumed on 1 rank continues the same training."""
    args = ["model=mlp", "model.dropout=0", "num_epochs=2", "progress=none"]
    full = tmp_path / "full"
    full.mkdir()
    assert_ok(ranks(2, args, full))
    part = tmp_path / "part"
    part.mkdir()
    assert_ok(ranks(2, args + ["stop_after_epochs=1", "run_dir=run"], part))
    assert_ok(python_train(args + ["resume=auto", "run_dir=run"], part))
    a, b = final_state(job_dirs(full)[0]), final_state(part / "run")
    diff = max(((a["model"][k] - b["model"][k]).norm() / a["model"][k].norm()).item() for k in a["model"])
    assert b["loop"]["step"] == 44 and diff <= 1e-5


def test_leftovers_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """Killed ranks leave scratch Hydra dirs, failed torchrun jobs leave restart memos: the next start removes
    those whose process is gone (a zombie, not yet reaped, is gone), and nothing of a live one."""
    import tempfile

    from ddplab import cli

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    # A zombie: dead, not yet reaped (a rank killed with its launcher, before init reaps it). Its pid is
    # taken.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
        time.sleep(0.01)
    alive = os.getpid()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = tmp_path / f"ddplab-{os.getuid()}"
    private.mkdir(mode=0o700)
    for pid in (dead.pid, zombie.pid, alive):
        (private / f"run-abc123-{pid}").write_text("/some/run/dir")
        (tmp_path / f"ddplab-rank1-{pid}-xyz").mkdir()
    cli._remove_orphans()
    zombie.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([private.name, f"ddplab-rank1-{alive}-xyz"])
    assert [p.name for p in private.iterdir()] == [f"run-abc123-{alive}"]


def test_restart_memo_lives_in_a_private_dir_and_never_follows_a_symlink(tmp_path, monkeypatch):
    """The temp dir is everyone's: the memo's directory must be this user's alone, or nothing is written."""
    import stat
    import tempfile

    from ddplab.runtime import env

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # plain torchrun's (predictable) run id
    private = tmp_path / f"ddplab-{os.getuid()}"
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    private.symlink_to(elsewhere)  # planted by someone else before the job started
    with pytest.raises(RuntimeError, match="is not a private directory of this user"):
        env.run_dir_memo()
    private.unlink()
    private.mkdir(mode=0o777)
    os.chmod(private, 0o777)  # open to others
    with pytest.raises(RuntimeError, match="is not a private directory"):
        env.run_dir_memo()
    private.rmdir()
    memo = env.run_dir_memo()  # created 0700 now
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and memo.parent == private
    (tmp_path / "target").write_text("precious")
    memo.symlink_to(tmp_path / "target")  # a symlink at the memo's name is replaced, not written through
    env.write_memo(memo, "/runs/a")
    assert (tmp_path / "target").read_text() == "precious" and env.read_memo(memo) == "/runs/a"
    assert stat.S_IMODE(memo.stat().st_mode) == 0o600 and not memo.is_symlink()


def test_a_component_joins_the_checkpoint_in_one_line_and_a_misfit_loads_nothing(tmp_path):
    from omegaconf import OmegaConf

    from ddplab.checkpoint import CheckpointManager
    from ddplab.config.schema import CheckpointConfig
    from ddplab.runtime.group import Dist

    class Counter:  # any object with state_dict/load_state_dict
        def __init__(self, n):
            self.n = n

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    class Picky(Counter):
        def check(self, ck, path):
            raise RuntimeError(f"resume: {path} does not suit Picky")

    policy = OmegaConf.structured(CheckpointConfig)  # every_n_steps 0, keep_last 2, save_best: the defaults

    def manager(ema, counter):
        m = CheckpointManager(tmp_path / "checkpoints", policy, Dist(), {"config": "x"})
        m.register("ema", ema)  # a module is Stateful as it is
        m.register("counter", counter)
        return m

    torch.manual_seed(0)
    saved_ema = torch.nn.Linear(3, 2)
    manager(saved_ema, Counter(7)).save(step=12, is_best=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best.pt",
        "last.pt",
        "save_seconds.json",
        "step-00000012.pt",
    ]
    ema, counter = torch.nn.Linear(3, 2), Counter(0)
    assert manager(ema, counter).resume("auto", tmp_path).name == "last.pt"
    assert counter.n == 7 and torch.equal(ema.weight, saved_ema.weight)

    fresh_ema, picky = torch.nn.Linear(3, 2), Picky(0)
    before = fresh_ema.weight.clone()
    with pytest.raises(RuntimeError, match="does not suit Picky"):
        manager(fresh_ema, picky).resume("auto", tmp_path)
    assert torch.equal(fresh_ema.weight, before) and picky.n == 0  # checked before anything was loaded
    with pytest.raises(ValueError, match="registered twice"):
        manager(ema, counter).register("ema", ema)


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_objective_must_be_a_logged_validation_metric_and_a_loss_is_minimised(tmp_path):
    from ddplab.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"objective='val/accuracy': ClassificationTask logs no such metric\. "
        r"Fix: objective= one of val/loss, val/acc",
    ):
        ddplab.run(
            compose_cfg(["model=mlp", "num_epochs=1", "objective=val/accuracy"], run_dir=tmp_path / "bad")
        )
    out = ddplab.run(
        compose_cfg(
            ["model=mlp", "num_epochs=3", "objective=val/loss", "progress=none"], run_dir=tmp_path / "loss"
        )
    )
    losses = [v for _, v in read_scalars(tmp_path / "loss" / "tb")["val/loss"]]
    assert len(set(losses)) == 3 and losses.index(min(losses)) != 0  # the first epoch is not the best
    # lower is better for a loss (TB: float32)
    assert out["val/loss_best"] == pytest.approx(min(losses), rel=1e-6)
    best = torch.load(tmp_path / "loss" / "checkpoints" / "best.pt", weights_only=True)
    assert best["results"]["last_val"]["val/loss"] == best["results"]["best"] == out["val/loss_best"]


@pytest.mark.slow
def test_a_run_dir_in_use_is_refused_at_once_naming_its_holder(tmp_path):
    import time

    from ddplab.rundir import RunDirLock, read_result

    run = tmp_path / "run"
    run.mkdir()
    held = RunDirLock(run)  # what a running job's rank 0 holds
    assert held.acquire() is None
    args = ["model=mlp", "num_epochs=1", "progress=none", f"run_dir={run}"]
    t0 = time.perf_counter()
    proc = python_train(args, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60
    assert f"run dir {run} is in use by pid {os.getpid()} on " in out and "Fix: give this job another" in out
    assert sorted(p.name for p in run.iterdir()) == [".ddplab.lock"]  # nothing of the holder's was touched
    held.release()
    assert_ok(python_train(args, tmp_path))
    assert read_result(run)["status"] == "completed" and not (run / ".ddplab.lock").exists()
