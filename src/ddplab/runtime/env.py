"""The launcher's environment: the ONLY module that reads (or writes) RANK, WORLD_SIZE,
LOCAL_RANK, SLURM_*, SUBMITIT_*, TORCHELASTIC_* and ddplab's own self-launch flag.

Launch forms it understands::

    python train.py                                      # one process
    torchrun --standalone --nproc_per_node=2 train.py    # RANK/LOCAL_RANK/WORLD_SIZE set
    python -m torch.distributed.launch ... train.py      # legacy: --local-rank=N in argv
    srun / submitit                                      # SLURM_* / SUBMITIT_LOCAL_* task variables
    python train.py distributed.nproc_per_node=2         # ddplab.runtime.launch sets DDPLAB_SELF_LAUNCHED

Everything else asks this module (or the Dist the Session builds from it).
"""

from __future__ import annotations

import functools
import netrc
import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

SELF_LAUNCHED = "DDPLAB_SELF_LAUNCHED"


def _first_host() -> str:
    """The SLURM job's first host, where rank 0 runs and the rendezvous listens. submitit parses SLURM's
    node list ("gpu[03-05,09],cpu1" -> gpu03, gpu04, ...), which ddplab does not write again."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    return SlurmJobEnvironment().hostnames[0]


def adopt_scheduler_env() -> None:
    """Map SLURM's (srun / submitit_slurm) or submitit_local's task variables onto
    torch's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, so each task of a
    multi-task job becomes one rank. No-op when a torch launcher already set RANK."""
    env = os.environ
    if "RANK" in env:
        return
    # Only inside a job step (srun): a batch script's own shell also has SLURM_PROCID=0 and the
    # job's SLURM_NTASKS, but it is one process, and taking it for rank 0 of N would wait forever.
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        rank, world, local = env["SLURM_PROCID"], env["SLURM_NTASKS"], env.get("SLURM_LOCALID", "0")
        addr = _first_host()
        port = 10000 + int(env.get("SLURM_JOB_ID", "0")) % 20000  # same on every task of the job
    elif int(env.get("SUBMITIT_LOCAL_NTASKS", "1")) > 1 and "SUBMITIT_LOCAL_GLOBALID" in env:
        rank, world = env["SUBMITIT_LOCAL_GLOBALID"], env["SUBMITIT_LOCAL_NTASKS"]
        local, addr = env.get("SUBMITIT_LOCAL_LOCALID", "0"), "127.0.0.1"
        port = 10000 + int(env.get("SUBMITIT_LOCAL_JOB_ID", "0")) % 20000
    else:
        return
    env.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local)
    env.setdefault("MASTER_ADDR", addr)
    env.setdefault("MASTER_PORT", str(port))


def rank() -> int:
    """Global rank from the launcher's environment (0 when not launched)."""
    adopt_scheduler_env()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """World size from the launcher's environment (1 when not launched)."""
    adopt_scheduler_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    adopt_scheduler_env()
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_launched() -> bool:
    """True when a launcher (torchrun, SLURM, submitit) made this process one of several ranks."""
    adopt_scheduler_env()
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def srun_task() -> bool:
    """A task of a SLURM job step (srun): SLURM may have bound it to GPUs of its own (--gpus-per-task)."""
    return "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ


def is_self_launched() -> bool:
    """A rank of ddplab's self-launch: the variable holds its launcher's pid (in the launcher, which set it,
    that pid is this process's own)."""
    value = os.environ.get(SELF_LAUNCHED, "")
    return value.isdigit() and int(value) != os.getpid()


def prepare_self_launch(nproc: int) -> None:
    """Before starting ``nproc`` local ranks: they inherit the flag, which names this process as their
    launcher (so they never launch again, and they watch it), and, unless the user chose otherwise, one
    share of the cores each."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[SELF_LAUNCHED] = str(os.getpid())


def onednn_isa_cap() -> str | None:
    """The instruction set oneDNN (torch's CPU conv/matmul kernels) is capped at, upper case, or None.
    oneDNN reads ONEDNN_MAX_CPU_ISA (older releases DNNL_MAX_CPU_ISA) once per process; a cap below the
    CPU's own ISA makes it emulate what the hardware could run natively."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
        if value:
            return value
    return None


def malloc_settings() -> dict[str, str]:
    """The C allocator choices the user made in the environment: glibc's ``MALLOC_*_`` variables and its
    ``glibc.malloc.*`` tunables, and ``LD_PRELOAD`` (a jemalloc/tcmalloc/mimalloc preloaded), by name."""
    names = (
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_TOP_PAD_",
        "MALLOC_MMAP_MAX_",
        "LD_PRELOAD",
    )
    found = {k: os.environ[k] for k in names if os.environ.get(k)}
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        found["GLIBC_TUNABLES"] = os.environ["GLIBC_TUNABLES"]
    return found


def master_address() -> str:
    """MASTER_ADDR:MASTER_PORT as env:// will use them (for messages)."""
    adopt_scheduler_env()
    addr = os.environ.get("MASTER_ADDR", "<MASTER_ADDR unset>")
    return f"{addr}:{os.environ.get('MASTER_PORT', '<MASTER_PORT unset>')}"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which SLURM and containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launcher() -> dict[str, str]:
    """How this job was started: the launcher and its job identifiers (for provenance)."""
    e = os.environ
    if is_self_launched():
        kind = "self-launch (distributed.nproc_per_node)"
    elif "TORCHELASTIC_RUN_ID" in e:
        kind = "torchrun" + (" in a SLURM job" if "SLURM_JOB_ID" in e else "")
    elif under_submitit():
        kind = "submitit_slurm"
    elif "SLURM_JOB_ID" in e:
        kind = "slurm"
    elif "SUBMITIT_LOCAL_JOB_ID" in e:
        kind = "submitit_local"
    else:
        kind = "python"
    keys = (
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_JOB_NODELIST",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
    )
    return {"kind": kind, **{k: e[k] for k in keys if k in e}}


# This process's parent when it started: a process that runs several jobs (a study worker's trials, a sweep
# under torchrun) asks for its launcher again at each job, after the launcher may have died; its parent by
# then is whoever adopted the orphan, whose death means nothing.
_PARENT_AT_START = os.getppid()


def launcher_pid() -> int | None:
    """The process whose death orphans this rank: torchrun's agent, the self-launch parent, or
    SLURM's step daemon under ``srun`` — this process's parent when it started, in each case. None for a
    process nobody launched (``python train.py``: a closed shell is not a reason to stop), and under an
    ``sbatch`` script without ``srun`` (SLURM ends that whole process tree itself)."""
    e = os.environ
    if is_self_launched():  # the fork server that started this rank sits between (runtime.launch)
        return int(e[SELF_LAUNCHED])
    if "TORCHELASTIC_RUN_ID" in e or "SLURM_STEP_ID" in e:
        return _PARENT_AT_START
    return None


def launcher_gone() -> int | None:
    """The launcher's pid if it has died, else None."""
    pid = launcher_pid()
    return pid if pid is not None and orphaned(pid) else None


def orphaned(launcher: int) -> bool:
    """``launcher`` has died: the kernel re-parented this process (to init or a subreaper) or, for a
    self-launched rank, the fork server between them, which outlives the launcher while its ranks do."""
    parent = os.getppid()
    if parent == launcher:
        return False
    if not is_self_launched():
        return True
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
        return int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher
    # no /proc (not Linux): only a launcher that is the parent is watched
    except (OSError, ValueError, IndexError):
        return False


# How long a launcher waits after forwarding its stop signal before it kills the ranks: torchrun's
# agent closes its workers with a 30 s timeout, Kubernetes' terminationGracePeriodSeconds is 30 s by
# default, SLURM's KillWait too (read from its config: slurm_kill_wait_s). A checkpoint slower than the
# grace is lost on preemption.
LAUNCHER_GRACE_S = 30.0


def launcher_grace_s() -> float | None:
    """The grace a preempted rank has to checkpoint (None: no launcher kills it): torchrun's and the
    self-launcher's 30 s, Kubernetes' default 30 s, SLURM's KillWait; the shortest where several apply."""
    e = os.environ
    graces = [LAUNCHER_GRACE_S] if is_self_launched() or "KUBERNETES_SERVICE_HOST" in e else []
    # torchrun's --shutdown-timeout reaches its ranks only through this variable
    if "TORCHELASTIC_RUN_ID" in e:
        try:
            graces.append(float(e.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", LAUNCHER_GRACE_S)))
        except ValueError:
            graces.append(LAUNCHER_GRACE_S)
    if "SLURM_JOB_ID" in e:
        graces.append(slurm_kill_wait_s())
    return min(graces) if graces else None


@functools.cache
def slurm_kill_wait_s() -> float:
    """SLURM's KillWait, the seconds between a step's SIGTERM and its SIGKILL (``scontrol show config``);
    SLURM's default, 30 s, when it cannot be asked. Read once per process."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return LAUNCHER_GRACE_S
    found = re.search(r"^KillWait\s*=\s*(\d+)", out, re.MULTILINE)
    return float(found.group(1)) if found else LAUNCHER_GRACE_S


def elastic_restart_count() -> int:
    """How often torchrun (--max-restarts) has restarted this worker group (0: first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restarts() -> dict[str, int]:
    """Why this process is not the job's first start: torchrun's restarts and SLURM's requeues
    (``SLURM_RESTART_COUNT``: preemption, time-limit requeue, ``scontrol requeue``); empty if it is."""
    counts = {
        "torchrun restart": elastic_restart_count(),
        "SLURM requeue": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }
    return {k: v for k, v in counts.items() if v > 0}


def under_submitit() -> bool:
    """True inside a job that submitit started on SLURM: submitit owns its requeueing."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def slurm_job() -> str | None:
    """This process's SLURM batch job as ``scontrol requeue`` names it (an array task as
    ``<array job>_<task>``), or None outside one (and under submitit, which requeues its own jobs)."""
    e = os.environ
    if "SLURM_JOB_ID" not in e or e.get("ENVIRONMENT") != "BATCH" or under_submitit():  # salloc: no requeue
        return None
    if "SLURM_ARRAY_JOB_ID" in e and "SLURM_ARRAY_TASK_ID" in e:
        return f"{e['SLURM_ARRAY_JOB_ID']}_{e['SLURM_ARRAY_TASK_ID']}"
    return e["SLURM_JOB_ID"]


def private_dir() -> Path:
    """This user's ddplab directory in the temp dir, created 0700.

    The temp dir is writable by everyone: a file there with a predictable name
    could be planted, or be a symlink that makes a root job overwrite any file.
    So restart state lives only in a directory that is this user's own, is no
    symlink and that nobody else can write; anything else is refused.
    """
    d = Path(tempfile.gettempdir()) / f"ddplab-{os.getuid()}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(
            f"{d} is not a private directory of this user (a symlink, another owner, or open to "
            "others): refusing to keep restart state there. Fix: remove it; ddplab recreates it 0700"
        )
    return d


def run_dir_memo() -> Path | None:
    """Where rank 0 notes its run dir, so a torchrun restart continues in the same dir.

    Keyed by torchrun's run id and the agent's pid: both survive a restart,
    and no two torchrun invocations share them; kept in :func:`private_dir`.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    return private_dir() / f"run-{run_id}-{launcher_pid() or os.getppid()}"


def forget_memo(run_id: str) -> None:
    """The self-launching parent (the ranks' agent), its job over however it ended: no restart will read the
    memo its rank 0 left (a failed job keeps it for torchrun's restarts, which self-launch has no more of)."""
    (private_dir() / f"run-{run_id}-{os.getpid()}").unlink(missing_ok=True)


def write_memo(memo: Path, text: str) -> None:
    """Create-new (never through a symlink), then rename over the memo."""
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, memo)


def read_memo(memo: Path) -> str | None:
    try:
        fd = os.open(memo, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        return f.read()


def use_own_store(init_method: str) -> None:
    """Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes rank 0 a *client* of a store
    it expects torchrun to host on the port of ``init_method``; for anything but
    env:// nobody would answer, so the flag goes."""
    if init_method != "env://":
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def consume_legacy_local_rank(argv: list[str]) -> list[str]:
    """Strip ``--local-rank=N`` / ``--local_rank N`` that torch.distributed.launch appends.

    Hydra would reject them as overrides; the value goes to LOCAL_RANK, where
    torchrun would have put it.
    """
    out, i = [], 0
    while i < len(argv):
        m = re.fullmatch(r"--local[-_]rank(?:=(\d+))?", argv[i])
        if m:
            value = m.group(1)
            if value is None and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            if value is not None:
                os.environ.setdefault("LOCAL_RANK", value)
        else:
            out.append(argv[i])
        i += 1
    return out


def library_default(name: str, value: str) -> None:
    """A library's switch read from the environment (MLflow's HTTP retries and timeout), set where the user
    has not set it: the one place outside the launcher's variables that ddplab writes the environment."""
    os.environ.setdefault(name, value)


def offer_mlflow_credentials(user: str, password: str | None) -> None:
    """MLflow's own credential variables, where the user has not set them: a tracking URI's user info moves
    here so that no URI MLflow holds (and prints) carries it (ddplab.tracking)."""
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", user)
    if password is not None:
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", password)


def mlflow_tracking_uri() -> str | None:
    """MLflow's own MLFLOW_TRACKING_URI, where the user set it (ddplab.sync's fallback)."""
    return os.environ.get("MLFLOW_TRACKING_URI")


def wandb_online_possible() -> bool:
    """W&B has a key (WANDB_API_KEY, ``wandb login``'s ~/.netrc entry) or its mode was chosen (WANDB_MODE):
    wandb.mode=auto lets it go online (ddplab.tracking_wandb)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one netrc cannot read: no key there
        return False
