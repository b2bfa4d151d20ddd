"""Performance guarantees that can be checked on CPU: what runs per step, and the fast paths."""

from __future__ import annotations

import pytest
from helpers.counting import assert_quiet_between_log_steps, count_steps

pytestmark = pytest.mark.dist


def test_no_collectives_or_syncs_on_non_log_steps(tmp_path):
    """Between two optimizer steps that are not log steps: zero collectives, zero host reads.

    Clipping and bf16 autocast are on (both could sneak in a sync), 2 epochs of
    digits on 2 ranks, a log every 5 steps.
    """
    log_every, spe = 5, 22  # 1,437 train digits // global batch 64
    args = [
        "model=mlp",
        "num_epochs=2",
        f"log_every_n_steps={log_every}",
        "grad_clip=1.0",
        "amp=true",
        "amp_dtype=bf16",
        "progress=log",
        "run_dir=run",
    ]  # bf16 asked: auto is fp32 on a CPU without it
    assert_quiet_between_log_steps(count_steps(tmp_path, 2, args), spe, 2, log_every)


# --------------------------------------------------------------- fast paths
import torch  # noqa: E402
from helpers.jobs import assert_ok, compose_cfg, read_scalars, torchrun  # noqa: E402

import ddplab  # noqa: E402


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]


def test_data_on_device_and_dataloader_paths_train_identically(tmp_path, caplog):
    """Same sampler order either way: index-batched tensors == DataLoader (workers, persistent) bitwise."""
    base = ["model=convnet", "num_epochs=2", "progress=none"]
    outs = {}
    for name, extra, path in [
        ("device", ["perf.data_on_device=true"], "in memory on cpu, batched by index"),
        ("loader", ["perf.data_on_device=false"], "DataLoader, 0 worker(s), per-sample"),
        (
            "workers",
            ["perf.data_on_device=false", "perf.num_workers=2"],
            "DataLoader, 2 worker(s), per-sample",
        ),
    ]:
        d = tmp_path / name
        caplog.clear()
        with caplog.at_level("INFO", logger="ddplab"):
            outs[name] = (ddplab.run(compose_cfg(base + extra, run_dir=d)), final_weights(d))
        assert f"data: {path}\n" in caplog.text, name
    ref_metrics, ref_w = outs["device"]
    for name in ("loader", "workers"):
        metrics, w = outs[name]
        assert metrics["val/loss"] == ref_metrics["val/loss"], name
        assert all(torch.equal(w[k], ref_w[k]) for k in ref_w), name


def test_loader_flags_follow_the_config():
    from ddplab.data import ShardedGlobalSampler, TrainLoader, synthetic

    data = synthetic(num_train=64, num_val=8)
    sampler = ShardedGlobalSampler(64, 16, 1, 0, 0)
    cpu = torch.device("cpu")
    assert TrainLoader(data.train, sampler, cpu).indexed  # in memory on its device: no DataLoader
    dl = TrainLoader(
        torch.utils.data.TensorDataset(data.train.x, data.train.y), sampler, cpu, num_workers=2
    )._loader
    # pinning only helps CUDA copies
    assert dl.num_workers == 2 and dl.persistent_workers and not dl.pin_memory


def test_augmentation_runs_batched_on_device_and_resumes_exactly(tmp_path):
    """Random crops + flips drawn from the checkpointed RNG: a resumed run is bitwise the uninterrupted
    one."""
    args = [
        "model=convnet",
        "dataset=synthetic",
        "dataset.num_train=512",
        "dataset.augment.crop_padding=4",
        "dataset.augment.hflip=true",
        "num_epochs=2",
        "batch_size=32",
        "progress=none",
        "checkpoint.every_n_steps=5",
    ]
    full = ddplab.run(compose_cfg(args, run_dir=tmp_path / "full"))
    ddplab.run(compose_cfg(args + ["stop_after_epochs=1"], run_dir=tmp_path / "part"))
    resumed = ddplab.run(compose_cfg(args + ["resume=auto"], run_dir=tmp_path / "part"))
    assert resumed["val/loss"] == full["val/loss"]
    wf, wr = final_weights(tmp_path / "full"), final_weights(tmp_path / "part")
    assert all(torch.equal(wf[k], wr[k]) for k in wf)
    plain = ddplab.run(compose_cfg(args[:3] + args[5:], run_dir=tmp_path / "plain"))
    assert plain["val/loss"] != full["val/loss"]  # augmentation did something


def test_channels_last_fused_and_perf_scalars(tmp_path):
    cfg = compose_cfg(
        ["model=convnet", "num_epochs=1", "progress=none", "perf.channels_last=true", "perf.peak_tflops=0.5"],
        run_dir=tmp_path / "cl",
    )
    out = ddplab.run(cfg)
    ref = ddplab.run(
        compose_cfg(
            ["model=convnet", "num_epochs=1", "progress=none", "perf.fused_optimizer=false"],
            run_dir=tmp_path / "ref",
        )
    )
    assert abs(out["val/loss"] - ref["val/loss"]) < 1e-3  # same training, other kernels
    w = final_weights(tmp_path / "cl")["features.3.weight"]  # (24, 12, 6, 6)
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    s = read_scalars(tmp_path / "cl" / "tb")
    assert s["vitals/tflops"][-1][1] > 0
    assert s["vitals/mfu"][-1][1] == pytest.approx(s["vitals/tflops"][-1][1] / 0.5)
    assert "vitals/mfu" not in read_scalars(tmp_path / "ref" / "tb")  # CPU: peak unknown unless configured


def test_fused_optimizer_choice():
    from functools import partial

    from ddplab.optim import make_optimizer

    params = [torch.nn.Parameter(torch.randn(4, 4))]
    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert make_optimizer(sgd, params, "auto").defaults["fused"] is True
    assert not make_optimizer(sgd, params, "false").defaults.get("fused")

    def no_fused(params, **kw):  # an optimizer without fused kernels
        if "fused" in kw:
            raise TypeError("unexpected keyword argument 'fused'")
        return torch.optim.SGD(params, lr=0.1)

    assert not make_optimizer(no_fused, params, "auto").defaults.get("fused")
    with pytest.raises(ValueError, match="perf.fused_optimizer=true.*Fix: perf.fused_optimizer=auto"):
        make_optimizer(no_fused, params, "true")


def test_flops_counted_for_a_known_model():
    from ddplab.perf import train_flops_per_sample

    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )
    model.train()
    assert train_flops_per_sample(model, torch.randn(5, 1, 8, 8)) == 3 * 2 * (64 * 32 + 32 * 10)
    assert model.training  # left as it was


def test_compile_before_ddp_wrap_with_knobs_on_two_ranks(tmp_path):
    """torch.compile'd module inside DDP, static graph, small buckets, fp16 gradient compression: each
    in effect (DDP's own logging data says so), checkpoints keep the plain module's keys, and it trains."""
    import json

    from helpers.jobs import REPO

    args = [
        "model=mlp",
        "num_epochs=2",
        "progress=none",
        "perf.compile=true",
        "perf.compile_backend=aot_eager",
        "distributed.static_graph=true",
        "distributed.bucket_cap_mb=1",
        "distributed.comm_hook=fp16",
    ]
    proc = torchrun(
        2,
        [str(tmp_path / "run"), *args],
        tmp_path,
        timeout=240,
        script=REPO / "tests" / "workers" / "wrap_worker.py",
    )
    assert_ok(proc)
    r = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert (r["wrapper"], r["inner"]) == ("DistributedDataParallel", "OptimizedModule")  # compile, then wrap
    assert r["compiled_wraps_plain_module"] is True
    assert r["static_graph"] is True and r["bucket_cap_bytes"] == 1024 * 1024
    assert "fp16_compress_hook" in r["comm_hook"]
    assert r["checkpoint_keys"] == r["module_keys"] and r["checkpoint_keys"]
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in r["checkpoint_keys"])
    s = read_scalars(tmp_path / "run" / "tb")
    assert s["val/acc"][-1][1] > 0.85
    assert s["train/loss"][-1][1] < s["train/loss"][0][1] / 2
    bad = torchrun(2, ["model=mlp", "num_epochs=1", "run_dir=bf16", "distributed.comm_hook=bf16"], tmp_path)
    assert bad.returncode != 0 and "distributed.comm_hook=bf16" in bad.stderr + bad.stdout
    assert "Fix: distributed.comm_hook=fp16" in bad.stderr + bad.stdout


def test_inductor_compile_single_process(tmp_path):
    out = ddplab.run(
        compose_cfg(["model=mlp", "num_epochs=1", "progress=none", "perf.compile=true"], run_dir=tmp_path)
    )
    assert out["val/acc"] > 0.8


def test_flop_counting_never_draws_from_the_users_random_streams(tmp_path):
    """A dataset drawing noise from torch's global generator: the FLOP count at the first log step must not
    call it (or draw at all), so the log interval alone leaves the weights bitwise the same."""
    args = [
        "model=mlp",
        "dataset._target_=toy.torch_noisy_digits",
        "num_epochs=1",
        "limit_train_steps=8",
        "progress=none",
    ]
    for every in (1, 5):
        ddplab.run(compose_cfg(args + [f"log_every_n_steps={every}"], run_dir=tmp_path / str(every)))
    a, b = final_weights(tmp_path / "1"), final_weights(tmp_path / "5")
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert read_scalars(tmp_path / "5" / "tb")["vitals/tflops"][-1][1] > 0  # counted, on the batch in hand


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.1),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA A10G", None),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla T4", 65.0),
    ],
)
def test_a_gpus_peak_is_its_own_not_a_namesakes(monkeypatch, name, bf16):
    """vitals/mfu divides by the device's peak: the name matches whole words, so an L40 is not an L4 (1.5x
    off), an A10G not an A10, a PCIe H100 not the SXM one; an unlisted part has none (perf.peak_tflops sets
    it)."""
    from ddplab.perf import peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda"), torch.bfloat16, None) == bf16
