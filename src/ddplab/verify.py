"""``mode=verify_resume``: does *this* job resume exactly? Checked on the user's own config.

    python train.py mode=verify_resume <your overrides>     # e.g. num_epochs=2 limit_train_steps=20
    python train.py mode=verify_resume distributed.nproc_per_node=2 verify.resume_nproc=1

Two runs of the job, each in fresh processes, under ``<run dir>/verify_resume/``::

    uninterrupted/   the job from start to end
    resumed/         the same job preempted at step verify.stop_at (SIGUSR1 to rank 0: ddplab's own
                     preemption path, a checkpoint at the agreed step, the processes exit), then the
                     same command with resume=auto, at verify.resume_nproc ranks if set, to the end

then the two final checkpoints are compared entry by entry (weights, optimizer, schedule, data
position, every rank's random streams, callbacks' state) and the two ``train/loss`` histories step by
step. It prints PASS, or the first entry and the first step that differ and what most likely causes
it; ``verify_resume.json`` keeps the details. At the same world size everything must be bit-identical;
at another one the weights may differ in the last bits (sums in another order), the random streams
are per rank, so it checks the data position exactly and the rest to ``verify.rtol``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab import failure, rundir, strategy
from ddplab.checkpoint.compare import first_difference
from ddplab.config import ConfigError, validate
from ddplab.config.typed import typed
from ddplab.errors import VerifyFailed, mark_said
from ddplab.runtime import env
from ddplab.runtime.signals import Preempted
from ddplab.train.callback import Callback

log = logging.getLogger("ddplab")

# The first differing checkpoint entry → what most likely made it differ.
CAUSES = (
    (
        "loop",
        "the data position: the resumed run did not restart at the sample where the first one stopped "
        "(a dataset or sampler whose position ddplab does not see: an iterable without state_dict())",
    ),
    ("rng", "a random stream was not restored: randomness drawn outside the generators ddplab checkpoints"),
    ("callbacks.", "a callback's state_dict() leaves out something it updates"),
    ("scheduler", "the learning-rate schedule's position was not restored"),
    ("optimizer", "the optimizer's state was not restored, or was updated from different gradients"),
    (
        "model",
        "the weights differ though every logged loss agrees: updates the loss does not show yet (the "
        "last steps), or a nondeterministic op (torch.use_deterministic_algorithms(True) names it)",
    ),
)
NOT_REPRODUCIBLE = (
    "the job is not reproducible even without a resume: randomness ddplab neither seeds nor "
    "checkpoints (a generator of your own in a dataset, augmentation or model built without a "
    "seed: np.random.default_rng(), random.Random(), os.urandom, time), or a nondeterministic op "
    "(torch.use_deterministic_algorithms(True) names it)"
)
RESTARTS_FROM_SEED = (
    "state outside the checkpoint restarts on resume: a generator, iterator or counter of your "
    "own (in a dataset, augmentation, model or callback) begins again from its seed. Draw from "
    "torch's generator (ddplab checkpoints it), or give its owner state_dict()/load_state_dict()"
)


WALL_CLOCK = ("vitals/",)  # metric names that measure time, not the trajectory


class Stopped(Preempted):
    """A run verify_resume did not mean to stop was stopped from outside (the cluster preempting the verify
    job): nothing was compared, and neither verdict is said; the job exits as preempted (a SLURM job is
    requeued) and verify_resume, run again, starts both runs from scratch."""

    def __init__(self, what: str, signal_name: str, step: int):
        super().__init__(signal_name, step, None)
        self.args = (
            f"{what} was stopped by {signal_name} from outside at step {step}: nothing was compared. "
            "Fix: run the same command again (verify_resume starts both of its runs from scratch)",
        )
        log.warning("verify_resume: %s", self)
        mark_said(self)  # its one line: the entry that ends the process says nothing more (ddplab.failure)


class PreemptAt(Callback):
    """Rank 0 signals itself SIGUSR1 after optimizer step ``step``: ddplab's own preemption path does the
    rest."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state: Any, step: int) -> None:
        if step == self.step and state.dist.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)


def check(cfg: DictConfig) -> None:
    """What verify_resume cannot run, said before anything starts."""
    if env.is_launched() and not env.is_self_launched():
        raise ConfigError(
            "mode=verify_resume starts fresh processes of its own. Fix: run it as python train.py "
            "mode=verify_resume distributed.nproc_per_node=N, not under torchrun or srun"
        )
    if not strategy.saves_one_file(cfg):
        raise ConfigError(
            f"mode=verify_resume compares one-file checkpoints; distributed.strategy="
            f"{cfg.distributed.strategy} saves shards. Fix: verify with distributed.strategy=ddp (the "
            "same data and RNG paths)"
        )
    if cfg.resume:
        raise ConfigError(
            f"resume={cfg.resume}: mode=verify_resume starts both of its runs from scratch. Fix: drop resume"
        )


def verify_resume(cfg: DictConfig) -> dict[str, float]:
    """Run, compare, report; ``{"verify_resume/pass": 1.0}`` or :class:`VerifyFailed`."""
    validate(cfg)
    check(cfg)
    vdir = rundir.own_run_dir(cfg) / "verify_resume"
    vdir.mkdir(parents=True, exist_ok=True)
    base = _child_config(cfg)
    nproc, later = cfg.distributed.nproc_per_node, cfg.verify.resume_nproc or cfg.distributed.nproc_per_node
    ref = _run_child(base, vdir / "uninterrupted", "the uninterrupted run")
    total = int(ref["metrics"]["step"])
    stop_at = cfg.verify.stop_at or _mid_epoch(total, int(ref["metrics"].get("epoch", cfg.num_epochs)))
    if not 1 <= stop_at < total:
        raise ConfigError(
            f"verify.stop_at={stop_at}: the job has {total} steps. Fix: pass verify.stop_at="
            f"{max(1, total // 2)} (or a longer job)"
        )
    first = _run_child(
        _with_stop(base, stop_at),
        vdir / "resumed",
        f"the run to preempt at step {stop_at}",
        stop_expected=True,
    )
    if first.get("status") != "preempted":
        raise VerifyFailed(
            f"the run meant to stop at step {stop_at} ended {first.get('status')}: the stop came "
            "too late. Fix: a smaller verify.stop_at, or a longer job"
        )
    resumed = _with(base, {"resume": "auto", "distributed.nproc_per_node": later})
    _run_child(resumed, vdir / "resumed", f"the resumed run at {later} rank(s)")
    report = compare(
        vdir / "uninterrupted",
        vdir / "resumed",
        int(first["step"]),
        same_world=later == nproc,
        rtol=cfg.verify.rtol,
        ranks=(nproc, later),
    )
    report.update({"stop_signalled_at": stop_at, "total_steps": total, "nproc": nproc, "resume_nproc": later})
    (vdir / "verify_resume.json").write_text(json.dumps(report, indent=1) + "\n")
    if report["passed"]:
        log.info("verify_resume: PASS: %s", report["summary"])
        return {"verify_resume/pass": 1.0}
    raise VerifyFailed(f"{report['summary']}. Likely cause: {report['cause']}")


def compare(
    ref_dir: Path,
    run_dir: Path,
    stopped_at: int,
    same_world: bool,
    rtol: float,
    ranks: tuple[int, int] = (1, 1),
) -> dict[str, Any]:
    """The two runs' final checkpoints and train/loss histories: where they first differ, and why. ``ranks``:
    the world sizes of the run and of its resumed part, said in the summary (a proof at 1 or 2 ranks says
    nothing of the order in which 3 or more add their gradients)."""
    from ddplab.checkpoint import files
    from ddplab.events import read_scalars

    a, b = (files.load(files.find_resume_path("auto", d)) for d in (ref_dir, run_dir))
    entries = [k for k in a if k != "meta" and (same_world or k != "rng")]
    tol = 0.0 if same_world else rtol
    entry = next(
        (
            d
            for k in entries
            if (
                d := first_difference(
                    _trajectory(a.get(k)), _trajectory(b.get(k)), k, tol if k != "loop" else 0.0
                )
            )
        ),
        None,
    )
    la, lb = (dict(read_scalars(d).get("train/loss", [])) for d in (ref_dir, run_dir))
    steps = sorted(set(la) | set(lb))
    step = next((s for s in steps if not _close(la.get(s), lb.get(s), tol)), None)
    how = (
        "bit-identical"
        if same_world
        else f"equal to rtol={rtol:g} (another world size; RNG streams not compared)"
    )
    world = f"{ranks[0]} rank(s)" if ranks[0] == ranks[1] else f"{ranks[0]} rank(s), resumed at {ranks[1]}"
    where = f"{world}, stopped at step {stopped_at} of {steps[-1] if steps else '?'}"
    if entry is None and step is None:
        return {
            "passed": True,
            "summary": f"{where}, resumed: every checkpoint entry ({', '.join(entries)}) and "
            f"train/loss at all {len(steps)} steps {how}",
        }
    cause = _cause(entry, step, stopped_at)
    loss = (
        f"train/loss first differs at step {step}" if step is not None else "train/loss equal at every step"
    )
    return {
        "passed": False,
        "first_entry": entry,
        "first_step": step,
        "cause": cause,
        "summary": f"FAIL ({where}): first differing checkpoint entry {entry or 'none'}; {loss}",
    }


def _mid_epoch(total: int, epochs: int) -> int:
    """Halfway through the middle epoch: the resume starts mid-epoch and then crosses an epoch's end."""
    per_epoch = max(1, total // max(1, epochs))
    return min(total - 1, (max(1, epochs) - 1) // 2 * per_epoch + max(1, per_epoch // 2))


def _trajectory(value: Any) -> Any:
    """An entry without what the clock measured (``vitals/*``: step times, samples/s), which no resume
    repeats."""
    if isinstance(value, dict):
        return {k: _trajectory(v) for k, v in value.items() if not str(k).startswith(WALL_CLOCK)}
    return value


def _cause(entry: str | None, step: int | None, stopped_at: int) -> str:
    if step is not None and step <= stopped_at:
        return NOT_REPRODUCIBLE
    key = (entry or "").lstrip(".")
    named = next((why for prefix, why in CAUSES if key.startswith(prefix)), None)
    if key.startswith(("model", "optimizer")) or named is None:
        return RESTARTS_FROM_SEED if step is not None else (named or "an entry saved differently")
    return named


def _close(x: float | None, y: float | None, rtol: float) -> bool:
    if x is None or y is None:
        return x is y
    return x == y or (x != x and y != y) or abs(x - y) <= rtol * max(abs(x), abs(y))


def _child_config(cfg: DictConfig) -> dict[str, Any]:
    """The job as a plain config for fresh processes: a training run, a loss logged at every step."""
    job = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    job.pop("hydra", None)
    job.update({"mode": "train", "resume": None, "log_every_n_steps": 1, "progress": "none"})
    job["distributed"]["max_restarts"] = 0
    return job


def _with(job: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(job))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = out
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


def _with_stop(job: dict[str, Any], step: int) -> dict[str, Any]:
    callbacks = {
        **(job.get("callbacks") or {}),
        "verify_stop": {"_target_": f"{__name__}.PreemptAt", "step": step},
    }
    return _with(job, {"callbacks": callbacks})


def _run_child(job: dict[str, Any], run_dir: Path, what: str, stop_expected: bool = False) -> dict[str, Any]:
    """``python -m ddplab.verify`` on ``job`` in ``run_dir``; its result.json. Output in ``run_dir``/../*.log.
    A run stopped from outside (a signal, its launcher's death) that was not meant to stop:
    :class:`Stopped`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job = _with(job, {"run_dir": str(run_dir)})
    refusal = run_dir.parent / f"{run_dir.name}.refused"
    refusal.unlink(missing_ok=True)
    log.info("verify_resume: %s (%s)", what, run_dir)
    started = time.time()
    with open(run_dir.parent / f"{run_dir.name}.log", "a") as out:
        # The config goes on a pipe, never into a file: it holds the real secrets (a tracking URI's password,
        # a redacted key) that the run needs and that nothing may keep.
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(refusal)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            try:
                child.stdin.write(json.dumps(job))
            except BrokenPipeError:  # the leg died at once: its exit code and result say how
                pass
            finally:
                with contextlib.suppress(BrokenPipeError):
                    child.stdin.close()
            code = child.wait()
        except KeyboardInterrupt:  # Ctrl-C reaches the leg too, which stops at a step boundary: wait for it
            try:
                child.wait(timeout=env.LAUNCHER_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            step = (rundir.read_result(run_dir, since=started) or {}).get("step", -1)
            raise Stopped(what, "SIGINT", int(step)) from None
    # The resumed leg reuses the first leg's dir: the result.json left from that leg must not pass for this
    # one's (a leg refused before its Session starts writes none).
    result = rundir.read_result(run_dir, since=started) or {}
    refused = refusal.read_text() if refusal.is_file() else str(result.get("error", ""))
    # the job cannot run as it is (e.g. a stream that differs by rank)
    if refused.startswith("config error: "):
        raise ConfigError(f"{what}: {refused.removeprefix('config error: ')}")
    if result.get("status") == "preempted" and not stop_expected:
        raise Stopped(what, str(result.get("signal", "SIGTERM")), int(result.get("step", -1)))
    if result.get("status") not in ("completed", "preempted"):
        raise VerifyFailed(
            f"{what} failed (exit {code}, {result.get('error', 'no result.json')}): see "
            f"{run_dir.parent / (run_dir.name + '.log')}"
        )
    return result


def _child_main(refusal: str) -> int:
    """A verify_resume run in this fresh process (self-launching its ranks when there are several), its config
    read from stdin; a refusal of it is written to ``refusal`` for the parent to say. A failure ends it as
    ``ddplab.failure`` says (the parent reads the leg's result.json)."""
    from ddplab.job import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = typed(json.loads(sys.stdin.read()), "verify_resume's run")
        train(cfg, search_earlier_runs=False)
    except Exception as e:
        ended = failure.of(e)
        if ended.kind == "config" and ended.record:  # refused, perhaps before its Session could record it
            Path(refusal).write_text(ended.record["error"])  # the parent says it, once
            return ended.code
        failure.leave(ended, e)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
