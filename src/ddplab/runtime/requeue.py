"""After a preemption's checkpoint, put the job back in the queue where the scheduler allows it.

* A SLURM batch job stopped by SIGUSR1 — ``#SBATCH --signal=USR1@N``, SLURM's warning N seconds
  before the time limit — requeues itself: ``scontrol requeue <job>`` (an array task as
  ``<array job>_<task>``). SLURM runs the batch script again with ``SLURM_RESTART_COUNT`` set; the
  run dir is the same (``outputs/slurm-<job>``, see :func:`ddplab.cli.prepare_argv`) and the
  Session resumes from its last checkpoint.
* SIGTERM is never requeued by ddplab: SLURM sends it on ``scancel`` (stop for good) and when it
  preempts or requeues the job itself (it then puts the job back on its own).
* Under submitit, submitit's own protocol: the signal goes on to the handler submitit installed
  (ddplab held it during training), which resubmits the job through its ``checkpoint()`` and
  requeues it. ddplab's checkpoint is already written, so the resubmitted job resumes from it.
"""

from __future__ import annotations

import logging
import signal
import subprocess

from ddplab.runtime import env
from ddplab.runtime.signals import Preempted

log = logging.getLogger("ddplab")

REQUEUE_ON = ("SIGUSR1",)


def after_preemption(e: Preempted) -> str | None:
    """Rank 0: requeue as the scheduler expects; what was done, or None. Under submitit this may
    not return (submitit's handler exits the process once the job is requeued)."""
    if env.rank() != 0:
        return None
    if env.under_submitit():
        handler = signal.getsignal(getattr(signal, e.signal_name, signal.SIGTERM))
        if callable(handler):
            log.info(
                "handing %s to submitit: it requeues the job, which resumes from the checkpoint",
                e.signal_name,
            )
            handler(getattr(signal, e.signal_name), None)
            return "submitit"
        return None
    job = env.slurm_job()
    if job is None or e.signal_name not in REQUEUE_ON:
        return None
    # Said first: SLURM ends the job's processes as it requeues it, at times before scontrol has returned here
    # (seen under load: the job requeued, this line never written). A failure is said after it.
    log.warning("requeueing SLURM job %s: it resumes from the checkpoint when it starts again", job)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("could not requeue SLURM job %s (%s): resubmit it with resume=auto", job, err)
        return None
    if done.returncode != 0:
        log.error(
            "scontrol requeue %s failed: %s. Fix: submit with --requeue (or resubmit with resume=auto)",
            job,
            (done.stderr or done.stdout).strip(),
        )
        return None
    return f"scontrol requeue {job}"
