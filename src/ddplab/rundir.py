"""What a run dir holds besides checkpoints and event files, read and written in one place:
where it is, Hydra's record of the overrides, and ``result.json`` (how the job ended)."""

from __future__ import annotations

import atexit
import fcntl
import itertools
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from ddplab import redact

RESULT = "result.json"


def is_multirun(argv: list[str] | None = None) -> bool:
    """Is this a Hydra sweep? ``argv``: before Hydra runs, from the command line (``-m``/``--multirun``);
    without: from the running Hydra job's mode (False outside Hydra)."""
    if argv is not None:
        return "-m" in argv or "--multirun" in argv
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:  # ddplab.run from a script without Hydra
        return False
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def own_run_dir(cfg: Any) -> Path:
    """This process's idea of the run dir: explicit, else Hydra's output dir, else outputs/<date>/<time>."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir).absolute()
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir).absolute()
    return (Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")).absolute()


class RunDirLock:
    """An exclusive lock on a run dir that rank 0 holds for the job's life (``flock`` on
    ``.ddplab.lock``): a second job given the same dir fails at once, naming the holder,
    instead of two jobs overwriting each other's checkpoints. The kernel drops the lock
    when the holder dies, so a killed job never leaves its dir locked."""

    NAME = ".ddplab.lock"

    def __init__(self, run_dir: Path):
        self.path = run_dir / self.NAME
        self._fd: int | None = None
        self.borrowed = False  # held by our launcher on our behalf (self-launch): not ours to release

    def acquire(self, launcher_pid: int | None = None) -> str | None:
        """None once held (or held by ``launcher_pid`` on this host, for this process); else who holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
                os.close(fd)
                self.borrowed = launcher_pid is not None and holder.startswith(
                    f"pid {launcher_pid} on {socket.gethostname()} "
                )
                return None if self.borrowed else holder or "another process"
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder removed the file as we opened it: lock the new one
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)  # before closing: nobody can lock the file we remove
            # a run dir remounted read-only, a stale NFS handle: the lock ends with the fd
            except OSError as e:
                logging.getLogger("ddplab").debug("run dir lock %s left in place: %s", self.path, e)
            finally:
                os.close(self._fd)
                self._fd = None


_held: dict[Path, RunDirLock] = {}


def hold(run_dir: Path) -> str | None:
    """Lock ``run_dir`` (made if missing) for this process until :func:`take_held` hands the lock
    on or the process ends; None once held (or already held here), else who holds it. Taken by the
    Hydra callback (``cli.OwnRunDir``) before Hydra writes a byte there."""
    run_dir = run_dir.absolute()
    if run_dir in _held:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir)
    holder = lock.acquire()
    if holder is None:
        if not _held:
            atexit.register(release_held)  # a job that ends by SystemExit still removes its lock file
        _held[run_dir] = lock
    return holder


def take_held(run_dir: Path) -> RunDirLock | None:
    """The lock this process already holds on ``run_dir`` (now the caller's to release), or None."""
    return _held.pop(run_dir.absolute(), None)


def release_held() -> None:
    while _held:
        _held.popitem()[1].release()


def fresh_dir(path: str) -> str:
    """The first of ``path``, ``path_1``, ``path_2``, ... that did not exist, made by this call.

    Hydra's default run and sweep dirs are named to the second: two runs started in the same second
    from the same directory would share one. ``mkdir`` without ``exist_ok`` is atomic, so each gets its
    own. Registered as the ``fresh_dir`` resolver with caching, so a config resolves it once (Hydra
    copies the cache into each sweep job's config)."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        candidate = base if n == 0 else base.with_name(f"{base.name}_{n}")
        try:
            candidate.mkdir()
            return str(candidate)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def lock_holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock right now (without taking it), or None."""
    try:
        fd = os.open(run_dir / RunDirLock.NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # drops a shared lock taken above


def in_use(run_dir: Path, holder: str, key: str = "hydra.run.dir (or run_dir)") -> str:
    return (
        f"run dir {run_dir} is in use by {holder}: two jobs in one run dir would overwrite each other's "
        f"checkpoints and results. Fix: give this job another {key}, or wait for that job to end"
    )


def is_hydras_default(cfg: Any) -> bool:
    """True when the run dir is the one Hydra made up (outputs/<date>/<time>, multirun/...), not one the
    user (``run_dir=``, ``hydra.run.dir=``, ``hydra.sweep.dir=``) or a torchrun restart named."""
    if cfg.get("run_dir"):
        return False
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    named = ("hydra.run.dir=", "hydra.sweep.dir=")
    return not any(str(o).startswith(named) for o in HydraConfig.get().overrides.hydra)


def read_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides Hydra recorded for this run (``.hydra/overrides.yaml``), or None."""
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return None
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(f)]


def write_result(run_dir: Path, result: dict[str, Any]) -> bool:
    """``run_dir/result.json``: how the job ended (status, metrics or error), written atomically.

    Never raises: it runs while a job ends, often because of the very disk problem that could
    stop it (the error it would hide matters more); a failed write is logged instead.
    """
    result = _keep_measured(read_result(run_dir), result)
    tmp = run_dir / f".{RESULT}.tmp{os.getpid()}"
    try:
        # An error may quote a URI with its password (a study's storage): masked like every line.
        tmp.write_text(redact.text(json.dumps(result, indent=2, default=str), redact.active()))
        os.replace(tmp, run_dir / RESULT)
        return True
    except OSError as e:
        tmp.unlink(missing_ok=True)
        logging.getLogger("ddplab").error("could not write %s: %s", run_dir / RESULT, e)
        return False


def _keep_measured(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """What an earlier invocation measured survives a later one's record: a record without metrics (a
    resume that failed or was refused, a preemption) keeps the last one with metrics under ``previous``;
    metrics of the same step keep the keys this invocation did not measure again."""
    if not old:
        return new
    if "metrics" in new:
        if old.get("metrics") and old["metrics"].get("step") == new["metrics"].get("step"):
            return {**new, "metrics": {**old["metrics"], **new["metrics"]}}
        return new
    earlier = old if old.get("metrics") else old.get("previous")
    return {**new, "previous": earlier} if earlier else new


def read_result(run_dir: Path, since: float | None = None) -> dict[str, Any] | None:
    """``run_dir/result.json`` (None if absent or unreadable); with ``since`` (a ``time.time()``), only
    if it was written at or after then — by this job, not by an earlier run in the same dir."""
    try:
        if since is not None and (run_dir / RESULT).stat().st_mtime < since:
            return None
        return json.loads((run_dir / RESULT).read_text())
    except (OSError, ValueError):
        return None


def swept(run_dir: Path) -> dict[str, str]:
    """What this sweep job's sweep varies, ``{key: value}`` as the job got it; empty outside a sweep.
    A study's trial: its params (``trial.json``).

    A job's overrides (``.hydra/overrides.yaml``) minus those the sweep command passed as they are
    (``../multirun.yaml``, which Hydra's basic sweeper writes), plus the keys a sweeper samples
    (``hydra.sweeper.params``: Optuna's search space, or the basic sweeper's params in config).
    """
    trial = run_dir / "trial.json"  # a study's trial (ddplab.study): its sampled params
    if trial.is_file():
        try:
            return {k: str(v) for k, v in json.loads(trial.read_text()).get("params", {}).items()}
        except (OSError, ValueError):
            return {}
    mine = read_overrides(run_dir)
    if not mine:
        return {}
    from omegaconf import OmegaConf

    def load(f: Path) -> Any:
        return OmegaConf.load(f) if f.is_file() else None

    command, hydra = load(run_dir.parent / "multirun.yaml"), load(run_dir / ".hydra" / "hydra.yaml")
    if hydra is None or str(OmegaConf.select(hydra, "hydra.mode", default="")) != "MULTIRUN":
        return {}
    # Compared as Hydra reads them: a sweep's job gets ``k=http\://h`` for the command's ``k=http://h``, and
    # ``k=False`` for its ``k=false``.
    given = (
        {_meaning(o) for o in OmegaConf.select(command, "hydra.overrides.task", default=None) or []}
        if command
        else set()
    )
    sampled = set(OmegaConf.select(hydra, "hydra.sweeper.params", default=None) or {})
    out = {}
    for o in mine:
        key, _, value = o.lstrip("+~").partition("=")
        if key in sampled or (command is not None and _meaning(o) not in given):
            out[key] = value
    return out


def _meaning(override: str) -> str:
    """An override as Hydra parses it (its type, key and value), or as written where Hydra cannot parse it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        o = OverridesParser.create().parse_override(override)
        return repr((o.type.name, o.key_or_group, o.package, "sweep" if o.is_sweep_override() else o.value()))
    except HydraException:
        return override


def label(values: dict[str, str], limit: int = 100) -> str:
    """A short name for a sweep job's values (``lr=0.1,model=mlp``): keys by their last part where
    that is unambiguous, numbers to 4 significant digits, no path separators."""
    last = [k.rsplit(".", 1)[-1] for k in values]

    def short(v: str) -> str:
        try:
            return v if "." not in v and "e" not in v.lower() else f"{float(v):.4g}"
        except ValueError:
            return v

    keys = [s if last.count(s) == 1 else k for s, k in zip(last, values)]
    text = ",".join(f"{k}={short(v)}" for k, v in zip(keys, values.values())).replace("/", "_")
    return text if len(text) <= limit else text[: limit - 1] + "~"


def events_dir(run_dir: Path) -> Path:
    """Where a run's TensorBoard events go: ``tb``, or in a sweep job a folder named after its swept
    values, so that TensorBoard's run list reads ``0/lr=0.1,model=mlp`` rather than ``0/tb``."""
    return run_dir / (label(swept(run_dir)) or "tb")
