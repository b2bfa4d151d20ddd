"""`.ci/run` is the README's test command step by step: its installs, one a line, and the suite with the slurm
tests set apart. How it fails at the first failed step: tests/integration/test_ci_script.py."""

from helpers.jobs import REPO  # noqa: E402


def test_ci_runs_the_readmes_test_command_step_by_step():
    """.ci/run is the README's test command (one step a line, the suite with the slurm tests set apart)."""
    command = next(
        line
        for line in (REPO / "README.md").read_text().splitlines()
        if line.startswith("pip install") and "pytest" in line
    )
    *installs, suite = command.split(" && ")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert all(step in ci for step in installs), installs
    assert any(line.startswith(f"DDPLAB_SLURM_APART=1 {suite} ") for line in ci), suite
