"""The fault soak (scripts/soak.py): its fixed pairwise plan holds every pair of dimension values (launcher,
world size 1-3, strategy, data source (digits, token files, Hugging Face JSONL through a BPE) and access (held
or streamed), checkpoint mode, signal, target, phase, step time, grad accumulation, run mode, one feature in
play: EMA, amp, loader workers or training by steps) in at least one trial — each trial faulted once, resumed
until the job completes and checked against its uninterrupted run. CI runs one of its ``CI_PARTS`` parts a
commit (four consecutive parts hold every value of every dimension; the parts together, every pair): the whole
plan is about 12 minutes of CI's 2 cores, a part 2-3 trials. The plan's generator is checked without running
anything; the whole plan, seed-drawn and long soaks run by hand."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from helpers.jobs import REPO, run_cmd
from soak_draw import draw
from soak_pairs import pairwise_plan, plan_parts, plan_trials, valid
from soak_plan import DIMENSIONS

sys.path.insert(0, str(REPO / "scripts"))
import sys

import soak  # noqa: E402  (scripts/soak.py, the driver)
from helpers.jobs import REPO
from soak_draw import trial_seeds
from soak_plan import SLURM

CI_PARTS = 16  # quarters of the 4-way deal's parts: every value over four commits, every pair over 16


def pairs_of(trial: dict[str, object]) -> set[tuple]:
    return {((a, trial[a]), (b, trial[b])) for a, b in itertools.combinations(DIMENSIONS, 2)}


def extends(partial: dict[str, object]) -> bool:
    """Some whole trial satisfying every constraint holds ``partial``: a backtracking search over the other
    dimensions that drops a branch as soon as its values break a constraint (exact, as enumerating all 3.3M
    trials was, in a second instead of 107 s)."""
    rest = [n for n in DIMENSIONS if n not in partial]

    def search(trial: dict[str, object], i: int) -> bool:
        return i == len(rest) or any(
            valid(t) and search(t, i + 1) for t in ({**trial, rest[i]: v} for v in DIMENSIONS[rest[i]])
        )

    return valid(partial) and search(partial, 0)


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_the_pairwise_plan_covers_every_valid_pair_and_is_deterministic(capsys):
    # Valid pairs, found the slow way: those some trial satisfying every constraint contains.
    every = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(DIMENSIONS, 2)
        for va in DIMENSIONS[a]
        for vb in DIMENSIONS[b]
        if extends({a: va, b: vb})
    }
    plan = pairwise_plan()
    assert all(valid(trial) for trial in plan)
    missing = every - set().union(*map(pairs_of, plan))
    assert missing == set(), sorted(missing)[:5]
    assert plan == pairwise_plan()  # the same plan every time, so CI reruns the same trials
    assert len(plan) == 37, len(plan)  # the budget: CI runs a quarter of it, 2 trials at a time

    assert soak.main(["--pairwise", "--plan"]) == 0
    out = capsys.readouterr().out
    assert (
        f"covers {len(every)}/{len(every)} valid pairs of {len(DIMENSIONS)} dimensions in {len(plan)} trials"
        in out
    )
    assert len([line for line in out.splitlines() if " fsdp " in line]) >= 3  # printed like any drawn trial
    # A failure's rerun command names the plan's seed and the trial's; a seed the plan does not hold: one
    # line, exit 2.
    assert soak.main(["--pairwise", "--seed", "0", "--only", "5", "--plan"]) == 2
    assert capsys.readouterr().err == (
        "soak.py: --only 5: no trial of the pairwise plan of --seed 0 has that seed. Fix: "
        "the --seed the failure printed (python scripts/soak.py --pairwise --seed 0 --plan "
        "lists its trials), or drop --pairwise for a trial drawn at random\n"
    )
    first = plan_trials(0)[0]
    assert first.rerun() == f"python scripts/soak.py --pairwise --seed 0 --only {first.seed} --keep"
    assert soak.main(["--pairwise", "--only", str(first.seed), "--plan"]) == 0
    assert capsys.readouterr().out.startswith(f"{first.seed:10d} {first.label()}\n")


@pytest.mark.slow  # 1.4-2.1 s in the inner loop: a second or more, as the marker says
def test_an_fsdp_checkpoint_compares_by_the_weights_its_shards_hold(tmp_path):
    """The soak's final check reads an FSDP checkpoint's model and optimizer back from its shards: its step
    file has none (``sharded`` names the shards' dir), so comparing the step files alone compared nothing."""
    import torch
    import torch.distributed.checkpoint as dcp
    from helpers.compare import load_whole, same

    for name, w in (("a", 1.0), ("b", 1.0 + 2**-20)):
        dcp.save(
            {"model": {"w": torch.full((3,), w)}, "optimizer": {"state": {"w": {"exp_avg": torch.zeros(3)}}}},
            checkpoint_id=str(tmp_path / name / "step-00000004.dcp"),
            no_dist=True,
        )
        torch.save(
            {"loop": {"step": 4}, "sharded": {"sidecar": "step-00000004.dcp"}}, tmp_path / name / "last.pt"
        )
    a, b = load_whole(tmp_path / "a" / "last.pt"), load_whole(tmp_path / "b" / "last.pt")
    assert sorted(a) == ["loop", "model", "optimizer"] and a["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert same(a["model"], b["model"], "model") == "model.w"  # one ulp-scale change in the shards is seen
    assert same(a["model"], load_whole(tmp_path / "a" / "last.pt")["model"]) is None


def this_commits_part() -> tuple[int, int]:
    """``DDPLAB_SOAK_PART=K/N`` where set; else the checkout's commit count modulo CI_PARTS, so consecutive
    commits run consecutive parts (a shallow clone counts 1: there, the commit hash picks)."""
    if os.environ.get("DDPLAB_SOAK_PART"):
        return soak.part(os.environ["DDPLAB_SOAK_PART"])

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    shallow = git("rev-parse", "--is-shallow-repository") != "false"
    n = int(git("rev-parse", "HEAD")[:8] or "0", 16) if shallow else int(git("rev-list", "--count", "HEAD"))
    return n % CI_PARTS + 1, CI_PARTS


@pytest.mark.slow  # seconds: the plan dealt four ways
def test_the_plans_parts_each_hold_every_value_and_together_the_plan(capsys):
    plan = pairwise_plan()
    values = {(name, v) for name in DIMENSIONS for v in DIMENSIONS[name]}
    load = [1 if t["launcher"] == "single" else 1 + t["world"] for t in plan]
    for n in (1, 2, 3, 4, CI_PARTS):
        parts = plan_parts(n)
        assert sorted(i for p in parts for i in p) == list(range(len(plan)))  # each trial in exactly one part
        held = [{item for i in p for item in plan[i].items()} for p in parts]
        if n > 4:  # n/4 consecutive parts: one of the 4-way deal's
            held = [set().union(*held[j : j + n // 4]) for j in range(0, n, n // 4)]
        assert held == [values] * len(held), n
        loads = sorted(sum(load[i] for i in p) for p in parts)
        assert loads[-1] - loads[0] <= max(load), loads  # balanced to within one trial
    assert plan_parts(CI_PARTS) == plan_parts(CI_PARTS)
    # A part's trials are the plan's (seeds and all), and the part says it holds every value.
    assert soak.main(["--pairwise", "--part", "2/4", "--plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    every = plan_trials(0)
    assert out[:-1] == [f"{every[i].seed:10d} {every[i].label()}" for i in plan_parts(4)[1]]
    assert out[-1].endswith(f"in {len(plan_parts(4)[1])} trials, {len(values)}/{len(values)} of their values")
    for argv, said in (
        (["--part", "1/4"], "--part deals the --pairwise plan into parts: add --pairwise"),
        (["--pairwise", "--part", "5/4"], "argument --part: '5/4': K/N with 1 <= K <= N, as 2/4"),
    ):
        with pytest.raises(SystemExit) as e:
            soak.main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.slow  # a part of the plan: every trial faulted, resumed and checked
def test_the_pairwise_soak_plan_holds_every_invariant(tmp_path):
    # Two trials at a time: the invariants must hold on a loaded machine too. This commit's part: every value
    # of every dimension, every pair over CI_PARTS commits (the whole plan: python scripts/soak.py
    # --pairwise).
    k, n = this_commits_part()
    proc = run_cmd(
        [
            sys.executable,
            str(REPO / "scripts" / "soak.py"),
            "--pairwise",
            "--part",
            f"{k}/{n}",
            "--jobs",
            "2",
            "--workdir",
            str(tmp_path / "soak"),
        ],
        tmp_path,
        timeout=1500,
    )
    trials = len(plan_parts(n)[k - 1])
    assert proc.returncode == 0, f"part {k}/{n}: " + proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"{trials}/{trials} trials held" in proc.stdout, f"part {k}/{n}: {proc.stdout[-3000:]}"


@pytest.mark.slow
def test_a_stopped_soak_ends_its_trials_and_its_mlflow_server(tmp_path):
    """SIGTERM to the driver (a CI timeout, a user's Ctrl-C is SIGINT) mid-trial: every process it started,
    the trial's job (launcher, ranks) and the MLflow server in a session of its own, is gone at once, not left
    running for its timeout (the server, for ever)."""
    import os
    import signal
    import subprocess
    import time

    from soak_toy import trial_pids

    seed = 1930549411  # torchrun x2, MLflow up, six steps of 1.3 s: still training when stopped
    assert draw(seed).tracking == "mlflow" and draw(seed).server == "up" and draw(seed).launcher == "torchrun"
    driver = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "scripts" / "soak.py"),
            "--only",
            str(seed),
            "--workdir",
            str(tmp_path / "soak"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ours, deadline = f"-{driver.pid}-", time.time() + 120
    kinds: set[str] = set()
    while kinds != {"servers", "job"} and time.time() < deadline and driver.poll() is None:
        time.sleep(0.2)
        kinds = {
            "servers" if b"SOAK_TRIAL_ID=soak-%d-servers" % driver.pid in environ(p) else "job"
            for p in trial_pids(ours, containing=True)
        }
    assert kinds == {"servers", "job"}, f"never saw the trial's job and the server: {kinds}"
    os.kill(driver.pid, signal.SIGTERM)
    assert driver.wait(10) == 128 + signal.SIGTERM
    time.sleep(0.5)  # SIGKILLed processes are reaped by their parents (or init) a moment later
    assert trial_pids(ours, containing=True) == []


@pytest.mark.slow
def test_a_stopped_soak_of_two_trials_at_a_time_leaves_nothing_and_reports_no_trial_it_cut_short(tmp_path):
    """The trials' threads go on after the stop: a killed attempt is followed by a resume, a failed trial by
    the next. Seen on a --jobs 2 soak before the fix: ten trials reported FAILED in the stop's two seconds,
    and two jobs started after its last scan were left running."""
    import os
    import signal
    import subprocess
    import time

    from soak_toy import trial_pids

    driver = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "scripts" / "soak.py"),
            "--trials",
            "12",
            "--seed",
            "7",
            "--jobs",
            "2",
            "--workdir",
            str(tmp_path / "soak"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ours, deadline, trials = f"-{driver.pid}-", time.time() + 120, set()
    try:
        # two trials' jobs running
        while len(trials) < 2 and time.time() < deadline and driver.poll() is None:
            time.sleep(0.2)
            ids = {
                environ(p).split(b"SOAK_TRIAL_ID=")[-1].split(b"\0")[0]
                for p in trial_pids(ours, containing=True)
            }
            trials = {i for i in ids if not i.startswith(b"soak-ref-") and not i.endswith(b"-servers")}
        assert len(trials) == 2, f"never saw two trials running: {trials}"
    finally:
        os.kill(driver.pid, signal.SIGTERM)
    out, _ = driver.communicate(timeout=40)
    assert driver.returncode == 128 + signal.SIGTERM, out[-3000:]
    for _ in range(15):  # nothing left, and nothing started late
        time.sleep(0.2)
        assert trial_pids(ours, containing=True) == [], out[-3000:]
    assert "FAILED" not in out, out[-3000:]


GATE = r"""
import subprocess, sys, threading
sys.path[:0] = [sys.argv[1] + "/scripts", sys.argv[1] + "/tests"]
from _soak_stop import STOPPING, end_everything_when_stopped
end_everything_when_stopped()
said = []
def trial():
    try:
        subprocess.run(["true"])
        said.append("started")
    except RuntimeError as e:
        said.append(str(e))
for stopped in (False, True):
    if stopped:
        STOPPING.set()  # what the stop does first
    t = threading.Thread(target=trial)
    t.start()
    t.join()
print(said, subprocess.run(["true"]).returncode)  # the stop's own processes (squeue, scancel) still run
"""


@pytest.mark.slow  # seconds: soak_toy imports torch
def test_once_stopped_the_soaks_trial_threads_start_no_process():
    """The race a stop loses otherwise: a trial's thread starting a process after the stop's last scan."""
    out = subprocess.run([sys.executable, "-c", GATE, str(REPO)], capture_output=True, text=True, timeout=60)
    assert out.stdout == "['started', 'the soak was stopped: its trials start no more processes'] 0\n", (
        out.stderr
    )


def environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_soak_bounded_in_time_starts_no_trial_after_it_and_says_where_to_go_on(tmp_path):
    proc = run_cmd(
        [
            sys.executable,
            str(REPO / "scripts" / "soak.py"),
            "--trials",
            "3",
            "--seed",
            "1",
            "--first",
            "2",
            "--minutes",
            "0",
            "--workdir",
            str(tmp_path / "soak"),
        ],
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "--minutes: stopped starting trials after 0 of 2; --first 2 continues with the same --trials and "
        "--seed" in proc.stdout
    )
    assert "0/0 trials held" in proc.stdout and not list((tmp_path / "soak").glob("trial-*"))


def test_srun_is_drawn_as_a_launcher_only_with_slurm_and_never_for_what_it_cannot_run(capsys):
    seeds = trial_seeds(1127, 200)
    # without --slurm the draws are what they always were
    assert all(draw(s).launcher != SLURM for s in seeds)
    under = [t for t in (draw(s, slurm=True) for s in seeds) if t.launcher == SLURM]
    assert 30 <= len(under) <= 70, len(under)  # one launcher of four
    # verify_resume starts its own processes: not under srun
    assert {t.mode for t in under} == {"train", "study"}
    assert {t.strategy for t in under} == {"ddp", "fsdp"} and all(t.world == 2 for t in under)
    assert under[0].rerun() == f"python scripts/soak.py --only {under[0].seed} --slurm --keep"
    # the plan is fixed (CI runs it before its cluster is up): one line, exit 2
    with pytest.raises(SystemExit) as e:
        soak.main(["--pairwise", "--slurm"])
    assert e.value.code == 2 and "the --pairwise plan is fixed: drop one of them" in capsys.readouterr().err
