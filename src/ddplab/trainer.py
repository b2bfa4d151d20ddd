"""The training loop, in the order of the data flow (see README "How a job runs").

build: data → model (device, SyncBN, DDP) → optimizer/scheduler/precision → resume
loop:  forward under autocast → scaled backward (no_sync while accumulating)
       → unscale → clip → step → device-side metric sums
       every log interval: one collective → rank-0 writer
epoch: exact eval (one collective) → rank-0 checkpoint
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import build, checkpoint, distributed, perf
from ddplab.config import ConfigError
from ddplab.data import (ShardedGlobalSampler, TensorData, TrainLoader, eval_batches, eval_shard, on_device,
                         to_device)
from ddplab.distributed import DistState
from ddplab.metrics import SumMeter, TrainMetrics, make_writer, reduce_eval
from ddplab.precision import Precision
from ddplab.reporting import Progress, hparams_of

log = logging.getLogger("ddplab")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def global_batch_size(cfg: DictConfig, world_size: int) -> int:
    gb = cfg.batch_size * (world_size if cfg.batch_size_scope == "per_rank" else 1)
    if gb % world_size:
        raise ConfigError(
            f"batch_size={cfg.batch_size} (global) does not split evenly over {world_size} ranks. "
            f"Fix: pass batch_size={max(world_size, gb // world_size * world_size)} "
            "or batch_size_scope=per_rank."
        )
    return gb


class Trainer:
    def __init__(self, cfg: DictConfig, state: DistState, run_dir: Path):
        self.cfg, self.state, self.run_dir = cfg, state, run_dir
        self.global_batch = global_batch_size(cfg, state.world_size)
        self.accum = cfg.grad_accum_steps

        # Same seed on every rank here: identical init weights and data order.
        seed_everything(cfg.seed)
        self.data, augment = build.dataset(cfg)
        self.data_on_device = on_device(self.data.train, state.device, cfg.perf.data_on_device)
        if self.data_on_device:
            self.data.train = to_device(self.data.train, state.device)
            if isinstance(self.data.val, TensorData):
                self.data.val = to_device(self.data.val, state.device)
        self.sampler = ShardedGlobalSampler(
            len(self.data.train), self.global_batch, state.world_size, state.rank, cfg.seed, self.accum)
        if self.sampler.steps_per_epoch == 0:
            raise ConfigError(
                f"batch_size={cfg.batch_size} x grad_accum_steps={self.accum} needs "
                f"{self.global_batch * self.accum} samples per optimizer step, but the training set has "
                f"{len(self.data.train)}. Fix: lower batch_size or grad_accum_steps.")
        self.train_loader = TrainLoader(self.data.train, self.sampler, state.device, augment, cfg.perf.num_workers,
                                        cfg.perf.pin_memory, indexed=self.data_on_device)
        self.memory_format = torch.channels_last if cfg.perf.channels_last else None
        self.sharded = cfg.distributed.strategy == "fsdp" and state.is_distributed  # FSDP2: DTensor parameters

        # Unwrapped module: evaluation and checkpoints use it; the step calls the wrapped one.
        self.module = build.prepare_module(build.model(cfg), cfg, state)
        self.model = build.wrap_for_training(self.module, cfg, state)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build.make_optimizer(instantiate(cfg.optimizer, _convert_="all"), self.params,
                                              cfg.perf.fused_optimizer)
        spe = self.sampler.steps_per_epoch
        self.scheduler = instantiate(cfg.scheduler, _convert_="all")(
            self.optimizer, total_steps=spe * cfg.num_epochs, steps_per_epoch=spe)
        self.precision = Precision(cfg.amp, cfg.amp_dtype, state.device)

        self.epoch = 0  # epochs completed
        self.step = 0  # optimizer steps completed
        self.step_in_epoch = 0  # optimizer steps completed in the current epoch
        self._resume_rng: dict[str, Any] | None = None
        self.best: float | None = None
        self.last_val: dict[str, float] = {}
        self._resume()
        self.writer = make_writer(state, str(run_dir / "tb"), purge_step=self.step + 1 if self.step else None)
        self.metrics = TrainMetrics(state, cfg.nonfinite_loss, self.accum, cfg.log_every_n_steps * self.accum)
        self._check_unused = isinstance(self.model, DDP) and not cfg.distributed.find_unused_parameters
        self._flops: float | None | bool = False  # per training sample; counted at the first log step

    # ------------------------------------------------------------- checkpoint
    def _state(self, rng: list[dict[str, Any]]) -> dict[str, Any]:
        weights = {"sharded": self._shard_dir().name} if self.sharded else \
            {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {
            **weights,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.state_dict(),
            "epoch": self.epoch,  # epochs completed
            "step": self.step,  # optimizer steps completed
            "step_in_epoch": self.step_in_epoch,  # position inside the current epoch
            "sampler": {"seed": self.sampler.seed, "epoch": self.epoch,
                        "skip_micro_batches": self.step_in_epoch * self.accum},
            "rng": rng,  # one entry per rank
            "best": self.best,
            "last_val": self.last_val,
            "world_size": self.state.world_size,
            "config": OmegaConf.to_yaml(self.cfg, resolve=True),
        }

    def _shard_dir(self) -> Path:
        return self.run_dir / "checkpoints" / f"step-{self.step:08d}.dcp"

    def _save(self, is_best: bool = False) -> None:
        if self.sharded:  # every rank writes its shards first; the .pt naming them comes after
            checkpoint.save_sharded(self.module, self.optimizer, self._shard_dir())
        # Every rank's random streams, so dropout/augmentation continue exactly.
        rng = distributed.gather_object(checkpoint.rng_state(), self.state)
        if self.state.is_main:
            c = self.cfg.checkpoint
            checkpoint.save(self._state(rng), self.run_dir / "checkpoints", self.step, c.keep_last,
                            is_best and c.save_best)
        distributed.barrier(self.state)  # nobody races ahead of (or reads) a half-written file

    def _resume(self) -> None:
        explicit = self.cfg.resume not in (None, "", "auto")
        found = [str(p) for p in checkpoint.find_resume(self.cfg.resume, self.run_dir)] \
            if self.state.is_main else []
        paths = [Path(p) for p in distributed.broadcast_object(found, self.state)]
        if not paths:
            return
        if explicit:  # the user named it: a bad file is an error, not a fallback
            path, ck = paths[0], checkpoint.load(paths[0], self.state.device)
        else:
            got = checkpoint.load_first_good(paths, self.state.device)
            if got is None:
                raise RuntimeError(f"resume=auto: none of {[str(p) for p in paths]} could be read. "
                                   "Fix: resume=null to start fresh, or resume=<path> to a good checkpoint.")
            path, ck = got
        if self.sharded != ("sharded" in ck):
            raise RuntimeError(f"resume: {path} was saved {'with' if 'sharded' in ck else 'without'} "
                               "distributed=fsdp; resume it with the strategy it was saved with, or resume=null")
        if self.sharded:
            checkpoint.load_sharded(self.module, self.optimizer, path.parent / ck["sharded"])
        else:
            checkpoint.load_model_state(self.module, ck["model"], path)
            self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        self.precision.load_state_dict(ck["scaler"])
        self.epoch, self.step, self.best = ck["epoch"], ck["step"], ck["best"]
        self.step_in_epoch = ck.get("step_in_epoch", 0)
        self.last_val = ck.get("last_val", {})
        rng = ck.get("rng") or []
        if self.step_in_epoch and len(rng) == self.state.world_size:
            self._resume_rng = rng[self.state.rank]
        elif self.step_in_epoch:
            log.warning("resuming mid-epoch on %d rank(s) from a %d-rank checkpoint: same samples in the same "
                        "order, but random layers (dropout) draw new streams", self.state.world_size, len(rng))
        log.info("resumed from %s: %d epoch(s), %d step(s) done", path, self.epoch, self.step)

    def position(self) -> str:
        return f"in epoch {self.epoch + 1}, step {self.step + 1}"

    def _check_unused_parameters(self) -> None:
        """After the first backward only: name parameters that got no gradient.

        Plain DDP waits for every parameter's gradient; one that never comes
        leaves its bucket unreduced, and the next iteration dies with
        "Expected to have finished reduction in the prior iteration" (or the
        step silently uses un-averaged gradients). One flag all-reduce, once.
        """
        unused = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        flag = torch.tensor([float(bool(unused))], device=self.state.device)
        if distributed.all_ranks_rows(flag, self.state).sum().item() == 0:
            return
        names = ", ".join(unused[:10]) + (f" (+{len(unused) - 10} more)" if len(unused) > 10 else "")
        raise RuntimeError(
            f"parameter(s) that received no gradient in the first step: {names or '(on another rank)'}. "
            "DDP needs a gradient for every parameter each step. Fix: distributed.find_unused_parameters=true "
            "(costs a graph traversal per step), or freeze them (requires_grad=False) or remove them.")

    # ------------------------------------------------------------------- loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        self._announce()
        last_train: dict[str, float] = {}
        if self.epoch >= cfg.num_epochs:
            log.info("already finished: %d of %d epochs done, nothing to train", self.epoch, cfg.num_epochs)
        t0 = time.perf_counter()
        stop = cfg.stop_after_epochs or cfg.num_epochs
        while self.epoch < min(cfg.num_epochs, stop):
            last_train = self.run_epoch() or last_train
        if self.best is not None:
            self.writer.scalars({"best/" + cfg.objective: self.best}, self.step)
        self.writer.close()
        out = {**last_train, **self.last_val, "epoch": float(self.epoch), "step": float(self.step),
               "time_s": time.perf_counter() - t0}
        if self.best is not None:
            out["best/" + cfg.objective] = self.best
        return out

    def _announce(self) -> None:
        cfg, st = self.cfg, self.state
        self.writer.text("config", OmegaConf.to_yaml(cfg, resolve=True))
        self.writer.hparams(hparams_of(cfg, self.run_dir, st.world_size),
                            ["val/acc", "val/loss", "train/loss", "best/" + cfg.objective])
        log.info(
            "run dir %s | %d rank(s) on %s (%s) | %s | batch: %d global = %d rank(s) x %d per rank, "
            "x %d accumulation = %d samples per optimizer step | %d steps/epoch, %d epochs",
            self.run_dir, st.world_size, st.device, st.backend or "no process group", self.precision.describe(),
            self.global_batch, st.world_size, self.sampler.per_rank_batch, self.accum,
            self.global_batch * self.accum, self.sampler.steps_per_epoch, cfg.num_epochs)
        log.info("data: %s | model: %s", self.train_loader.describe(), self._describe_model())

    def run_epoch(self) -> dict[str, float]:
        """One epoch: train, evaluate when due, checkpoint. Returns the last logged train metrics."""
        cfg = self.cfg
        last_train = self._train_epoch()
        self.epoch += 1
        self.step_in_epoch = 0
        improved = False
        if self.epoch % cfg.eval_every_n_epochs == 0 or self.epoch == cfg.num_epochs:
            self.last_val = self.evaluate()
            self.writer.scalars({**self.last_val, "train/epoch": self.epoch}, self.step)
            obj = self.last_val.get(cfg.objective)
            if obj is not None and (self.best is None or obj > self.best):
                self.best, improved = obj, True
            log.info("epoch %d/%d  %s", self.epoch, cfg.num_epochs,
                     "  ".join(f"{k}={v:.4g}" for k, v in self.last_val.items()))
        self._save(is_best=improved)
        return last_train

    def _train_epoch(self) -> dict[str, float]:
        cfg, st = self.cfg, self.state
        self.model.train()
        spe = self.sampler.steps_per_epoch
        # New global permutation each epoch; after a mid-epoch resume, skip what was done.
        self.train_loader.set_epoch(self.epoch, skip=self.step_in_epoch * self.accum)
        if self._resume_rng is not None:  # continue the saved streams exactly
            checkpoint.set_rng_state(self._resume_rng)
            self._resume_rng = None
        elif self.step_in_epoch == 0:
            # Per-rank stream for dropout/augmentation: differs between ranks and
            # depends only on (seed, epoch, rank), so a resumed run replays it.
            seed_everything(cfg.seed + 1_000_003 * (self.epoch + 1) + st.rank)
        bar = self._progress_bar()
        reduced: dict[str, float] = {}
        batches = iter(self.train_loader)
        t_step = time.perf_counter()
        every = cfg.checkpoint.every_n_steps
        for _ in range(spe - self.step_in_epoch):
            data_time = 0.0
            for micro in range(self.accum):
                t = time.perf_counter()
                x, y = next(batches)
                x = self._layout(x)
                data_time += time.perf_counter() - t
                # Gradients all-reduce only on the last micro-batch of a step.
                with build.no_grad_sync(self.model) if micro < self.accum - 1 else contextlib.nullcontext():
                    with self.precision.autocast():
                        logits = self.model(x)
                        loss = F.cross_entropy(logits, y)
                    self.precision.backward(loss / self.accum if self.accum > 1 else loss)
                self.metrics.add_micro(loss, logits, y)
            if self._check_unused:
                self._check_unused = False
                self._check_unused_parameters()
            if cfg.nonfinite_loss == "skip" and self._skip_nonfinite_step():
                continue
            norm = self.precision.step(self.optimizer, self.params, cfg.grad_clip)
            if norm is not None:
                self.metrics.add_grad_norm(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            self.step_in_epoch += 1
            now = time.perf_counter()
            self.metrics.add_step(now - t_step, data_time)
            t_step = now
            bar.update(1)
            if self.step % cfg.log_every_n_steps == 0:
                reduced = self._log(bar)
            if every and self.step % every == 0 and self.step_in_epoch < spe:
                if self.metrics.steps:  # a checkpoint closes the log interval: no metrics lost on resume
                    reduced = self._log(bar)
                self._save()
        if self.metrics.steps:  # the epoch's tail since the last log step
            reduced = self._log(bar)
        bar.close()
        return reduced

    def _skip_nonfinite_step(self) -> bool:
        """nonfinite_loss=skip: drop this step on every rank if any rank's loss (any micro-batch) is NaN/Inf."""
        bad = (~torch.isfinite(self.metrics.last_step_losses())).any().float().reshape(1)
        if distributed.all_ranks_rows(bad, self.state).sum().item() == 0:  # sync + collective: skip mode's cost
            return False
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics.skipped += 1
        log.warning("non-finite loss at step %d: step skipped (nonfinite_loss=skip)", self.step + 1)
        return True

    def _log(self, bar: Any) -> dict[str, float]:
        values = self.metrics.reduce(self.position(), self.step)  # the one collective (and host sync) of this interval
        values["train/lr"] = self.optimizer.param_groups[0]["lr"]
        values.update(self._flops_rates(values["perf/samples_per_s"]))
        scale = self.precision.loss_scale()
        if scale is not None:
            values["train/loss_scale"] = scale
            values["train/fp16_skipped_steps"] = self.precision.pop_overflow_steps()  # not errors: the scaler's job
        self.writer.scalars(values, self.step)
        bar.show(self.epoch, self.step, values)
        return values

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs in the model's memory format (NHWC with perf.channels_last; a no-op otherwise)."""
        return x if self.memory_format is None else x.contiguous(memory_format=self.memory_format)

    def _describe_model(self) -> str:
        pf, d = self.cfg.perf, self.cfg.distributed
        parts = [type(self.module).__name__, f"{sum(p.numel() for p in self.params):,} params"]
        parts += ["channels_last"] * pf.channels_last + [f"compiled ({pf.compile_backend})"] * pf.compile
        parts.append("fused optimizer" if self.optimizer.defaults.get("fused") else "unfused optimizer")
        if isinstance(self.model, DDP):
            parts += ["static graph"] * d.static_graph + [f"{d.comm_hook} gradient compression"] * (d.comm_hook != "none")
        return ", ".join(parts)

    def _flops_rates(self, samples_per_s: float) -> dict[str, float]:
        """perf/tflops (model FLOPs the job achieves) and perf/mfu where the device peak is known."""
        if self._flops is False and self.sharded:
            self._flops = None  # a forward outside the step would all-gather out of step with other ranks
        if self._flops is False:  # first log step: off the start-up path
            sample = self.data.train[0][0][None].to(self.state.device)
            sample = self._layout(sample)
            self._flops = perf.train_flops_per_sample(self.module, sample)
            self._peak = perf.peak_tflops(self.state.device, self.precision.dtype, self.cfg.perf.peak_tflops)
        if not self._flops:
            return {}
        out = {"perf/tflops": self._flops * samples_per_s / 1e12}
        if self._peak:
            out["perf/mfu"] = out["perf/tflops"] / (self._peak * self.state.world_size)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        st = self.state
        if st.is_distributed and self.cfg.distributed.broadcast_buffers:
            # Without SyncBN each rank's BN running stats drifted on its own
            # shard; evaluate every shard with rank 0's, the ones checkpointed.
            distributed.broadcast_buffers(self.module, st)
        self.module.eval()
        meter = SumMeter(st.device)
        bs = max(self.sampler.per_rank_batch, 256)
        batches = 0
        x = None
        for x, y in eval_batches(self.data.val, st.world_size, st.rank, bs, st.device):
            x = self._layout(x)
            with self.precision.autocast():
                logits = self.module(x)  # unwrapped: no DDP collectives on uneven shards
                loss = F.cross_entropy(logits.float(), y)
            meter.update(loss, logits, y)
            batches += 1
        if self.sharded:
            # FSDP's forward all-gathers parameters: every rank must run as many as
            # rank 0 (the largest shard). Extra forwards on one sample, results dropped.
            most = math.ceil(len(eval_shard(len(self.data.val), st.world_size, 0)) / bs)
            if x is None:
                x = self.data.val[0][0][None].to(st.device)
            for _ in range(most - batches):
                with self.precision.autocast():
                    self.module(x[:1])
        return reduce_eval(meter, st)

    def _progress_bar(self) -> Progress:
        mode = self.cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "log"
        if not self.state.is_main:
            mode = "none"
        return Progress(mode, self.sampler.steps_per_epoch, self.epoch, self.cfg.num_epochs)
