"""mode=study, a study's course: Optuna studies run by ddplab workers — real processes sharing a SQLite
storage, trials that are normal runs, pruning agreed by every rank, preemption and death of a worker, a
finished study restarted. Other storages and input refused:
tests/integration/test_study_storages_and_input.py; who owns a trial: tests/integration/test_study_owners.py;
a storage lost: tests/integration/test_study_ownership.py."""

import json
import signal
import time
from pathlib import Path

import pytest
from helpers.jobs import assert_ok, python_train, read_scalars, torchrun
from helpers.study import assert_told_as_recorded, finish, load, start, study_args, trials_run

from ddplab.events import read_hparams
from ddplab.rundir import read_result

pytestmark = pytest.mark.dist


def test_two_workers_one_rank_each_complete_a_study(tmp_path):
    d = tmp_path / "s"
    workers = [start(study_args(d, 4), tmp_path) for _ in range(2)]
    done = [finish(p) for p in workers]
    for p in done:
        assert_ok(p)
    study = load(d)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 4
    ran = trials_run(done[0]) + trials_run(done[1])
    assert sorted(ran) == [0, 1, 2, 3], ran  # every trial trained once, by one worker
    assert_told_as_recorded(d, study)
    # a normal run: events named after its params, one HParams row with its state
    for t in study.get_trials():
        tdir = d / str(t.number)
        hp = read_hparams(tdir)
        assert hp["trial"] == t.number and hp["trial_state"] == "COMPLETE"
        assert hp["optimizer.lr"] == pytest.approx(t.params["optimizer.lr"])
        assert read_scalars(tdir)["val/acc"][-1][1] == pytest.approx(t.value, abs=1e-6)
        assert any(p.name.startswith("lr=") for p in tdir.iterdir()), list(tdir.iterdir())
    table = (d / "summary.md").read_text()
    best = study.best_trial
    assert f"4 of 4 trials (4 complete); best: trial {best.number}, val/acc={best.value:.6g}" in table
    assert len((d / "summary.csv").read_text().splitlines()) == 5


@pytest.mark.parametrize("launch", ["self-launch", "torchrun"])
def test_one_worker_two_ranks_completes_a_study_and_pruning_stops_every_rank_at_once(tmp_path, launch):
    d, ends = tmp_path / "s", tmp_path / "ends"
    # Trial 0 runs 3 epochs; trial 1 is pruned after its epoch 1 (the pruner's decision, known in advance).
    args = study_args(
        d,
        2,
        "num_epochs=3",
        "++study.pruner={_target_:study_toy.PruneFrom,trial:1,epoch:1}",
        "+callbacks.ends._target_=study_toy.RecordFitEnd",
        f"+callbacks.ends.dir={ends}",
    )
    if launch == "torchrun":  # both ranks run the worker: rank 0 asks and tells, rank 1 trains what it picked
        proc = torchrun(2, args, tmp_path)
    else:  # one worker process, each trial self-launched on 2 ranks
        proc = python_train(args + ["distributed.nproc_per_node=2"], tmp_path)
    assert_ok(proc)
    study = load(d)
    t0, t1 = study.get_trials()
    assert (t0.state.name, t1.state.name) == ("COMPLETE", "PRUNED")
    assert sorted(t1.intermediate_values) == [1] and sorted(t0.intermediate_values) == [1, 2, 3]
    # Both ranks of each trial ended at the same step: 3 epochs x 4 steps, and 1 x 4 for the pruned one.
    for name, step, epoch in (("0", 12, 3), ("1", 4, 1)):
        seen = [json.loads((ends / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        assert [(s["step"], s["epoch"]) for s in seen] == [(step, epoch)] * 2, seen
        assert seen[0]["pid"] != seen[1]["pid"]
    res = read_result(d / "1")
    assert res["trial"]["state"] == "PRUNED" and res["note"].startswith(
        "pruned by the study's pruner at epoch 1"
    )
    assert res["metrics"]["step"] == 4
    assert_told_as_recorded(d, study)
    assert read_hparams(d / "1")["trial_state"] == "PRUNED" and read_hparams(d / "0")["world_size"] == 2
    assert "1 pruned" in (d / "summary.md").read_text()


def test_a_preempted_worker_resumes_the_same_trial_and_tells_it_once(tmp_path):
    d, ref, marker = tmp_path / "s", tmp_path / "ref", tmp_path / "fired"

    def preempting(marker: Path) -> list[str]:  # SIGTERM to the worker after step 5 (of 12), once
        return [
            "+callbacks.stop._target_=study_toy.SignalOnce",
            "+callbacks.stop.step=5",
            "+callbacks.stop.sig=SIGTERM",
            f"+callbacks.stop.marker={marker}",
            "num_epochs=3",
        ]

    preempt = preempting(marker)
    first = python_train(study_args(d, 2, *preempt), tmp_path)
    assert first.returncode != 0 and marker.exists(), first.stderr[-2000:]
    study = load(d)
    assert [t.state.name for t in study.get_trials()] == ["RUNNING"]
    assert read_result(d / "0")["status"] == "preempted"
    again = python_train(study_args(d, 2, *preempt), tmp_path)  # the same command: the worker comes back
    assert_ok(again)
    assert f"trial 0: resuming it in {d / '0'} (preempted at step" in again.stdout + again.stderr
    study = load(d)
    assert [(t.number, t.state.name) for t in study.get_trials()] == [(0, "COMPLETE"), (1, "COMPLETE")]
    assert_told_as_recorded(d, study)
    # Resumed exactly: the same trial of the same study, never interrupted, ends with the same value.
    (tmp_path / "ref_marker").write_text("{}")
    whole = python_train(study_args(ref, 1, *preempting(tmp_path / "ref_marker")), tmp_path)
    assert_ok(whole)
    t_ref = load(ref).get_trials()[0]
    assert t_ref.params == study.get_trials()[0].params
    assert t_ref.value == study.get_trials()[0].value
    assert t_ref.intermediate_values == study.get_trials()[0].intermediate_values


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_signal_as_a_trial_completes_ends_the_worker_after_telling_it(tmp_path, ranks):
    """SIGTERM after the trial's last stop check (its fit has ended): the trial completes and is told, and the
    worker takes no further trial (it exits as preempted); started again, it goes on with the next one.
    2 ranks: the worker self-launches each trial and the signal reaches every process of the job (found by the
    soak, seed 1305676954: torch's launch agent took the worker's SIGTERM, the trial completed, and the worker
    claimed and trained the next trial, exiting a minute after the signal)."""
    d, marker = tmp_path / "s", tmp_path / "fired"
    args = study_args(
        d,
        3,
        "+callbacks.late._target_=study_toy.SignalAtFitEnd",
        "+callbacks.late.sig=SIGTERM",
        f"+callbacks.late.marker={marker}",
        *(["+callbacks.late.to=job", f"distributed.nproc_per_node={ranks}"] if ranks > 1 else []),
    )
    first = python_train(args, tmp_path)
    assert first.returncode == 128 + signal.SIGTERM and marker.exists(), (
        first.stdout[-3000:] + first.stderr[-2000:]
    )
    assert "SIGTERM arrived between trials: this worker takes no further trial" in first.stdout + first.stderr
    assert [t.state.name for t in load(d).get_trials()] == ["COMPLETE"]
    # started again, it goes on as at 1 rank (seconds of self-launched trials that show nothing new)
    if ranks > 1:
        return
    again = python_train(args, tmp_path)
    assert_ok(again)
    assert trials_run(again) == [1, 2]
    assert [t.state.name for t in load(d).get_trials()] == ["COMPLETE"] * 3
    assert_told_as_recorded(d, load(d))


def test_sigterm_to_a_worker_with_slow_steps_on_two_ranks_stops_within_a_step_and_resumes(tmp_path):
    """1.5 s steps, a 2-rank trial self-launched by the worker, log steps rarer than the run: SIGTERM from
    outside to the worker, at whatever point of a step it lands, checkpoints within about a step; the trial
    stays RUNNING (a preemption, not a death) and the worker started again completes it, told once."""
    d, trace = tmp_path / "s", tmp_path / "trace"
    args = study_args(
        d,
        1,
        "model._target_=toy.SlowMLP",
        "+model.delay_s=1.5",
        f"+model.trace={trace}",
        "num_epochs=1",
        "limit_train_steps=6",
        "log_every_n_steps=50",
        "distributed.nproc_per_node=2",
    )
    worker = start(args, tmp_path)
    t0 = time.monotonic()
    while not (trace.exists() and len(trace.read_text().split()) >= 4) and time.monotonic() - t0 < 120:
        time.sleep(0.1)  # rank 0 is in its second training forward
    time.sleep(0.7)
    signalled = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    first = finish(worker)
    took = time.monotonic() - signalled
    assert first.returncode == 128 + signal.SIGTERM, first.stdout[-3000:] + first.stderr[-3000:]
    assert took < 2 * 1.5 + 15, took  # at most the step under way and the next, plus checkpoint and exit
    res = read_result(d / "0")
    assert res["status"] == "preempted" and 1 <= res["step"] <= 3, res
    (t,) = load(d).get_trials()
    assert t.state.name == "RUNNING" and "ddplab:deaths" not in t.user_attrs
    again = python_train(args, tmp_path)
    assert_ok(again)
    (t,) = load(d).get_trials()
    assert t.state.name == "COMPLETE" and read_result(d / "0")["metrics"]["step"] == 6
    assert "ddplab:deaths" not in t.user_attrs
    assert_told_as_recorded(d, load(d))


@pytest.mark.parametrize("max_retries,state", [(2, "COMPLETE"), (0, "FAIL")])
def test_a_sigkilled_worker_leaves_no_trial_running(tmp_path, max_retries, state):
    d, marker = tmp_path / "s", tmp_path / "fired"
    kill = [
        "+callbacks.kill._target_=study_toy.SignalOnce",
        "+callbacks.kill.step=5",
        "+callbacks.kill.sig=SIGKILL",
        f"+callbacks.kill.marker={marker}",
        "num_epochs=3",
        "checkpoint.every_n_steps=2",
        f"study.max_retries={max_retries}",
    ]
    first = python_train(study_args(d, 1, *kill), tmp_path)
    assert first.returncode == -signal.SIGKILL and marker.exists()
    assert [t.state.name for t in load(d).get_trials()] == ["RUNNING"]
    again = python_train(study_args(d, 1, *kill), tmp_path)
    assert_ok(again)
    (t,) = load(d).get_trials()
    assert t.state.name == state and t.user_attrs["ddplab:deaths"] == 1
    if state == "COMPLETE":  # resumed from its step-4 checkpoint, not from scratch
        assert (
            "died after step 4, its last checkpoint; death 1 of study.max_retries=2)"
            in again.stdout + again.stderr
        )
        assert read_result(d / "0")["metrics"]["step"] == 12
        assert "resumed from" in (d / "0" / "train.log").read_text()
    else:
        assert "died 1 times" in t.user_attrs["error"] and read_result(d / "0")["trial"]["state"] == "FAIL"


def test_restarting_a_finished_study_continues_it(tmp_path):
    d = tmp_path / "s"
    assert_ok(python_train(study_args(d, 2), tmp_path))
    first = [(t.number, t.params, t.value) for t in load(d).get_trials()]
    same = python_train(study_args(d, 2), tmp_path)  # nothing left to do: no trial added
    assert_ok(same)
    assert trials_run(same) == [] and len(load(d).get_trials()) == 2
    more = python_train(study_args(d, 3), tmp_path)  # a larger budget: one more trial, the first two kept
    assert_ok(more)
    assert trials_run(more) == [2]
    trials = load(d).get_trials()
    assert [(t.number, t.params, t.value) for t in trials[:2]] == first and trials[2].state.name == "COMPLETE"
