"""A batch job on the SLURM cluster the tests start (scripts/slurm_local.sh), and its end."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from helpers.jobs import job_env

DONE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def release(job: str, info: dict[str, str]) -> None:
    """SLURM holds a requeued batch job for about 2 minutes (its EligibleTime is set ~121 s after the
    requeue); an operator may release it early, as these tests do to stay short. Not at once: slurmd
    refuses to start a job whose credential it revoked within the same second ("Job credential
    revoked"; the job then fails), so the release waits 3 s after the requeue (the new SubmitTime)."""
    if (
        info.get("JobState") == "PENDING"
        and info.get("Reason") == "BeginTime"
        and info.get("Restarts") != "0"
    ):
        requeued = time.mktime(time.strptime(info["SubmitTime"], "%Y-%m-%dT%H:%M:%S"))
        if time.time() - requeued >= 3:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)


def sbatch(tmp_path: Path, body: str, options: list[str]) -> str:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + body + "\n")
    out = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", "--output=slurm-%j.out", *options, str(script)],
        capture_output=True,
        text=True,
        env=job_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait_job(job: str, tmp_path: Path, timeout: float = 240) -> dict[str, str]:
    t0 = time.monotonic()
    while True:
        info = job_info(job)
        if info.get("JobState") in DONE:
            return info
        release(job, info)
        if time.monotonic() - t0 > timeout:
            subprocess.run(["scancel", job])
            logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("slurm-*.out"))
            raise AssertionError(f"job {job} still {info.get('JobState')} after {timeout}s\n{logs}")
        time.sleep(0.5)
