"""mode=study's storages and input: two worker processes sharing the journal file and PostgreSQL; bad input (a
storage that cannot be opened among it) is one line within seconds, a study name reused with another space is
refused, the space's grammar is the Hydra Optuna sweeper's, a study.dir with a space, a hash and a question
mark works, and a trial that cannot be composed is told FAIL. The study's course:
tests/integration/test_study.py."""

import shlex
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from helpers.jobs import assert_ok, compose_cfg, python_train
from helpers.study import assert_told_as_recorded, finish, load, start, study_args, trials_run

from ddplab.rundir import read_result
from ddplab.study.storage import default_url

pytestmark = pytest.mark.dist


def test_journal_storage_with_two_worker_processes(tmp_path):
    d, journal = tmp_path / "s", tmp_path / "study.log"
    args = study_args(d, 2, f"study.storage=journal:{journal}", "num_epochs=1")
    done = [finish(p) for p in [start(args, tmp_path) for _ in range(2)]]
    for p in done:
        assert_ok(p)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    study = optuna.load_study(
        study_name="digits_lr_wd", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 2
    assert sorted(trials_run(done[0]) + trials_run(done[1])) == [0, 1]


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL server on loopback for this module (trust auth, a fresh data dir), stopped
    after."""
    import os
    import shutil
    import socket
    import tempfile

    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not bins or os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip(
            "no PostgreSQL server here (apt-get install postgresql; the server runs as user postgres)"
        )
    pg = bins[-1].parent
    root = Path(tempfile.mkdtemp(prefix="ddplab-pg-"))
    shutil.chown(root, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def as_postgres(*cmd: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=True, capture_output=True, timeout=60)

    as_postgres(str(pg / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres")
    as_postgres(
        str(pg / "pg_ctl"),
        "-D",
        str(root / "data"),
        "-l",
        str(root / "log"),
        "-w",
        "-o",
        f"-h 127.0.0.1 -p {port} -k {root}",
        "start",
    )
    try:
        as_postgres(str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "optuna")
        yield f"postgresql://postgres@127.0.0.1:{port}/optuna"
    finally:
        as_postgres(str(pg / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_postgresql_storage_with_two_worker_processes(tmp_path, postgres):
    d = tmp_path / "s"
    args = study_args(d, 3, f"study.storage={postgres}", "num_epochs=1")
    done = [finish(p) for p in [start(args, tmp_path) for _ in range(2)]]
    for p in done:
        assert_ok(p)
    study = load(d, url=postgres)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 3
    assert sorted(trials_run(done[0]) + trials_run(done[1])) == [0, 1, 2]
    assert_told_as_recorded(d, study)


@pytest.mark.parametrize(
    "override,says",
    [
        (
            "study.params={optimizer.lr:'between(1,2)'}",
            "study.params.optimizer.lr='between(1,2)': not a search expression",
        ),
        ("study.params={optimizer.lr:'tag(sqrt,interval(0.1,1))'}", "unknown tag 'sqrt'"),
        (
            "study.params={optimizer.lr:0.1}",
            "a fixed value, not a search expression. Fix: set it as a plain override",
        ),
        ("++study.params={optimiser.lr:'interval(0.1,1)'}", "'optimiser.lr' is not a config key"),
        ("objective=val/f1", "objective='val/f1': ClassificationTask logs no such metric"),
        (
            "study.storage=sqlite:////nonexistent/dir/study.db",
            "study.storage=sqlite:////nonexistent/dir/study.db: cannot open it",
        ),
        (
            "study.storage=journal:/nonexistent/dir/s.log",
            "cannot open it (FileNotFoundError: no directory /nonexistent/dir)",
        ),
        # a URI's user info is masked in what ddplab says (a token is often the user part): docs/security.md
        (
            "study.storage=postgresql://ddplab@127.0.0.1:9/none",
            "study.storage=postgresql://***@127.0.0.1:9/none",
        ),
        (
            "study.params={optimizer.lr:'interval(0.9,0.1)'}",
            "study.params.optimizer.lr='interval(0.9,0.1)': its low 0.9 is above its high 0.1. Fix: "
            "interval(0.1, 0.9)",
        ),
        (
            "study.params={optimizer.lr:'tag(log,interval(0.5,0.1))'}",
            "its low 0.5 is above its high 0.1. Fix: tag(log, ",
        ),
        (
            "++study.params={num_epochs:'tag(int,interval(0.5,0.9))'}",
            "study.params.num_epochs='tag(int,interval(0.5,0.9))': no integer lies in [0.5, 0.9]. Fix: ",
        ),
        (
            "++study.params={num_epochs:'range(5,1)'}",
            "study.params.num_epochs='range(5,1)': it yields no value. Fix: ",
        ),
        (
            "++study.params={num_epochs:'range(1,5,0)'}",
            "study.params.num_epochs='range(1,5,0)': not a usable search ",
        ),
    ],
)
def test_bad_input_is_one_line_within_seconds(tmp_path, override, says):
    t0 = time.monotonic()
    proc = python_train(study_args(tmp_path / "s", 2, override), tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and says in errors[0], errors
    assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 60
    assert not (tmp_path / "s" / "0").exists() and not (tmp_path / "s" / "study.db").exists()  # nothing asked


def test_a_study_name_reused_with_another_space_is_refused(tmp_path):
    d = tmp_path / "s"
    assert_ok(python_train(study_args(d, 1, "num_epochs=1"), tmp_path))
    other = python_train(
        study_args(d, 2, "num_epochs=1", "study.params={optimizer.lr:'interval(0.1,0.2)'}"), tmp_path
    )
    assert other.returncode == 2
    said = other.stdout + other.stderr
    assert (
        "study.name=digits_lr_wd exists in sqlite:///" in said
        and "with another search space: optimizer.lr (FloatDistribution log 0.003..0.5 vs FloatDistribution "
        "0.1..0.2)"
        in said
    ), said[-2000:]
    assert len(load(d).get_trials()) == 1


def test_the_space_grammar_is_the_hydra_optuna_sweepers():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from ddplab.study.space import parse

    cfg = compose_cfg()
    space = parse(
        {
            "optimizer.lr": "tag(log, interval(1e-4, 1e-1))",
            "optimizer.weight_decay": "interval(0, 0.1)",
            "batch_size": "range(32, 129, 32)",
            "model": "choice(mlp, convnet)",
            "num_epochs": "tag(int, interval(2, 8))",
            "seed": "tag(int, log, interval(1, 1000))",
        },
        cfg,
    )
    assert space == {
        "optimizer.lr": FloatDistribution(1e-4, 1e-1, log=True),
        "optimizer.weight_decay": FloatDistribution(0.0, 0.1),
        "batch_size": CategoricalDistribution([32, 64, 96, 128]),
        "model": CategoricalDistribution(["mlp", "convnet"]),
        "num_epochs": IntDistribution(2, 8),
        "seed": IntDistribution(1, 1000, log=True),
    }


def test_a_study_dir_with_a_space_a_hash_and_a_question_mark_works(tmp_path):
    """Any legal path: Hydra's override grammar and SQLite's URL each give these characters a meaning."""
    d = tmp_path / "my study #1?x=y"
    args = [
        a if not a.startswith("study.dir=") else f"study.dir='{d}'" for a in study_args(d, 1, "num_epochs=1")
    ]
    proc = python_train(args, tmp_path)
    assert_ok(proc)
    assert (d / "study.db").is_file() and not list(tmp_path.glob("my study #1")), list(tmp_path.iterdir())
    study = load(d, url=default_url(d))
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"]
    assert read_result(d / "0")["trial"]["state"] == "COMPLETE"
    shown = (proc.stdout + proc.stderr).split("dashboard: optuna-dashboard ", 1)[1].splitlines()[0]
    assert shown == shlex.quote(default_url(d)), shown  # pasted into a shell, it opens this study
    assert (
        optuna.load_study(study_name="digits_lr_wd", storage=shlex.split(shown)[0]).trials[0].state.name
        == "COMPLETE"
    )


def test_a_trial_that_cannot_be_composed_is_told_fail_not_left_running(tmp_path):
    d = tmp_path / "s"
    proc = python_train(
        study_args(d, 1, "num_epochs=1", "++study.params={model:'choice(nosuch,nosuch2)'}"), tmp_path
    )
    assert_ok(proc)  # a failed trial does not stop the study
    (t,) = load(d).get_trials()
    assert t.state.name == "FAIL" and "Could not find 'model/nosuch" in t.user_attrs["error"], t.user_attrs
    assert read_result(d / "0")["trial"]["state"] == "FAIL"
