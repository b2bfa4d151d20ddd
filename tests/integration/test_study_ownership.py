"""mode=study, a storage lost under a running worker (its SQLite file on a full disk, made read-only or
deleted): one line and no trial left silently running, a self-launched trial's rank included; under torchrun
rank 0 alone says it and every rank stops. Who owns a trial: tests/integration/test_study_owners.py."""

import contextlib
import subprocess
from pathlib import Path

import optuna
import pytest
from helpers.jobs import assert_ok, python_train, tmpfs
from helpers.study import study_args, trials_run

from ddplab.study.storage import STORAGE_EXIT

pytestmark = pytest.mark.dist


@contextlib.contextmanager
def storage_dir(tmp_path: Path, how: str):
    """Where the study's SQLite file lives: a 600 KiB tmpfs to fill, or a dir made immutable (undone
    after)."""
    if how == "full":
        with tmpfs(tmp_path / "disk", "size=600k") as disk:
            yield disk
        return
    (tmp_path / "db").mkdir()
    try:
        yield tmp_path / "db"
    finally:
        subprocess.run(
            ["chattr", "-i", *map(str, [tmp_path / "db", *(tmp_path / "db").iterdir()])], capture_output=True
        )


@pytest.mark.parametrize(
    "how,cause,ranks",
    [
        ("full", "database or disk is full", 1),
        ("readonly", "unable to open database file", 1),
        ("deleted", "attempt to write a readonly database", 1),
        ("deleted", "attempt to write a readonly database", 2),
    ],
)
def test_a_storage_lost_under_a_running_worker_is_one_line_and_no_trial_silently_running(
    tmp_path, how, cause, ranks
):
    """``ranks=2``: a self-launched trial whose rank meets the lost storage (the soak's seed 1126, trial
    1455560038): torch's agent logged the rank's StorageLost traceback; the rank says it in one line now."""
    d = tmp_path / "s"
    with storage_dir(tmp_path, how) as where:
        db = where / "study.db"
        url = f"sqlite:///{db}"
        args = study_args(
            d,
            2,
            f"study.storage={url}",
            "+callbacks.brk._target_=study_toy.BreakStorage",
            "+callbacks.brk.step=2",
            f"+callbacks.brk.how={how}",
            f"+callbacks.brk.db={db}",
            f"distributed.nproc_per_node={ranks}",
        )
        proc = python_train(args, tmp_path)
        said = proc.stdout + proc.stderr
        assert proc.returncode == STORAGE_EXIT, said[-3000:]
        assert "Traceback" not in said and "exceeding max length" not in said, said[-3000:]
        errors = [line for line in said.splitlines() if "ERROR: study.storage=" in line]  # the worker's line
        assert len(errors) == 1, said[-3000:]
        assert f"study.storage={url}: it failed under this worker (OperationalError: " in errors[0], errors
        assert (
            cause in errors[0]
            and "trial 0 stays RUNNING in the study: the storage cannot be written" in errors[0]
        )
        assert trials_run(proc) == [0]  # no trial asked after the storage failed
        if how == "full":  # space again: the study is as the line says, and a worker finishes it
            (where / "filler").unlink()
            assert states(url) == ["RUNNING"]
            again = python_train(study_args(d, 2, f"study.storage={url}"), tmp_path)
            assert_ok(again)
            assert states(url) == ["COMPLETE"] * 2


def test_a_storage_lost_under_a_torchrun_worker_is_said_once_by_rank_zero(tmp_path):
    """Under torchrun rank 0 alone tells the storage, after a trial, while its peer already waits for the next
    one: the tell's StorageLost ended rank 0, and torchrun then SIGTERMed the waiting peer, which said so (and
    printed its traceback). The tell is part of the ranks' next agreement now: every rank stops, rank 0 says
    why."""
    from helpers.jobs import torchrun

    d = tmp_path / "s"
    db = d / "study.db"
    proc = torchrun(
        2,
        study_args(
            d,
            2,
            "+callbacks.brk._target_=study_toy.BreakStorage",
            "+callbacks.brk.step=-1",
            "+callbacks.brk.how=deleted",
            f"+callbacks.brk.db={db}",
        ),
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {STORAGE_EXIT}" in out, out[-3000:]
    errors = [line for line in out.splitlines() if "ERROR: study.storage=" in line]
    assert (
        len(errors) == 1 and "trial 0 stays RUNNING in the study: the storage cannot be written" in errors[0]
    ), out[-3000:]
    assert "[rank 1]" not in out and "Connection closed" not in out, out[-3000:]  # the peer said nothing
    # no traceback but torchrun's own report of the failed job
    assert all("torch/distributed/run.py" in block[:800] for block in out.split("Traceback")[1:]), out[-3000:]
    assert trials_run(proc) == [0]


def states(url: str) -> list[str]:
    """The trials' states, the database closed after (a tmpfs holding it can then be unmounted)."""
    store = optuna.storages.RDBStorage(url)
    try:
        return [
            t.state.name for t in optuna.load_study(study_name="digits_lr_wd", storage=store).get_trials()
        ]
    finally:
        store.engine.dispose()
