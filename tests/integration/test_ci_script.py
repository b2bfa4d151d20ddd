"""`.ci/run`, each step faked, fails at the first failed step — an install, a lint or format finding, a
cluster that does not start, the suite (pytest's exit 5, no test collected, included), the slurm or two-host
tests beside it — instead of going on to later phases that could still end it with 0."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from helpers.jobs import REPO  # noqa: E402

MULTIHOST = "tests/integration/test_multihost.py"
# Every command the script runs before its cluster phases, stood in for by one that notes its arguments.
STEPS = ("pip", "python", "mkdocs", "apt-get", "sinfo", "ruff")


def _fake(bin_dir: Path, name: str, fail_on: str, code: int, says: str = "") -> None:
    script = bin_dir / name
    script.write_text(
        f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\n'
        f'case "{name} $*" in *"{fail_on}"*) exit {code};; esac\necho "{says}"\nexit 0\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def run_ci(tmp_path: Path, fail_on: str, code: int = 1) -> tuple[int, list[str]]:
    """.ci/run in a copy of the repository's script, each step faked; the step matching ``fail_on`` fails."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in STEPS:
        _fake(bin_dir, name, fail_on, code)
    (repo / "scripts").mkdir()
    for name in ("slurm_local.sh", "netns_cluster.sh"):  # the clusters, faked the same way
        _fake(repo / "scripts", name, fail_on, code, "already up")  # as a second `up` says
    calls = tmp_path / "calls"
    calls.touch()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls)}
    proc = subprocess.run(
        ["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60
    )
    return proc.returncode, calls.read_text().splitlines()


@pytest.mark.parametrize(
    "fail_on",
    [
        "pip install --no-compile torch==",
        "pip install --no-compile -e",
        "pip install --no-compile --no-deps hydra-optuna",
    ],
)
def test_a_failed_install_fails_ci_before_the_suite(tmp_path, fail_on):
    rc, calls = run_ci(tmp_path, fail_on)
    assert rc != 0
    # the cluster starts beside the installs; the exit trap takes the two-host one down (a no-op where not up)
    steps = [c for c in calls if c not in ("slurm_local.sh up", "netns_cluster.sh down")]
    assert steps[-1].startswith(fail_on), calls  # nothing ran after the failed install
    assert not any(c.startswith(("python", "mkdocs")) for c in calls)


@pytest.mark.parametrize("code", [1, 5])  # 5: pytest collected no test
def test_a_failed_or_empty_suite_fails_ci_with_its_code_once_what_runs_beside_it_ended(tmp_path, code):
    rc, calls = run_ci(tmp_path, "python -m pytest -q -n 3", code)
    assert rc == code, calls
    assert "python -m pytest -q -n 3 --dist loadgroup" in calls, calls
    # the slurm tests, the docs and the two-host phase ran beside it, to their end (clusters taken down)
    order = [
        next(i for i, c in enumerate(calls) if c.startswith(step))
        for step in (
            "python -m pytest -q -p no:cacheprovider -m slurm",
            "mkdocs build --strict",
            "netns_cluster.sh up",
            f"python -m pytest -q -p no:cacheprovider -m netns -k not link_goes_down {MULTIHOST}",
        )
    ]
    assert order == sorted(order), calls
    assert calls[-1] == "netns_cluster.sh down", calls


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_test_file_skipped_at_import_under_ci_fails_the_run(tmp_path):
    """Issue 45: six HF/MLflow files skip themselves when their extra does not import; a broken extra made ~50
    tests vanish with CI green. Under DDPLAB_CI=1 (.ci/run) such a file fails the run; outside CI it skips."""
    import sys

    tests = Path(__file__).resolve().parents[1]
    (tmp_path / "test_needs_extra.py").write_text(
        "import pytest\npytest.importorskip('an_extra_that_is_not_here', reason='the x extra')\n"
        "def test_it():\n    pass\n"
    )
    shutil.copy(tests / "conftest.py", tmp_path / "conftest.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(tmp_path / "test_needs_extra.py"),
    ]
    ci = subprocess.run(cmd, cwd=tmp_path, env={**env, "DDPLAB_CI": "1"}, capture_output=True, text=True)
    assert ci.returncode != 0 and "skipped under DDPLAB_CI=1: Skipped: the x extra" in ci.stdout, ci.stdout[
        -2000:
    ]
    env.pop("DDPLAB_CI", None)
    local = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert local.returncode == 5 and "1 skipped" in local.stdout, local.stdout[-2000:]  # skipped: nothing ran


def test_a_cluster_that_does_not_start_fails_ci_before_the_suite(tmp_path):
    """The one-node SLURM cluster starts beside the installs; the suite that runs its tests waits for it."""
    rc, calls = run_ci(tmp_path, "slurm_local.sh up")
    assert rc != 0 and "slurm_local.sh up" in calls, calls
    assert not any(c.startswith(("python -m pytest", "mkdocs")) for c in calls), calls


def test_the_slurm_tests_run_beside_the_suite_and_their_failure_fails_ci_before_the_docs(tmp_path):
    """They run in a pytest of their own while the suite (the README's command, the slurm tests left out)
    runs."""
    rc, calls = run_ci(tmp_path, "-m slurm", 1)
    assert rc == 1, calls
    tests = [c for c in calls if c.startswith("python -m pytest")]
    assert sorted(tests) == [
        "python -m pytest -q -n 3 --dist loadgroup",
        "python -m pytest -q -p no:cacheprovider -m slurm",
    ], calls
    assert not any(c.startswith(("mkdocs", "netns_cluster.sh up")) for c in calls), calls


def test_a_failed_two_host_test_fails_ci_and_its_cluster_is_taken_down(tmp_path):
    """The two-host phase runs beside the suite too, after the slurm tests and the docs."""
    rc, calls = run_ci(tmp_path, "-m netns", 1)
    assert rc == 1, calls
    assert calls.index("netns_cluster.sh up") > calls.index(
        "python -m pytest -q -p no:cacheprovider -m slurm"
    )
    assert calls[-1] == "netns_cluster.sh down", calls  # by the exit trap: the phase stopped at its failure


@pytest.mark.parametrize("fail_on", ["ruff check .", "ruff format --check ."])
def test_a_lint_or_format_finding_fails_ci_before_the_suite(tmp_path, fail_on):
    rc, calls = run_ci(tmp_path, fail_on)
    assert rc != 0
    steps = [c for c in calls if c not in ("slurm_local.sh up", "netns_cluster.sh down")]
    assert steps[-1] == fail_on, calls  # no suite after it
    assert any(c.startswith("pip install --no-compile -e") for c in steps), calls  # after the installs


def test_the_two_host_test_with_a_tight_time_bound_runs_after_the_suite_then_the_cluster_comes_down(tmp_path):
    """Beside the suite, three pytest workers' load took its process's exit past its bound (timeout + 5 s)."""
    rc, calls = run_ci(tmp_path, "nothing fails")
    assert rc == 0, calls
    quiet = f"python -m pytest -q -p no:cacheprovider -m netns -k link_goes_down {MULTIHOST}"
    assert calls.index(quiet) > calls.index("python -m pytest -q -n 3 --dist loadgroup"), calls
    assert calls[calls.index(quiet) + 1 :] == ["netns_cluster.sh down"] * 2, calls
