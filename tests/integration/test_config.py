"""Every config option composes and instantiates; bad input fails early, naming the key."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.config import options
from helpers.jobs import assert_ok, compose_cfg, python_train, torchrun

from ddplab import build
from ddplab.config import validate


@pytest.mark.parametrize("dataset", ["digits", "synthetic"])  # in memory; the file readers: test_datasets.py
# The image classifiers; vae and gpt belong to their tasks (tests/integration/test_tasks.py trains each), hf
# to token data (tests/integration/test_hf.py).
@pytest.mark.parametrize(
    "model",
    [
        pytest.param(m, marks=[pytest.mark.slow] if m in ("resnet34", "resnet50") else [])
        # slow: 2 s each
        for m in options("model")
        if m not in ("vae", "gpt", "hf")
    ],
)
def test_model_and_dataset_compose_and_run_a_forward(model, dataset):
    if model == "keras_convnet" and importlib.util.find_spec("keras") is None:
        pytest.skip("keras not installed")
    cfg = compose_cfg(
        [f"model={model}", f"dataset={dataset}", "dataset.num_train=8"]
        if dataset == "synthetic"
        else [f"model={model}", f"dataset={dataset}"]
    )
    validate(cfg)
    data, _ = build.dataset(cfg)
    net = build.model(cfg).eval()
    x, y = data.train.x[:2], data.train.y[:2]
    with torch.no_grad():
        out = net(x)
    assert out.shape == (2, data.num_classes)
    assert torch.isfinite(out).all()
    assert len(data.val) > 0 and y.dtype == torch.int64


@pytest.mark.dist
@pytest.mark.parametrize(
    "override,expect",
    [
        ("optimizer.lrr=0.1", ["optimizer.lrr", "Key 'lrr' not in"]),
        ("num_epochs=abc", ["num_epochs", "could not be converted to Integer"]),
        ("model=resnet19", ["model/resnet19", "resnet18"]),
    ],
)
def test_bad_override_fails_before_any_process_group(tmp_path: Path, override, expect):
    proc = torchrun(2, [override], tmp_path, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for e in expect:
        assert e in out
    # Hydra rejected it while composing: no run dir, no trainer, no process group.
    assert not (tmp_path / "outputs").exists()
    assert "run dir" not in out and "could not join" not in out


@pytest.mark.slow  # real processes: a self-launch of 3 ranks and torchrun's 2
def test_every_rank_trains_on_the_typed_config(tmp_path):
    """Self-launched ranks (the parent's config travels to them) and torchrun's (each composes, then takes
    rank 0's values) hold the config as the schema types it: each node its schema's, an option's too
    (MLPConfig)."""
    import json

    want = {
        "perf": "PerfConfig",
        "checkpoint": "CheckpointConfig",
        "model": "MLPConfig",
        "optimizer": "SGDConfig",
        "(root)": "TrainConfig",
    }
    args = [
        "model=mlp",
        "batch_size=48",
        "num_epochs=1",
        "limit_train_steps=1",
        "progress=none",
        "checkpoint.enabled=false",
        "+callbacks.types._target_=toy.NotesConfigTypes",
    ]
    launch = ["distributed.nproc_per_node=3", "distributed.oversubscribe_cpu=true"]
    assert_ok(python_train(args + launch + [f"hydra.run.dir={tmp_path / 'self'}"], tmp_path))
    assert_ok(torchrun(2, args + [f"hydra.run.dir={tmp_path / 'torchrun'}"], tmp_path))
    seen = {
        f"{d}/{r}": json.loads((tmp_path / d / f"types-{r}.json").read_text())
        for d, n in (("self", 3), ("torchrun", 2))
        for r in range(n)
    }
    assert seen == {k: want for k in seen}, seen
