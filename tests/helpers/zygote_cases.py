"""The jobs the job-server tests run both ways (tests/integration/test_zygote*.py), and a console's words
with the run dir taken out."""

from __future__ import annotations

import re


def words(text: str, run: str) -> list[str]:
    """The lines less what differs between any two runs: clock times, durations, rates, the run dir."""
    # not in tmp_path's name
    text = re.sub(rf"\b{re.escape(run.rsplit('/', 1)[1])}\b", "RUN", text.replace(run, "RUN"))
    text = re.sub(r"\d\d:\d\d:\d\d", "T", text)
    text = re.sub(r"[\d,]+(\.\d+)? ?(s|ms|samples/s|it/s)\b", "N", text)
    text = re.sub(r"\(max [\d.]+\)", "(max N)", text)  # the slowest step's milliseconds
    text = re.sub(r"T\.\d+ \d+ ", "T PID ", text)  # torch's log lines: their time and process (a rank's)
    text = re.sub(r"(pid:|process|PID) \d+", r"\1 PID", text)
    # torchrun's temp dir for the ranks' error files
    text = re.sub(r"torchelastic_[\w/.-]+", "ERROR_FILE", text)
    # the rank table's config hash names the dir
    return [line for line in text.splitlines() if "cfg=" not in line]


CASES = {
    "completes": ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=none"],
    "config error": ["model=mlp", "num_epochs=0"],
    "a callback's exception": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=3",
        "progress=none",
        "+callbacks.bug._target_=toy_callbacks.FailsOnRank",
        "+callbacks.bug.rank=0",
        "+callbacks.bug.step=2",
    ],
    "a process left holding stdout": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=1",
        "progress=none",
        "+callbacks.late._target_=toy_callbacks.LeavesAWriterBehind",
    ],
    "SIGTERM after step 1": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=3",
        "progress=none",
        "+callbacks.stop._target_=toy_callbacks.SignalAtStep",
        "+callbacks.stop.sig=SIGTERM",
        "+callbacks.stop.step=1",
    ],
    # a self-launch: its rank server a spare of the job (helpers/spares.py)
    "self-launched, 3 ranks": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=2",
        "progress=log",
        "batch_size=48",
        "distributed.nproc_per_node=3",
        "distributed.oversubscribe_cpu=true",
    ],
    "self-launched, rank 1's callback fails": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=3",
        "progress=none",
        "distributed.nproc_per_node=2",
        "+callbacks.bug._target_=toy_callbacks.FailsOnRank",
        "+callbacks.bug.rank=1",
        "+callbacks.bug.step=2",
    ],
    # torchrun: its launcher forked, its workers spares of it
    "torchrun, 2 ranks": ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=log"],
    "torchrun, rank 1's callback fails": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=3",
        "progress=none",
        "+callbacks.bug._target_=toy_callbacks.FailsOnRank",
        "+callbacks.bug.rank=1",
        "+callbacks.bug.step=2",
    ],
    # (a SIGTERM under torchrun is not here: which rank torchrun's agent finds exited first, and whether the
    # other then dies of its SIGTERM or exits 143 itself, varies from run to run in fresh interpreters too)
    "torchrun, config error": ["model=mlp", "num_epochs=0"],
    # verify_resume: its three legs spares of the job, a 2-rank leg's rank server a spare of the leg
    "verify_resume, 2 ranks": [
        "model=mlp",
        "mode=verify_resume",
        "num_epochs=1",
        "limit_train_steps=4",
        "distributed.nproc_per_node=2",
    ],
    # a rank started by hand (the launcher's variables, absent from the server's environment, read at run
    # time)
    "a rank started by hand": ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=log"],
    # a user's package before the server's PYTHONPATH: the fork puts it on sys.path where an interpreter would
    "a user's package on PYTHONPATH": [
        "model=mlp",
        "num_epochs=1",
        "limit_train_steps=1",
        "progress=none",
        "+callbacks.mine._target_=users_callbacks.SaysWhere",
    ],
    # `python -m ddplab`: the package's __main__ run as a fresh `python -m` runs it (see export_argv)
    "python -m ddplab export": [],
    # a script the server runs besides train.py (helpers.jobs.SERVED_SCRIPTS): its files compared byte for
    # byte
    "scripts/make_tokens.py": ["--generated-mb", "0.01"],
}
