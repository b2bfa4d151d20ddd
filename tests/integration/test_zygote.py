"""A job forked from the tests' job server (tests/helpers/zygote.py) ends as the same job in a fresh
interpreter does, case by case (tests/helpers/zygote_cases.py) — exit code, its words on stdout and stderr,
what it writes, its result.json — so the tests that use it (``python_train``) test what ``python train.py``
does."""

from __future__ import annotations

import json
import os
import sys

import pytest
from helpers import jobs
from helpers.zygote_cases import CASES, words

# How the failing cases end in result.json (ddplab.failure): the status and the error's start.
RECORDS = {
    "config error": ("failed", "config error: num_epochs=0"),
    "a callback's exception": ("failed", "rank 0/1 failed in epoch 1, step 3: RuntimeError: FailsOnRank"),
    "SIGTERM after step 1": ("preempted", None),
    "self-launched, rank 1's callback fails": ("failed", "rank 1/2 failed in epoch 1, step 3: RuntimeError"),
    "torchrun, rank 1's callback fails": ("failed", "rank 1/2 failed in epoch 1, step 3: RuntimeError"),
    "torchrun, config error": ("failed", "config error: num_epochs=0"),
}
ENVS = {
    "a rank started by hand": {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        # (one rank forms no group: provenance records them)
        "MASTER_PORT": "29431",
    }
}
EXITS = {
    "completes": 0,
    "config error": 2,
    "a callback's exception": 1,
    "a process left holding stdout": 0,
    "SIGTERM after step 1": 143,
    "self-launched, 3 ranks": 0,
    "self-launched, rank 1's callback fails": 1,
    "torchrun, 2 ranks": 0,
    "torchrun, rank 1's callback fails": 1,
    "torchrun, config error": 1,
    "verify_resume, 2 ranks": 0,
    "a rank started by hand": 0,
    "a user's package on PYTHONPATH": 0,
    "python -m ddplab export": 0,
    "scripts/make_tokens.py": 0,
}


def users_package(tmp_path) -> dict[str, str]:
    """A user's package dir first on PYTHONPATH, then the server's: their callback says where Python found
    it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "users_callbacks.py").write_text(
        "import sys\n\n\nclass SaysWhere:\n    def on_fit_start(self, state):\n"
        "        print('users_callbacks:', __file__, 'first on sys.path:', sys.path[:3], flush=True)\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(pkg), jobs.job_env()["PYTHONPATH"]])}


def weights_and_metadata(path) -> tuple[dict, dict]:
    """What a safetensors file holds (its bytes differ from run to run: the Rust library writes the metadata's
    keys in a hash map's order, random in each process)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}


def written(case: str, folder) -> dict:
    """What the job wrote that is compared: verify_resume's legs' logs (a leg's log holds both ranks' lines,
    and which of two written at once comes first varies), an export's files (its weights as read, the rest as
    words), make_tokens.py's files byte for byte, and for a rank started by hand its launcher as provenance
    records it."""
    out = {
        f"legs/{p.name}": sorted(words(p.read_text(), str(folder)))
        for p in folder.glob("verify_resume/*.log")
    }
    if case == "python -m ddplab export":
        out |= {
            p.name: weights_and_metadata(p)
            if p.suffix == ".safetensors"
            else words(p.read_text(), str(folder))
            for p in folder.iterdir()
            if p.is_file()
        }
    if case == "scripts/make_tokens.py":
        out |= {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    if case in ENVS:
        out["launcher"] = json.loads((folder / "provenance.json").read_text())["launcher"]
    return out


def job_argv(case: str, tmp_path, how: str) -> list[str]:
    if case == "python -m ddplab export":  # the run trained before both legs, exported into each leg's folder
        return ["-m", "ddplab", "export", str(tmp_path / "trained"), "--out", str(tmp_path / how)]
    if case == "scripts/make_tokens.py":
        return [str(jobs.REPO / case), *CASES[case], "--out", str(tmp_path / how)]
    argv = [str(jobs.TRAIN), *CASES[case], f"hydra.run.dir={tmp_path / how}"]
    if case.startswith("torchrun"):
        argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *argv]
    return argv


def _ends(case: str, tmp_path, how: str, extra: dict, monkeypatch) -> tuple:
    """The job ``case`` run ``how`` (forked from the server, or a fresh interpreter): its exit code, console
    words, result.json's ending and what it wrote."""
    argv = job_argv(case, tmp_path, how)
    if how == "forked":
        server = jobs._zygote()
        served = server.served
        proc = server.run(argv, tmp_path, {**jobs.job_env(), **extra}, 120)
        from helpers.zygote import MAY_DIFFER

        now = jobs.job_env()
        changed = sorted(
            k for k in set(now) | set(server.env) if k not in MAY_DIFFER and now.get(k) != server.env.get(k)
        )
        assert proc is not None and server.served == served + 1, (
            f"not taken; environment entries changed: {changed}"
        )
    else:
        monkeypatch.setenv("DDPLAB_TEST_FRESH", "1")  # every process a fresh interpreter
        proc = jobs.run_cmd([sys.executable, *argv], tmp_path, 120, extra)
    path = tmp_path / how / "result.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    return (
        proc.returncode,
        words(proc.stdout, str(tmp_path / how)),
        words(proc.stderr, str(tmp_path / how)),
        {k: v for k, v in result.items() if k in ("status", "step", "epoch", "error")},
        written(case, tmp_path / how),
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_forked_job_ends_as_the_same_job_in_a_fresh_interpreter(case, tmp_path, monkeypatch):
    ends, extra = {}, users_package(tmp_path) if "PYTHONPATH" in case else ENVS.get(case, {})
    if case == "python -m ddplab export":
        jobs.assert_ok(
            jobs.python_train([*CASES["completes"], f"hydra.run.dir={tmp_path / 'trained'}"], tmp_path)
        )
    for how in ("forked", "fresh"):
        ends[how] = _ends(case, tmp_path, how, extra, monkeypatch)
    assert ends["forked"] == ends["fresh"]
    assert ends["forked"][0] == EXITS[case]
    if case in RECORDS:
        status, error = RECORDS[case]
        record = ends["forked"][3]
        assert record["status"] == status and (error is None or record["error"].startswith(error)), record
    assert ("written-after-the-job-exited" in ends["forked"][1]) == (case == "a process left holding stdout")
    files = ends["forked"][4]  # none of what is compared missing
    assert len([k for k in files if k.startswith("legs/")]) == (2 if case.startswith("verify_resume") else 0)
    assert ("model.safetensors" in files) == (case == "python -m ddplab export")
    assert ({"train.bin", "val.bin"} <= set(files)) == (case == "scripts/make_tokens.py")
    assert files.get("launcher") == (
        {"kind": "python", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29431", "WORLD_SIZE": "1"}
        if case in ENVS
        else None
    )
    said = [line for line in ends["forked"][1] if line.startswith("users_callbacks:")]
    # the script's dir, then PYTHONPATH
    where = [str(jobs.REPO), str(tmp_path / "pkg"), str(jobs.REPO / "tests")]
    assert said == (
        words(
            f"users_callbacks: {tmp_path}/pkg/users_callbacks.py first on sys.path: {where}",
            str(tmp_path / "forked"),
        )
        if "PYTHONPATH" in case
        else []
    ), ends["forked"][1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["returns", "exit 3", "exit with a message", "raises"])
def test_a_forked_process_ends_in_a_fresh_interpreters_order_without_its_module_teardown(
    how, tmp_path, monkeypatch
):
    """The server's child skips only the module teardown (zygote_server.end_as_an_interpreter): the thread is
    joined, the atexit handler runs, buffered output is flushed, the exit code and words are the fresh
    interpreter's, for each way a script ends; only a finalizer that the teardown alone would run (of an
    object a module global holds) does not run."""
    argv = [str(jobs.REPO / "tests" / "workers" / "ending_worker.py"), how]
    server = jobs._zygote()
    served = server.served
    forked = server.run(argv, tmp_path, jobs.job_env(), 60)
    assert forked is not None and server.served == served + 1
    monkeypatch.setenv("DDPLAB_TEST_FRESH", "1")  # a fresh interpreter
    fresh = jobs.run_cmd([sys.executable, *argv], tmp_path, 60)
    lines = [
        "main: done, this line still buffered",
        "thread: joined before atexit",
        "atexit: ran after the thread",
    ]
    assert forked.stdout.splitlines() == fresh.stdout.splitlines() == lines
    teardown = "module teardown: ran\n"
    assert fresh.stderr.endswith(teardown) and teardown not in forked.stderr
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr[: -len(teardown)])
    assert forked.returncode == {"returns": 0, "exit 3": 3}.get(how, 1)
    said = {"exit with a message": "bye: said on stderr, exit 1\n", "raises": "ValueError: boom\n"}
    assert forked.stderr.endswith(said.get(how, "")) and (forked.stderr == "") == (how not in said)
