"""Bring your own task: the shipped examples (vae, regression, lm) and a user's own task, dataset
and collate function from a package outside the repo, with everything classification has —
exact metrics over world sizes, bitwise resume, sweeps, clear errors for bad task output."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.compare import last_weights
from helpers.counting import assert_quiet_between_log_steps, count_steps
from helpers.jobs import (
    REPO,
    TRAIN,
    assert_ok,
    compose_cfg,
    ranks,
    read_scalars,
    run_cmd,
    run_killed_after_step,
    torchrun_cmd,
)

import ddplab
from ddplab.task import TaskError


def assert_close_weights(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        scale = b[k].abs().max().clamp_min(1e-12)
        assert ((a[k] - b[k]).abs().max() / scale).item() <= rel, k


# --------------------------------------------------------------------------- shipped examples
@pytest.mark.dist
def test_vae_logs_both_losses_and_a_reconstruction_grid_at_one_and_two_ranks(tmp_path):
    out = ddplab.run(compose_cfg(["task=vae", "num_epochs=3", "progress=none"], tmp_path / "one"))
    s = read_scalars(tmp_path / "one" / "tb")
    for tag in ("val/loss", "val/recon", "val/kl", "train/recon", "train/kl"):
        assert tag in s, tag
    val = [v for _, v in s["val/loss"]]
    assert val[-1] < val[0] and out["val/loss"] == pytest.approx(out["val/recon"] + out["val/kl"], rel=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "one" / "tb"), size_guidance={"images": 0})
    acc.Reload()
    grids = acc.Images("val/reconstructions")
    assert [g.step for g in grids] == [22, 44, 66] and (grids[0].height, grids[0].width) == (16, 64)

    proc = run_cmd(
        [
            sys.executable,
            str(TRAIN),
            "task=vae",
            "num_epochs=2",
            "distributed.nproc_per_node=2",
            f"hydra.run.dir={tmp_path / 'two'}",
        ],
        tmp_path,
        timeout=240,
    )
    assert_ok(proc)
    two = json.loads((tmp_path / "two" / "result.json").read_text())["metrics"]
    assert two["val/num_samples"] == 359 and two["val/recon"] > 0 and two["val/kl"] > 0


@pytest.mark.dist
def test_regression_is_exact_over_world_sizes_1_2_3_and_minimises_its_objective(tmp_path):
    args = ["task=regression", "num_epochs=4", "objective=val/mae", "progress=none"]
    runs = {}
    for n in (1, 2, 3):
        assert_ok(ranks(n, args + [f"hydra.run.dir={tmp_path / str(n)}"], tmp_path, timeout=240))
        runs[n] = json.loads((tmp_path / str(n) / "result.json").read_text())["metrics"]
    for n in (2, 3):
        assert_close_weights(last_weights(tmp_path / str(n)), last_weights(tmp_path / "1"))
        assert runs[n]["val/num_samples"] == runs[1]["val/num_samples"] == 88  # every val sample once
        for m in ("val/mse", "val/mae", "val/loss"):
            assert runs[n][m] == pytest.approx(runs[1][m], rel=1e-5), (n, m)
    assert runs[1]["val/mse"] < 0.7  # predicting the mean scores 1.0 on standardised targets
    maes = [v for _, v in read_scalars(tmp_path / "1" / "tb")["val/mae"]]
    # an error is minimised (float32 events)
    assert runs[1]["val/mae_best"] == pytest.approx(min(maes), rel=1e-6)


LM = [
    "task=lm",
    "dataset.block_size=32",
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
    "batch_size=16",
    "progress=none",
]


def _text(tmp_path: Path) -> Path:
    from ddplab.data.tabular import generated_corpus

    p = tmp_path / "book.txt"
    p.write_text(generated_corpus(sentences=200))
    return p


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_lm_kill_and_resume_is_bitwise(tmp_path):
    args = LM + [
        f"dataset.path={_text(tmp_path)}",
        "num_epochs=2",
        "model.dropout=0.1",
        "checkpoint.every_n_steps=5",
    ]
    ref = ddplab.run(compose_cfg(args, tmp_path / "ref"))
    assert ref["val/perplexity"] == pytest.approx(math.exp(ref["val/loss"]), rel=1e-12)

    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 13)
    rest = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    a, b = last_weights(tmp_path / "run"), last_weights(tmp_path / "ref")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rest["val/loss"] == ref["val/loss"] and rest["val/perplexity"] == ref["val/perplexity"]


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lm_trains_on_two_ranks(tmp_path, strategy):
    args = LM + [
        f"dataset.path={_text(tmp_path)}",
        "num_epochs=3",
        f"distributed={strategy}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert_ok(run_cmd(torchrun_cmd(2, args), tmp_path, timeout=240))
    s = read_scalars(tmp_path / "run" / "tb")
    ppl = [v for _, v in s["val/perplexity"]]
    assert len(ppl) == 3 and ppl[-1] < ppl[0] < 256  # learning; below a uniform guess over bytes


# --------------------------------------------------------------------------- a user's own task
USER_PKG = '''
"""A user's package: their dataset class, collate function, model and task."""
import torch
from torch import nn
from torch.utils.data import Dataset

from ddplab.task import Task, TaskOutput


class Points(Dataset):
    def __init__(self, n, d, seed):
        g = torch.Generator().manual_seed(seed)
        w = torch.linspace(-1, 1, d)
        self.x = torch.randn(n, d, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "target": self.y[i]}


def collate(samples):
    return {"features": torch.stack([s["features"] for s in samples]),
            "target": torch.stack([s["target"] for s in samples])}


def make_data(n_train=240, n_val=61, d=6, seed=0):
    return {"train": Points(n_train, d, seed), "val": Points(n_val, d, seed + 1), "collate_fn": collate}


class Linear(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


class Fit(Task):
    metric_names = ("sq_err", "abs_err", "within_half")
    maximize = ("within_half",)

    def __call__(self, model, batch):
        err = model(batch["features"]) - batch["target"]
        n = err.shape[0]
        sums = {"sq_err": (err.pow(2).sum(), n), "abs_err": (err.abs().sum(), n),
                "within_half": ((err.abs() < 0.5).sum(), n)}
        return TaskOutput(err.pow(2).mean(), n, sums)
'''

USER_CONF = {
    "task/fit.yaml": """
        # @package _global_
        defaults:
          - override /dataset: points
          - override /model: linear
        task:
          _target_: mytasks.Fit
        objective: val/within_half
        batch_size: 24
        optimizer:
          lr: 0.05
        """,
    "dataset/points.yaml": "_target_: mytasks.make_data\n",
    "model/linear.yaml": "_target_: mytasks.Linear\n",
}


@pytest.fixture
def user_pkg(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A package and a config dir outside the repo, as a user would write them; the env that finds them."""
    pkg = tmp_path / "user"
    (pkg / "mytasks").mkdir(parents=True)
    (pkg / "mytasks" / "__init__.py").write_text(USER_PKG)
    for rel, text in USER_CONF.items():
        (pkg / "conf" / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / "conf" / rel).write_text(textwrap.dedent(text).lstrip())
    return pkg, {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(pkg), str(REPO / "tests"), os.environ.get("PYTHONPATH")])
        )
    }


@pytest.mark.dist
def test_a_user_task_from_their_own_package_is_exact_over_world_sizes_1_2_3(tmp_path, user_pkg):
    pkg, env = user_pkg
    args = ["--config-dir", str(pkg / "conf"), "task=fit", "num_epochs=3", "progress=none"]
    runs = {}
    for n in (1, 2, 3):
        proc = run_cmd(
            torchrun_cmd(n, args + [f"hydra.run.dir={tmp_path / str(n)}"]),
            tmp_path,
            timeout=240,
            extra_env=env,
        )
        assert_ok(proc)
        runs[n] = json.loads((tmp_path / str(n) / "result.json").read_text())["metrics"]
    # a user's Dataset class goes through their collate_fn
    assert "data: DataLoader" in proc.stdout + proc.stderr
    for n in (2, 3):
        assert_close_weights(last_weights(tmp_path / str(n)), last_weights(tmp_path / "1"))
        assert runs[n]["val/num_samples"] == runs[1]["val/num_samples"] == 61
        for m in ("val/sq_err", "val/abs_err", "val/within_half", "train/sq_err"):
            assert runs[n][m] == pytest.approx(runs[1][m], rel=1e-5), (n, m)
    assert runs[1]["val/sq_err"] < 0.1 and runs[1]["val/within_half"] > 0.9  # it learned the linear map
    hits = [v for _, v in read_scalars(tmp_path / "1" / "tb")["val/within_half"]]
    assert runs[1]["val/within_half_best"] == pytest.approx(max(hits), rel=1e-6)  # declared maximize


@pytest.mark.dist
def test_a_user_task_with_three_metrics_adds_no_collective_or_sync_between_log_steps(tmp_path, user_pkg):
    pkg, env = user_pkg
    args = [
        "--config-dir",
        str(pkg / "conf"),
        "task=fit",
        "num_epochs=2",
        "log_every_n_steps=3",
        "progress=log",
        "run_dir=run",
    ]
    # 240 samples / global batch 24 = 10 steps per epoch
    assert_quiet_between_log_steps(count_steps(tmp_path, 2, args, extra_env=env), 10, 2, 3)


@pytest.mark.slow
def test_a_sweep_over_a_task_metric_objective(tmp_path):
    proc = run_cmd(
        [
            sys.executable,
            str(TRAIN),
            "-m",
            "task=regression",
            "objective=val/mae",
            "num_epochs=2",
            "optimizer.lr=0.01,0.02",
            "progress=none",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        tmp_path,
        timeout=240,
    )
    assert_ok(proc)
    for job in ("0", "1"):
        res = json.loads((tmp_path / "sweep" / job / "result.json").read_text())
        assert res["status"] == "completed" and "val/mae_best" in res["metrics"]


@pytest.mark.slow  # 1.4-2.1 s in the inner loop: a second or more, as the marker says
def test_a_nan_from_a_task_names_the_task_and_the_step(tmp_path):
    from ddplab.train.metrics import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"NaN/Inf at step 1 .*task BadTask"):
        ddplab.run(
            compose_cfg(
                [
                    "model=mlp",
                    "num_epochs=1",
                    "progress=none",
                    "task._target_=toy.BadTask",
                    "+task.fault=nonfinite",
                ],
                tmp_path / "r",
            )
        )


# --------------------------------------------------------------------------- bad task output
@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["task._target_=toy.BadTask", "+task.fault=vector_loss"],
            r"BadTask returned a loss of shape \(3,\); it must be a scalar tensor .* Fix: return "
            r"loss.mean\(\)",
        ),
        (
            ["task._target_=toy.BadTask", "+task.fault=zero_count"],
            r"metric 'acc' has count 0 over \d+ samples \(training, .*task BadTask\)",
        ),
        (
            ["dataset._target_=toy.ragged_digits"],
            r"ClassificationTask was given a batch whose tensors disagree on the batch size .*batch\[0\] "
            r"\(64, 1, 8, 8\), "
            r"batch\[1\] \(63,\)",
        ),
    ],
)
def test_bad_task_output_or_batch_is_a_clear_error_naming_the_task(tmp_path, overrides, match):
    with pytest.raises(TaskError, match=match):
        ddplab.run(
            compose_cfg(
                ["model=mlp", "num_epochs=1", "progress=none", "perf.data_on_device=false", *overrides],
                tmp_path / "r",
            )
        )
