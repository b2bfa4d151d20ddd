"""Every config option composes, instantiates and runs: each model on each in-memory dataset through a
forward, each optimizer with each scheduler through steps, every rank of a self-launch or torchrun on the
typed config; bad input fails early, naming the key (under torchrun before any process group)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.config import options
from helpers.jobs import assert_ok, compose_cfg, python_train, torchrun
from hydra.utils import instantiate

from ddplab import build
from ddplab.config import ConfigError, validate


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


@pytest.mark.parametrize("optimizer", options("optimizer"))
@pytest.mark.parametrize("scheduler", options("scheduler"))
def test_optimizer_and_scheduler_instantiate_and_step(optimizer, scheduler):
    cfg = compose_cfg([f"optimizer={optimizer}", f"scheduler={scheduler}", "scheduler.warmup_steps=2"])
    p = torch.nn.Parameter(torch.ones(3))
    opt = instantiate(cfg.optimizer, _convert_="all")([p])
    sched = instantiate(cfg.scheduler, _convert_="all")(opt, total_steps=10, steps_per_epoch=5)
    lrs = []
    for _ in range(10):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    base = cfg.optimizer.lr
    assert lrs[0] == pytest.approx(base)  # after warmup step 2 of 2
    assert all(0 <= lr <= base + 1e-12 for lr in lrs)
    if scheduler == "cosine":
        assert lrs[-1] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "override,key",
    [
        ("batch_size=0", "batch_size"),
        ("num_epochs=0", "num_epochs"),
        ("optimizer.lr=-0.1", "optimizer.lr"),
        ("grad_accum_steps=0", "grad_accum_steps"),
        ("grad_clip=-1", "grad_clip"),
        ("distributed.init_method=udp://x", "distributed.init_method"),
        ("log_every_n_steps=0", "log_every_n_steps"),
        ("num_epochs=-1", "num_epochs"),
        ("checkpoint.every_n_steps=-5", "checkpoint.every_n_steps"),
        ("distributed.nproc_per_node=0", "distributed.nproc_per_node"),
        ("+dataset.root=/no/such/dir", "dataset.root"),
        ("perf.data_on_device=maybe", "perf.data_on_device"),
        ("perf.fused_optimizer=yes", "perf.fused_optimizer"),
        ("perf.num_workers=-1", "perf.num_workers"),
        ("perf.prefetch_factor=0", "perf.prefetch_factor"),
        ("perf.peak_tflops=0", "perf.peak_tflops"),
        ("perf.host_allocator=fast", "perf.host_allocator"),
        ("perf.compile=true distributed.bucket_cap_mb=0.5", "distributed.bucket_cap_mb"),
        ("dataset.augment.crop_padding=-2", "dataset.augment.crop_padding"),
        # Values that used to run to the end with a wrong meaning:
        ("dataset.augment.crop_padding=100", "dataset.augment.crop_padding"),  # 8x8 digits: mostly padding
        ("scheduler.min_lr_ratio=-1", "scheduler.min_lr_ratio"),  # a negative lr at the end
        ("scheduler.warmup_steps=-10", "scheduler.warmup_steps"),
        ("scheduler=step scheduler.gamma=0", "scheduler.gamma"),
        ("dataset=synthetic dataset.num_val=0", "dataset.num_val"),  # no validation, no best.pt
        ("seed=99999999999999999999", "seed"),  # was "Overflow when unpacking long long"
        ("objective=train/loss", "objective"),  # best.pt follows validation metrics only
        # Callbacks and tasks are typed too: refused here, before any process group, not while building the
        # job.
        ("callbacks=[ema] callbacks.ema.decay=2", "callbacks.ema.decay"),
        ("callbacks=[early_stopping] callbacks.early_stopping.mode=up", "callbacks.early_stopping.mode"),
        (
            "callbacks=[early_stopping] callbacks.early_stopping.patience=0",
            "callbacks.early_stopping.patience",
        ),
        ("callbacks=[profiler] callbacks.profiler.steps=[5,2]", "callbacks.profiler.steps"),
        ("task=vae task.beta=-1", "task.beta"),
        # was torch's ValueError with a traceback, at build time
        ("model=mlp model.dropout=1.5", "model.dropout"),
        ("task=lm model.dropout=-0.1", "model.dropout"),
    ],
)
def test_out_of_range_values_name_key_and_fix(override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(override.split()))
    assert str(e.value).startswith(f"{key}=") and "Fix:" in str(e.value)


@pytest.mark.parametrize(
    "override,key,options",
    [
        ("amp_dtype=fp8", "amp_dtype", "auto, bfloat16, float16, bf16, fp16"),
        ("distributed.backend=mpx", "distributed.backend", "auto, gloo, nccl, mpi"),
        ("nonfinite_loss=ignore", "nonfinite_loss", "error, skip"),
        ("distributed.comm_hook=int8", "distributed.comm_hook", "none, fp16, bf16"),
        (
            "perf.compile_mode=fast",
            "perf.compile_mode",
            "default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs",
        ),
        ("distributed.strategy=ddpp", "distributed.strategy", "ddp, none, dp, fsdp"),
        ("distributed.device=tpu", "distributed.device", "auto, cpu, cuda"),
        ("batch_size_scope=local", "batch_size_scope", "global, per_rank"),
        ("progress=fancy", "progress", "auto, bar, log, none"),
    ],
)
def test_unknown_choices_fail_while_composing(override, key, options):
    """Choice fields are typed (enums): Hydra rejects an unknown option while composing, naming the
    key and every valid option — before validate, before any process exists."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg([override])
    why = str(e.value.__cause__)
    assert f"full_key: {key}\n" in why and f"expected one of [{options}]" in why, why
