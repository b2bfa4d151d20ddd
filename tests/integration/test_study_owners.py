"""mode=study, who owns a trial: ownership lives in the storage (workers with different study.dirs on one
storage, a trial taken over only from a worker provably gone, deaths counted across preemptions, workers and
torchrun ranks), the training and reporting config a study records (a worker that would train or report
differently is refused), the claim lock, a full disk under a trial, and a hold that cannot be renewed. A
storage lost under a running worker: tests/integration/test_study_ownership.py; the study's course:
tests/integration/test_study.py."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from helpers.jobs import assert_ok, compose_cfg, python_train, tmpfs
from helpers.study import finish, start, study_args, trials_run

from ddplab.config import ConfigError
from ddplab.rundir import read_result

pytestmark = pytest.mark.dist


def open_url(url: str) -> optuna.Study:
    from ddplab.study.storage import open_storage

    return optuna.load_study(study_name="digits_lr_wd", storage=open_storage(url, 20))


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None and time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.1)


def tallied(tally: Path) -> dict[str, int]:
    """Optimizer steps trained per trial number (study_toy.TallySteps), over every worker."""
    from collections import Counter

    return dict(Counter(line.split()[0] for line in tally.read_text().splitlines()))


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_workers_with_different_dirs_on_one_storage_train_each_trial_once(tmp_path, kind):
    """Ownership lives in the storage: worker B, given another study.dir, sees worker A's trial alive and asks
    a new one instead of taking it over; each trial is trained once and told once."""
    url = f"journal:{tmp_path / 'study.log'}" if kind == "journal" else f"sqlite:///{tmp_path / 'study.db'}"
    held, go, tally = tmp_path / "held", tmp_path / "go", tmp_path / "tally"
    common = [
        f"study.storage={url}",
        "+callbacks.tally._target_=study_toy.TallySteps",
        f"+callbacks.tally.file={tally}",
    ]
    a = start(
        study_args(
            tmp_path / "a",
            2,
            *common,
            "+callbacks.hold._target_=study_toy.HoldAt",
            "+callbacks.hold.step=2",
            f"+callbacks.hold.held={held}",
            f"+callbacks.hold.go={go}",
        ),
        tmp_path,
    )
    wait_for(held, a)  # A is inside trial 0, alive
    b = python_train(study_args(tmp_path / "b", 2, *common), tmp_path)
    go.write_text("")
    a = finish(a)
    assert tallied(tally) == {"0": 8, "1": 8}, (tallied(tally), b.stdout[-3000:])  # 2 epochs x 4 steps, once
    assert trials_run(a) == [0] and trials_run(b) == [1], (trials_run(a), trials_run(b))
    assert_ok(a)
    assert_ok(b)
    assert [t.state.name for t in open_url(url).get_trials()] == ["COMPLETE"] * 2
    assert (
        read_result(tmp_path / "a" / "0")["trial"]["state"] == "COMPLETE"
        and not (tmp_path / "b" / "0").exists()
    )
    assert (
        read_result(tmp_path / "b" / "1")["trial"]["state"] == "COMPLETE"
        and not (tmp_path / "a" / "1").exists()
    )


@pytest.mark.parametrize("resumer", ["a", "b"])
def test_a_death_after_a_preemption_is_counted_and_the_trial_resumes_in_its_own_dir(tmp_path, resumer):
    """SIGTERM (a preemption: no death), then the resuming worker (given the same study.dir, or another) is
    SIGKILLed twice: with study.max_retries=1 the second death fails the trial, and each resume says what
    happened last, in the trial's own dir."""
    url, a, b = f"sqlite:///{tmp_path / 'study.db'}", tmp_path / "a", tmp_path / resumer
    faults = ["num_epochs=3", "checkpoint.every_n_steps=1", "study.max_retries=1", f"study.storage={url}"]
    for name, step, sig in (("term", 5, "SIGTERM"), ("k1", 7, "SIGKILL"), ("k2", 9, "SIGKILL")):
        faults += [
            f"+callbacks.{name}._target_=study_toy.SignalOnce",
            f"+callbacks.{name}.step={step}",
            f"+callbacks.{name}.sig={sig}",
            f"+callbacks.{name}.marker={tmp_path / name}",
        ]
    first = python_train(study_args(a, 1, *faults), tmp_path)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    stopped = read_result(a / "0")["step"]
    runs = [python_train(study_args(b, 1, *faults), tmp_path) for _ in range(3)]
    said = [p.stdout + p.stderr for p in runs]
    killed = json.loads((tmp_path / "k1").read_text())["pid"]
    assert [p.returncode for p in runs] == [-signal.SIGKILL, -signal.SIGKILL, 0], said[-1][-3000:]
    (t,) = open_url(url).get_trials()
    assert t.state.name == "FAIL" and t.user_attrs["ddplab:deaths"] == 2, (t.state, t.user_attrs)
    assert f"trial 0: resuming it in {a / '0'} (preempted at step {stopped}" in said[0], said[0][-3000:]
    assert f"trial 0: resuming it in {a / '0'} (its worker (pid {killed}" in said[1], said[1][-3000:]
    assert "died after step 6, its last checkpoint; death 1 of study.max_retries=1)" in said[1], said[1][
        -3000:
    ]
    assert "preempted" not in said[1] and "resuming it" not in said[2], said[2][-3000:]
    assert "died 2 times" in t.user_attrs["error"] and "died after step 8" in t.user_attrs["error"]
    assert read_result(a / "0")["trial"]["state"] == "FAIL" and (b == a or not (b / "0").exists())


def test_a_worker_that_would_train_trials_differently_is_refused(tmp_path):
    """The study records the training config outside its space (config.drift's trajectory keys): a worker
    whose trials would train differently is refused before it asks; harmless keys may differ."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert_ok(python_train(study_args(tmp_path / "a", 1, f"study.storage={url}", "num_epochs=1"), tmp_path))
    other = python_train(
        study_args(tmp_path / "b", 2, f"study.storage={url}", "num_epochs=4", "model.hidden=[32]"), tmp_path
    )
    said = other.stdout + other.stderr
    errors = [line for line in said.splitlines() if "error" in line.lower()]
    assert other.returncode == 2 and len(errors) == 1 and "Traceback" not in said, said[-3000:]
    assert f"study.name=digits_lr_wd in {url} trains its trials with another config:" in errors[0], errors
    assert (
        "model.hidden: [256, 256] in the study, [32] here; num_epochs: 1 in the study, 4 here" in errors[0]
    ), errors
    assert len(open_url(url).get_trials()) == 1 and not (tmp_path / "b" / "0").exists()
    same = python_train(
        study_args(tmp_path / "c", 2, f"study.storage={url}", "num_epochs=1", "log_every_n_steps=3"), tmp_path
    )
    assert_ok(same)
    assert trials_run(same) == [1] and [t.state.name for t in open_url(url).get_trials()] == ["COMPLETE"] * 2


def test_the_training_record_keeps_keys_that_only_start_like_a_harmless_one():
    """`model.*` starts like the harmless `mode`: it still decides how a trial trains (and a resume's
    drift)."""
    from ddplab.config.drift import trajectory
    from ddplab.study.storage import training

    cfg = compose_cfg(["hparams_search=study", "model=mlp", "model.hidden=[32]"])
    assert trajectory(cfg)["model.hidden"] == [32] and "mode" not in trajectory(cfg)
    trains = training(cfg, {"optimizer.lr": None, "model": None})
    assert (
        "optimizer.lr" not in trains
        and not any(k.startswith("model") for k in trains)
        and "num_epochs" in trains
    )


def test_a_trial_is_taken_over_only_from_a_worker_provably_gone():
    """The takeover verdict on an owner record: alive here (this process), dead here (a pid that has exited),
    elsewhere within its lease or past it, and a preemption (free, no death)."""
    from ddplab.study.owner import LEASE_S, me, verdict

    now = time.time()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    here, dead = me(), {**me(), "pid": int(gone.stdout), "started": "1"}
    away = {**me(), "machine": "node9 boot x pidns 1", "host": "node9", "pid": 4121}
    seen = {
        name: (v.free, v.death)
        for name, v in [
            ("alive here", verdict(here, now)),
            ("dead here", verdict(dead, now)),
            ("away, beating", verdict({**away, "beat": now - LEASE_S / 2}, now)),
            ("away, silent", verdict({**away, "beat": now - LEASE_S - 5}, now)),
            ("preempted", verdict({**here, "left": "preempted", "step": 24, "signal": "SIGTERM"}, now)),
        ]
    }
    assert seen == {
        "alive here": (False, False),
        "dead here": (True, True),
        "away, beating": (False, False),
        "away, silent": (True, True),
        "preempted": (True, False),
    }, seen
    assert "silent for 65s > lease 60s) died" in verdict({**away, "beat": now - LEASE_S - 5}, now).why


def test_a_claim_lock_that_cannot_be_opened_is_refused_not_skipped(tmp_path):
    """Claiming without the storage's lock would let two workers take one trial: only a missing dir (which
    opening the storage then says) goes on; any other failure to open the lock is one line naming it."""
    from ddplab.config import ConfigError
    from ddplab.study.owner import claim_lock

    (tmp_path / "a_file").write_text("")
    url = f"journal:{tmp_path / 'a_file' / 'journal.log'}"  # its 'dir' is a file: ENOTDIR, not ENOENT
    with pytest.raises(ConfigError, match=rf"^study.storage={url}: cannot open its claim lock .*Fix: make "):
        with claim_lock(url, 5.0, tmp_path):
            pass
    with claim_lock(f"journal:{tmp_path / 'nowhere' / 'journal.log'}", 5.0, tmp_path):
        pass  # no such dir: left to opening the storage, which says it in one line


def test_a_full_disk_under_a_trial_leaves_it_running_and_a_later_worker_resumes_it_with_no_death(tmp_path):
    """A full disk is the machine's fault: the trial was told FAIL (a traceback, exit 1) and the study went on
    to meet the same disk with every next trial. Now: one line, the trial stays RUNNING (let go, like a
    preempted one), the worker stops; with room again, the next worker resumes it and counts no death."""
    (tmp_path / "db").mkdir()
    url = f"sqlite:///{tmp_path / 'db' / 'study.db'}"
    with tmpfs(tmp_path / "disk", "size=600k") as disk:  # the trials' dirs: room for logs, not a checkpoint
        d = disk / "s"
        proc = python_train(study_args(d, 2, f"study.storage={url}"), tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
        assert "CheckpointWriteError: could not write checkpoint" in out and "No space left on device" in out
        assert trials_run(proc) == [0]
        store = optuna.storages.RDBStorage(url)
        [t0] = optuna.load_study(study_name="digits_lr_wd", storage=store).get_trials()
        store.engine.dispose()
        assert t0.state.name == "RUNNING" and t0.user_attrs["ddplab:owner"]["left"] == "preempted", (
            t0.user_attrs
        )
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # room again
        again = python_train(study_args(d, 2, f"study.storage={url}"), tmp_path)
        assert_ok(again)
        store = optuna.storages.RDBStorage(url)
        trials = optuna.load_study(study_name="digits_lr_wd", storage=store).get_trials()
        store.engine.dispose()
        assert [t.state.name for t in trials] == ["COMPLETE"] * 2
        assert trials[0].user_attrs.get("ddplab:deaths", 0) == 0 and trials_run(again) == [0, 1]


def test_a_rank_killed_under_a_torchrun_worker_is_a_death_not_a_failed_trial(tmp_path):
    """Rank 1 of a trial SIGKILLed under torchrun (the soak's seed 1126: trials 2011857053, 1546929989): rank
    0, which asks and tells, saw only a lost connection and told the trial FAIL with gloo's "Connection reset
    by peer". It is the trial's death: rank 0 says so in one line, the trial stays RUNNING, and the next
    worker resumes it from its checkpoint, counting one death."""
    from helpers.jobs import torchrun

    d, url = tmp_path / "s", f"sqlite:///{tmp_path / 's' / 'study.db'}"
    kill = [
        "+callbacks.kill._target_=study_toy.KillRankOnce",
        "+callbacks.kill.rank=1",
        "+callbacks.kill.step=6",
        f"+callbacks.kill.marker={tmp_path / 'killed'}",
        "checkpoint.every_n_steps=2",
    ]
    proc = torchrun(2, study_args(d, 2, *kill), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and (tmp_path / "killed").exists(), out[-3000:]
    said = [ln for ln in out.splitlines() if "lost its connection to a rank that said nothing" in ln]
    assert len(said) == 1 and "rank 0/2 stopped in epoch 2, step 7" in said[0], out[-3000:]
    # no traceback but torchrun's own report of the failed job
    assert all("torch/distributed/run.py" in block[:800] for block in out.split("Traceback")[1:]), out[-3000:]
    store = optuna.storages.RDBStorage(url)
    [t0] = optuna.load_study(study_name="digits_lr_wd", storage=store).get_trials()
    store.engine.dispose()
    assert t0.state.name == "RUNNING", t0
    # The trial's record says how its job ended (ddplab.failure): the death, as rank 0 said it.
    record = read_result(d / "0")
    assert record["status"] == "failed" and record["error"] == said[0].split("ERROR: ", 1)[1], record
    again = torchrun(2, study_args(d, 2, "checkpoint.every_n_steps=2"), tmp_path)
    assert_ok(again)
    store = optuna.storages.RDBStorage(url)
    trials = optuna.load_study(study_name="digits_lr_wd", storage=store).get_trials()
    store.engine.dispose()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2 and trials[0].user_attrs["ddplab:deaths"] == 1
    assert "trial 0: resuming it in" in again.stdout + again.stderr


@pytest.mark.parametrize(
    "override, said",
    [
        ("eval_every_n_steps=5", "eval_every_n_steps: 0 in the study, 5 here"),
        ("limit_val_batches=2", "limit_val_batches: None in the study, 2 here"),
        ("callbacks=[ema]", "callbacks.ema.decay: '<absent>' in the study, 0.999 here"),
        (
            "distributed.nproc_per_node=2",
            "(per-rank batch): 64 in the study, 32 here",
        ),  # batch 64 split in two
    ],
)
def test_a_worker_whose_trials_would_report_differently_is_refused_before_it_asks(tmp_path, override, said):
    """Issue 45: eval_every_n_steps was harmless to the study's record, so such a worker reported at optimizer
    steps 1, 2 to a pruner comparing them with the other trials' epochs 1, 2. Whatever changes what a trial
    reports (cadence, evaluation size, callbacks, the per-rank batch) is the study's identity too."""
    from ddplab import study

    url = f"sqlite:///{tmp_path / 'study.db'}"
    base = ["hparams_search=study", "model=mlp", f"study.storage={url}", f"study.dir={tmp_path / 's'}"]
    study.setup(compose_cfg(base))
    # harmless keys still may differ
    study.setup(compose_cfg(base + ["progress=none", "log_every_n_steps=3"]))
    study.setup(compose_cfg(base + ["+callbacks.mine._target_=toy.Recorder"]))  # a worker's own callback too
    with pytest.raises(ConfigError, match=r"trains its trials with another config: .*" + re.escape(said)):
        study.setup(compose_cfg(base + [override]))


def test_a_hold_that_cannot_be_renewed_names_the_databases_error_not_optunas_wrapper(monkeypatch, caplog):
    """CI (test above, ``deleted``, 2 ranks): the worker's renewal met the storage as it went away, and its
    warning gave Optuna's wrapper, "invalid data in the commit, e.g. exceeding max length", for a read-only
    database."""
    import sqlite3

    import sqlalchemy.exc

    from ddplab.study import owner

    def lost() -> None:
        try:
            try:
                raise sqlite3.OperationalError("attempt to write a readonly database")
            except sqlite3.OperationalError as e:
                raise sqlalchemy.exc.OperationalError("UPDATE trial_user_attributes", {}, e) from e
        except sqlalchemy.exc.SQLAlchemyError as e:
            raise optuna.exceptions.StorageInternalError(
                "An exception is raised during the commit. This typically happens due to invalid data in the "
                "commit, e.g. exceeding max length."
            ) from e

    class Trial:
        number, calls = 0, 0

        def set_user_attr(self, key, value):
            self.calls += 1
            if self.calls > 1:  # the claim is written; every renewal after it fails
                lost()

    monkeypatch.setattr(owner, "BEAT_S", 0.01)
    caplog.set_level("WARNING", logger="ddplab")
    trial = Trial()
    hold = owner.Hold(trial).start()
    t0 = time.monotonic()
    while trial.calls < 4 and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    hold.release()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "trial 0: could not renew this worker's hold in the storage (OperationalError: attempt to "
        "write a readonly database); retrying"
    ], said  # once, however many renewals fail
