"""What a soak trial is and how trials are chosen (scripts/soak.py runs them): drawn from a seed, or the fixed
pairwise plan CI runs, in which every pair of values of two dimensions meets in at least one trial.

The dimensions users combine: the launcher and its world size (1, 2, or 3 ranks, where the order of a sum of
gradients matters), the strategy, the data (digits, a token file or folder of shards, Hugging Face JSONL text
through a BPE tokenizer; held in memory or streamed), the checkpoint mode, the run mode (a training run, a
study worker, verify_resume), the fault (a signal, a full disk, a corrupt checkpoint, the study's storage
lost; its target and phase), the step time, gradient accumulation, and one feature in play (EMA, amp, loader
workers, or training by steps with step evaluations). A plan trial fixes those; everything else (the exact
step time inside its band, epochs, log and checkpoint intervals, the faulting rank, k) still comes from its
seed: ``--only SEED``."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

LAUNCHERS = ("single", "torchrun", "selflaunch")
# ``srun --ntasks=2`` on a SLURM cluster: drawn only where one is up (``scripts/soak.py --slurm``), so not in
# the pairwise plan, which CI runs before its cluster phase.
SLURM = "slurm"
STRATEGIES = ("none", "ddp", "fsdp")
# hf / hf_stream: dataset=hf over local JSONL text files through a BPE tokenizer trained for the soak, held in
# memory or streamed row by row (datasets' streaming, its position in checkpoints).
DATA = ("memory", "stream", "tokens", "shards", "hf", "hf_stream")
# The plan draws a trial's data as two dimensions, where the samples come from and how they are read (held and
# indexed, or streamed with the position checkpointed), so each pairs with every fault in 7 x 3 and 7 x 2
# trials rather than 7 x 6: the six data kinds are the six (source, access) pairs, each in some trial.
SOURCES = ("digits", "tokens", "hf")
ACCESS = ("memory", "stream")
DATA_OF = {
    ("digits", "memory"): "memory",
    ("digits", "stream"): "stream",
    ("tokens", "memory"): "tokens",
    ("tokens", "stream"): "shards",
    ("hf", "memory"): "hf",
    ("hf", "stream"): "hf_stream",
}
SOURCE_ACCESS = {kind: pair for pair, kind in DATA_OF.items()}
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGKILL")
# Faults that are not a signal, made by rank r at its k-th call of the phase: ``disk_full`` fills the file
# system of the run dir (a tmpfs; freed before the resume), ``bad_file`` kills the job and the driver
# truncates its newest checkpoint before the resume (bit rot, a half-copied file), ``storage_loss`` deletes a
# study's SQLite storage.
OTHER_FAULTS = ("disk_full", "bad_file", "storage_loss")
FAULTS = SIGNALS + OTHER_FAULTS
MODES = ("train", "study", "verify_resume")
TARGETS = ("self", "peer", "launcher", "all")
PHASES = ("data", "forward", "backward", "between", "optimizer", "evaluation", "checkpoint")
# The plan's phase dimension: where in the job the fault lands, the phase inside a group drawn from the seed
# (7 phases would make the plan 7 x 4 trials at least; the groups keep it inside CI's budget).
PHASE_GROUPS = {
    "input": ("data", "between"),
    "step": ("forward", "backward", "optimizer"),
    "evaluation": ("evaluation",),
    "checkpoint": ("checkpoint",),
}
# One feature in play beside the rest: its overrides (Trial.overrides). "steps": the run's length in optimizer
# steps (num_epochs=null max_steps) with evaluations every half epoch, mid-epoch; "workers": 2 loader workers.
FEATURES = ("plain", "ema", "amp", "workers", "steps")
WORLDS = (1, 2, 3)
# The tracker beside TensorBoard: none; MLflow (logger=[tensorboard,mlflow]) whose server is drawn from the
# trial's seed: "up" all along (its run must then hold TensorBoard's scalars, each step once), "down" from the
# start (nothing listens), or "killed" by the fault as it fires and never back (training goes on regardless);
# or W&B offline (logger=[tensorboard,wandb]): its client process beside the job through the fault and every
# resume, its files holding TensorBoard's scalars, each step once.
TRACKING = ("none", "mlflow", "wandb")
SERVER_STATES = ("up", "down", "killed")
# a training step's seconds, log-uniform
TIMINGS = {"fast": (1e-3, 1e-2), "mid": (1e-2, 0.3), "slow": (0.3, 4.0)}
ANY_STEP = (1e-3, 4.0)
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "launcher": LAUNCHERS,
    "strategy": STRATEGIES,
    "source": SOURCES,
    "access": ACCESS,
    "checkpoint": ("sync", "async"),
    "fault": FAULTS,
    "target": TARGETS,
    "phase": tuple(PHASE_GROUPS),
    "timing": tuple(TIMINGS),
    "accum": (1, 2, 3),
    "mode": MODES,
    "world": WORLDS,
    "feature": FEATURES,
    "tracking": TRACKING,
}
TRAIN_SAMPLES, BATCH = 1438, 32  # digits' fixed split (the token file is made as long); global batch 32
BATCH_3 = 48  # on 3 ranks: 32 does not split
VAL_SAMPLES = {"memory": 359, "stream": 359, "tokens": 160, "shards": 160, "hf": 160, "hf_stream": 160}
TOKEN_BLOCK, TOKEN_WINDOWS = 16, 1600  # the token file: 1600 windows, the last 10% validation
HF_VOCAB = 320  # the soak's BPE: as many ids as it learns from the generated corpus, at most this
DIGITS = ["model=mlp", "model._target_=soak_toy.SoakMLP"]
PARTS = {
    "memory": DIGITS + ["dataset._target_=soak_toy.soak_digits"],
    "stream": DIGITS + ["dataset._target_=soak_toy.soak_stream"],
    "tokens": [
        "task=lm",
        "dataset=tokens",
        "dataset._target_=soak_toy.soak_tokens",
        f"dataset.block_size={TOKEN_BLOCK}",
        "model._target_=soak_toy.SoakGPT",
        "model.n_layer=1",
        "model.n_embd=32",
    ],
    "shards": [
        "task=lm",
        "dataset=token_shards",
        "dataset._target_=soak_toy.soak_shards",
        f"dataset.block_size={TOKEN_BLOCK}",
        "model._target_=soak_toy.SoakGPT",
        "model.n_layer=1",
        "model.n_embd=32",
    ],
    "hf": [
        "task=lm",
        "dataset=hf",
        "dataset._target_=soak_toy.soak_hf",
        f"dataset.block_size={TOKEN_BLOCK}",
        "model._target_=soak_toy.SoakGPT",
        "model.n_layer=1",
        "model.n_embd=32",
    ],
}
PARTS["hf_stream"] = PARTS["hf"] + ["dataset.streaming=true"]
# mode=study: two trials of the digits study's space (lr, weight decay; the sampler seeded per trial number),
# no pruner; the objective one every task logs. The trials' dir is the trial's run dir (scripts/soak.py:
# command).
STUDY = ["hparams_search=study", "study.n_trials=2", "study.pruner=null", "objective=val/loss"]
COMMON = ["+callbacks.soak._target_=soak_toy.SoakCallback", "progress=log"]


@dataclasses.dataclass
class Trial:
    seed: int
    launcher: str
    step_s: float
    epochs: int
    steps_per_epoch: int
    accum: int
    log_every: int
    every_n: int
    fault: str  # a signal's name or one of OTHER_FAULTS
    target: str
    rank: int
    phase: str
    k: int
    long: bool = False
    async_save: bool = False  # checkpoint.async_save: the fault may meet a background write in flight
    strategy: str = "none"
    data: str = "memory"
    plan_seed: int | None = None  # a pairwise plan trial: the --seed its plan was run with
    token_file: str = "tokens.bin"  # data=tokens: the file the driver wrote (scripts/soak.py: token_file)
    # data=shards: the folder of token files (train/*.bin, val.bin) the driver wrote
    shard_dir: str = "shards"
    # data=hf/hf_stream: train.jsonl, val.jsonl and tokenizer.json (scripts/soak.py: hf_dir)
    hf_dir: str = "hf"
    mode: str = "train"
    slurm: bool = False  # drawn with SLURM among the launchers (--slurm): its seed's draws depend on it
    # a multi-process launcher's world size (3: torchrun or srun only; self-launch refuses more
    ranks: int = 2
    # ranks than cores)
    feature: str = "plain"
    tracking: str = "none"
    server: str = "up"  # tracking=mlflow: the server's state (SERVER_STATES)
    tracking_uri: str = ""  # tracking=mlflow: the server's URI, set by the driver (scripts/soak.py)
    server_pid: int = 0  # server=killed: the trial's own server (its process group), which the fault kills

    @property
    def signal(self) -> str:
        """The signal the fault sends in the job: a signal fault's own; SIGKILL for bad_file (the job dies,
        then its newest checkpoint is spoilt); none for disk_full and storage_loss (the job meets them
        itself)."""
        return self.fault if self.fault in SIGNALS else "SIGKILL" if self.fault == "bad_file" else ""

    @property
    def world(self) -> int:
        return 1 if self.launcher == "single" else self.ranks

    @property
    def batch(self) -> int:
        return BATCH_3 if self.world == 3 else BATCH

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def eval_every(self) -> int:
        """feature=steps: evaluations every half epoch (and at the run's last step)."""
        return max(1, self.steps_per_epoch // 2)

    def feature_overrides(self) -> list[str]:
        length = (
            [f"num_epochs={self.epochs}"]
            if self.feature != "steps"
            else ["num_epochs=null", f"max_steps={self.total_steps}", f"eval_every_n_steps={self.eval_every}"]
        )
        return (
            length
            + {
                "plain": [],
                "steps": [],
                "ema": ["callbacks=[ema]"],
                "amp": ["amp=true"],
                "workers": ["perf.num_workers=2"],
            }[self.feature]
        )

    @property
    def eval_s(self) -> float:
        return min(self.step_s, 2.0)

    def overrides(self) -> list[str]:
        data = {
            "tokens": [f"dataset.path={self.token_file}"],
            "shards": [f"dataset.path={self.shard_dir}/train", f"dataset.val_path={self.shard_dir}/val.bin"],
        }
        for kind in ("hf", "hf_stream"):
            data[kind] = [
                f"dataset.path={self.hf_dir}/train.jsonl",
                f"dataset.val_path={self.hf_dir}/val.jsonl",
                f"dataset.tokenizer={self.hf_dir}/tokenizer.json",
                f"dataset.vocab_size={HF_VOCAB}",
            ]
        return (
            PARTS[self.data]
            + data.get(self.data, [])
            + COMMON
            + [f"mode={self.mode}"] * (self.mode != "train")
            + [
                *(STUDY if self.mode == "study" else []),
                f"batch_size={self.batch}",
                *self.feature_overrides(),
                f"distributed={self.strategy}",
                f"limit_train_steps={self.steps_per_epoch}",
                f"grad_accum_steps={self.accum}",
                f"log_every_n_steps={self.log_every}",
                f"checkpoint.every_n_steps={self.every_n}",
                f"checkpoint.async_save={self.async_save}",
                *(
                    ["logger=[tensorboard,mlflow]", f"mlflow.tracking_uri={self.tracking_uri}"]
                    if self.tracking == "mlflow"
                    else []
                ),
                *(["logger=[tensorboard,wandb]", "wandb.mode=offline"] if self.tracking == "wandb" else []),
            ]
        )

    def label(self) -> str:
        return (
            f"{self.launcher:10s}x{self.world} {self.strategy:4s} {self.data:6s} {self.mode:13s} "
            f"{self.feature:7s} "
            f"{self.fault:>12s}->{self.target}@{self.phase}"
            f"#{self.k} rank {self.rank} step {self.step_s * 1e3:.0f}ms "
            f"x{self.epochs}x{self.steps_per_epoch} "
            f"accum {self.accum} log {self.log_every} ckpt "
            f"{self.every_n}{' async' if self.async_save else ''}"
            f"{f' mlflow {self.server}' if self.tracking == 'mlflow' else ''}"
            f"{' wandb' if self.tracking == 'wandb' else ''}"
        )

    def rerun(self) -> str:
        """The command that runs this trial again, exactly."""
        plan = f" --pairwise --seed {self.plan_seed}" if self.plan_seed is not None else ""
        flags = (" --long" if self.long else "") + (" --slurm" if self.slurm else "")
        return f"python scripts/soak.py{plan} --only {self.seed}{flags} --keep"


def calls(t: Trial) -> list[int]:
    """The values of k at which rank t.rank makes that call in an uninterrupted run (per process)."""
    steps = t.epochs * t.steps_per_epoch
    micro = range(1, steps * t.accum + 1)
    mid_saves = [s for s in range(1, steps + 1) if t.every_n and s % t.every_n == 0 and s % t.steps_per_epoch]
    evals = (
        t.epochs
        if t.feature != "steps"
        else len({s for s in range(1, steps + 1) if s % t.eval_every == 0} | {steps})
    )
    return {
        "data": [k for k in micro if (k - 1) % t.accum == 0],
        "between": [k for k in micro if (k - 1) % t.accum],
        "forward": list(micro),
        "backward": list(micro),
        "optimizer": list(range(1, steps + 1)),
        # eval batches of max(per-rank batch, 256) over this rank's shard
        "evaluation": list(range(1, evals * math.ceil(math.ceil(VAL_SAMPLES[t.data] / t.world) / 256) + 1)),
        "checkpoint": list(range(1, t.epochs + len(mid_saves) + 1)),
    }[t.phase]  # epoch ends, every_n saves


def dimensions(t: Trial) -> dict[str, Any]:
    timing = next(name for name, (lo, hi) in TIMINGS.items() if lo <= t.step_s <= hi)
    return {
        "launcher": t.launcher,
        "strategy": t.strategy,
        "source": SOURCE_ACCESS[t.data][0],
        "access": SOURCE_ACCESS[t.data][1],
        "checkpoint": "async" if t.async_save else "sync",
        "fault": t.fault,
        "target": t.target,
        "phase": next(g for g, ps in PHASE_GROUPS.items() if t.phase in ps),
        "timing": timing,
        "accum": t.accum,
        "mode": t.mode,
        "world": t.world,
        "feature": t.feature,
        "tracking": t.tracking,
    }


# ------------------------------------------------------------------------------------------ the pairwise plan
def allowed(a: str, va: Any, b: str, vb: Any) -> bool:
    """One pair's constraint. Stated pairwise and closed (strategy none also implies target self), so any set
    of values whose every pair is allowed extends to a whole trial."""
    v = {a: va, b: vb}
    if {"launcher", "strategy"} == v.keys():
        return (v["launcher"] == "single") == (v["strategy"] == "none")  # one process: no process group
    if {"launcher", "target"} == v.keys() or {"strategy", "target"} == v.keys():
        return (
            v["target"] == "self" or v.get("launcher", "torchrun") != "single" and v.get("strategy") != "none"
        )
    if {"fault", "target"} == v.keys():  # a fault not a signal is made by the rank that meets it
        return v["fault"] in SIGNALS or v["target"] == "self"
    if {"fault", "mode"} == v.keys() and v["fault"] == "storage_loss":
        return v["mode"] == "study"  # only a study has a storage
    # 3 ranks: torchrun (or srun) only; self-launch refuses more than cores
    if {"launcher", "world"} == v.keys():
        return (v["launcher"] == "single") == (v["world"] == 1) and (
            v["world"] < 3 or v["launcher"] == "torchrun"
        )
    if {"strategy", "world"} == v.keys():
        return (v["strategy"] == "none") == (v["world"] == 1)
    if {"target", "world"} == v.keys():
        return v["target"] == "self" or v["world"] > 1
    if {"feature", "phase"} == v.keys():
        # loader workers collate in their own processes (a fetch fault would fire there); training by steps
        # saves at its own cadence (the checkpoint calls counted here are epoch ends)
        return not (
            v["feature"] == "workers"
            and v["phase"] == "input"
            or v["feature"] == "steps"
            and v["phase"] == "checkpoint"
        )
    if "mode" in v and v["mode"] == "verify_resume":
        # verify_resume starts its own processes (not under torchrun or srun), compares one-file checkpoints
        # (not FSDP's shards) and runs both legs from scratch (no checkpoint of its own for bad_file to spoil)
        return (
            v.get("launcher") not in ("torchrun", SLURM)
            and v.get("strategy") != "fsdp"
            and v.get("fault") != "bad_file"
            and v.get("world") != 3
        )
    return True


def valid(trial: dict[str, Any]) -> bool:
    """Every pair of the (possibly partial) trial's values allowed."""
    return all(allowed(a, trial[a], b, trial[b]) for a, b in itertools.combinations(trial, 2))
