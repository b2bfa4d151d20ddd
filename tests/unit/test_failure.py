"""One failure path (ddplab.failure): every kind of failure gives one exit code, at most one line and a whole
result.json, the same at every entry; and every entry ends through it. The processes each entry starts are
checked end to end by the tests listed in ENTRY_TESTS."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from ddplab import failure
from ddplab.config import ConfigError
from ddplab.errors import InputError, RecordWriteError, ResourceError, VerifyFailed, mark_said
from ddplab.runtime.group import PeerFailed, PeerLost
from ddplab.runtime.launch import RankFailed
from ddplab.runtime.signals import Preempted

SRC = Path(__file__).resolve().parents[2] / "src" / "ddplab"

FAILED = {"status", "error"}
PREEMPTED = {"status", "signal", "step", "checkpoint", "resume"}

# kind, the error, (exit code, the line's start or None, result.json's error or its status) at rank 0 of a job
# that ends in this process
CASES = [
    (
        "preempted",
        Preempted("SIGTERM", 7, "/r/checkpoints/step_7.pt"),
        143,
        "preempted: stopped by SIGTERM at step 7",
        "preempted",
    ),
    (
        "preempted",
        Preempted("SIGUSR1", 3, None),
        128 + 10,
        "preempted: stopped by SIGUSR1 at step 3 (no checkpoint)",
        "preempted",
    ),
    (
        "config",
        ConfigError("optimizer.lr=-1.0: must be > 0. Fix: a positive value"),
        2,
        "config error: optimizer.lr=-1.0: must be > 0",
        "config error: optimizer.lr=-1.0: must be > 0",
    ),
    (
        "input",
        InputError("tokens.bin: 3 bytes, not a whole token. Fix: ..."),
        2,
        "error: tokens.bin: 3 bytes",
        "InputError: tokens.bin: 3 bytes",
    ),
    (
        "resource",
        ResourceError("no space left on /r (0 B free). Fix: free space"),
        1,
        "error: no space left on /r",
        "ResourceError: no space left on /r",
    ),
    (
        "resource",
        RecordWriteError("the job completed but /r/result.json is not"),
        1,
        "error: the job completed",
        None,
    ),
    (
        "peer",
        PeerFailed("rank 1/3 stopped: lost its connection to rank 0", "rank 0/3 failed: ValueError: x"),
        1,
        "rank 1/3 stopped: lost its connection to rank 0",
        "rank 0/3 failed: ValueError: x",
    ),
    (
        "peer",
        PeerLost(
            "rank 1/3 stopped: lost its connection to a rank that said nothing", "rank 1/3 stopped: lost"
        ),
        1,
        "rank 1/3 stopped: lost its connection",
        "rank 1/3 stopped: lost",
    ),
    (
        "rank",
        RankFailed("self-launched job failed: rank 2 (local 2) exited with code 1: ValueError: x"),
        1,
        "self-launched job failed: rank 2",
        "self-launched job failed: rank 2",
    ),
    (
        "verify",
        VerifyFailed("the resumed run differs at step 9: w"),
        1,
        "verify_resume: the resumed run differs",
        None,
    ),
    ("crash", RuntimeError("boom"), 1, None, "RuntimeError: boom"),
]


@pytest.mark.parametrize(
    "kind,error,code,line,recorded", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_each_failure_kind_gives_one_code_one_line_and_a_whole_record(kind, error, code, line, recorded):
    ended = failure.of(error)
    assert (ended.kind, ended.code) == (kind, code)
    assert (ended.line is None) if line is None else ended.line.startswith(line), ended.line
    assert ended.line is None or "\n" not in ended.line  # one line
    assert ended.traceback == (kind == "crash") and not ended.waits
    if recorded is None:  # a record the disk just refused, a verdict: nothing written in their place
        assert ended.record is None
    elif recorded == "preempted":
        assert set(ended.record) == PREEMPTED and ended.record["status"] == "preempted"
        assert (ended.record["signal"], ended.record["step"]) == (error.signal_name, error.step)
        assert ended.record["checkpoint"] == error.checkpoint
    else:
        assert set(ended.record) == FAILED and ended.record["status"] == "failed"
        assert ended.record["error"].startswith(recorded), ended.record
    said = failure.of(mark_said(error))  # said where it happened (the Session): the entry says nothing more
    assert said.line is None and (said.code, said.record) == (ended.code, ended.record)


def test_a_config_error_is_said_by_rank_zero_alone_and_the_others_wait_for_it():
    e = ConfigError("model.depth=0: must be >= 1. Fix: model.depth=1")
    assert failure.of(e, rank=0).line and not failure.of(e, rank=0).waits
    assert failure.of(e, rank=2).line is None and failure.of(e, rank=2).waits
    # A self-launched rank leaves the line to its parent, which reads rank 0's record of it.
    assert failure.of(e, rank=0, in_rank=True).line is None
    assert failure.of(e, rank=0, in_rank=True).code == failure.of(e, rank=2).code == 2


def test_a_self_launched_rank_ends_with_the_code_its_parent_reads():
    from ddplab.runtime.launch import CONFIG_EXIT, SAID_EXIT
    from ddplab.study.storage import STORAGE_EXIT, StorageLost

    lost = StorageLost("sqlite:///s.db", OSError("disk I/O error"))
    assert failure.of(ResourceError("full"), in_rank=True).code == SAID_EXIT
    assert failure.of(lost, in_rank=True).code == SAID_EXIT  # a rank's storage loss: said, like a full disk
    assert failure.of(lost).code == STORAGE_EXIT == 3  # the study worker's own
    assert failure.of(InputError("bad"), in_rank=True).code == CONFIG_EXIT
    # Rank 0's record and line first where every rank met it, or where the parent reads an input error.
    assert failure.of(InputError("bad"), rank=1, in_rank=True).waits
    assert not failure.of(InputError("bad"), rank=1).waits
    assert failure.of(RecordWriteError("r"), rank=1).waits  # rank 0 alone says it
    both = StorageLost("sqlite:///s.db", OSError("x"), alike=True)
    assert failure.of(both, rank=1).waits and not failure.of(both, rank=0).waits


def test_the_session_report_is_what_is_recorded():
    report = "rank 1/3 failed at epoch 0, step 4: ValueError: x\n  A collective timed out ..."
    assert failure.of(ValueError("x"), rank=1, report=report).record == {"status": "failed", "error": report}


def test_leave_says_the_line_then_exits_with_the_code(caplog):
    caplog.set_level(logging.INFO, "ddplab")
    with pytest.raises(SystemExit) as ended:
        failure.leave(failure.of(ConfigError("a=1: no. Fix: a=2")), ConfigError("a=1"))
    assert ended.value.code == 2
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "config error: a=1: no. Fix: a=2")
    ]
    caplog.clear()
    with pytest.raises(SystemExit) as ended:
        failure.leave(failure.of(Preempted("SIGINT", 2, None)), Preempted("SIGINT", 2, None))
    assert ended.value.code == 130 and [r.levelname for r in caplog.records] == ["WARNING"]
    boom = RuntimeError("boom")
    with pytest.raises(RuntimeError) as crashed:  # a crash: its own traceback, Python's exit 1
        failure.leave(failure.of(boom), boom)
    assert crashed.value is boom


# Every entry that ends a process on a failure, and the function in it that asks ddplab.failure.
ENTRIES = {
    "cli.py": ["main"],  # python train.py; each rank under torchrun or SLURM
    "job.py": ["run_rank", "_ranks_ending"],  # a self-launched rank; its parent
    "study/__init__.py": ["run_study"],  # a study worker whose storage failed
    "study/worker.py": ["StudyWorker._failed"],  # a study trial
    "verify.py": ["_child_main"],  # a verify_resume leg
    "session.py": ["Session._say_and_record"],  # where the failure happened: said and recorded there
}
# Exits outside ddplab.failure: a self-launched rank's stop signal as the exit code its launcher reads
# (runtime.launch, below the entries; ddplab.failure reads it back), and a verify_resume leg's ``__main__``,
# which exits with the code its _child_main got from ddplab.failure. (os._exit, a watchdog's or a second
# signal's hard stop, is no failure's ending: runtime.watch, runtime.signals.)
EXITS_ELSEWHERE = {"runtime/launch.py": 1, "verify.py": 1}


def _functions(tree: ast.AST) -> dict[str, ast.AST]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{f.name}"] = f
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, node)
    return out


def _calls(node: ast.AST, module: str, name: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == name
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == module
        for n in ast.walk(node)
    )


@pytest.mark.parametrize("path,functions", list(ENTRIES.items()))
def test_every_entry_ends_a_failure_through_the_one_function(path, functions):
    found = _functions(ast.parse((SRC / path).read_text()))
    for name in functions:
        assert name in found, f"{path}: no {name} (update ENTRIES)"
        assert _calls(found[name], "failure", "of"), f"{path}:{name} does not ask ddplab.failure.of"


def test_no_module_but_the_failure_path_picks_an_exit_code():
    exits = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        n = sum(
            1
            for c in ast.walk(tree)
            if isinstance(c, ast.Call)
            and (
                (isinstance(c.func, ast.Name) and c.func.id == "SystemExit")
                or (
                    isinstance(c.func, ast.Attribute)
                    and c.func.attr == "exit"
                    and isinstance(c.func.value, ast.Name)
                    and c.func.value.id in ("sys", "os")
                )
            )
        )
        if n and path.name != "failure.py" and path.name != "__main__.py":
            exits[str(path.relative_to(SRC))] = n
    assert exits == EXITS_ELSEWHERE


def test_the_entries_list_is_whole():
    """A new ``except`` that ends a process must be added to ENTRIES (and ask ddplab.failure)."""
    asking = {
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.name != "failure.py" and _calls(ast.parse(p.read_text()), "failure", "of")
    }
    assert asking == set(ENTRIES)
