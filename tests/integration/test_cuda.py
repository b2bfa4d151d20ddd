"""CUDA paths (NCCL, fp16 GradScaler, per-rank devices): run on a GPU machine, skipped elsewhere."""

import pytest
import torch
from helpers.jobs import assert_ok, compose_cfg, job_dirs, read_scalars, torchrun

import ddplab

pytestmark = pytest.mark.slow
cuda = pytest.mark.cuda  # skipped without a GPU (conftest)


@cuda
@pytest.mark.parametrize("dtype,scaler", [("bfloat16", False), ("float16", True)])
def test_amp_on_cuda(tmp_path, dtype, scaler):
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("GPU without bf16")
    cfg = compose_cfg(
        ["model=resnet18", "num_epochs=1", "amp=true", f"amp_dtype={dtype}", "progress=none"],
        run_dir=tmp_path,
    )
    out = ddplab.run(cfg)
    s = read_scalars(tmp_path / "tb")
    assert ("vitals/loss_scale" in s) == scaler  # GradScaler only for fp16
    assert s["vitals/peak_mem_gb"][-1][1] > 0
    assert out["val/num_samples"] == 359


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_ranks_each_on_its_own_gpu(tmp_path):
    proc = torchrun(2, ["model=resnet18", "num_epochs=1", "amp=true", "progress=log"], tmp_path)
    assert_ok(proc)
    assert "2 rank(s) on cuda:0 (nccl)" in proc.stdout + proc.stderr
    assert read_scalars(job_dirs(tmp_path)[0] / "tb")["val/num_samples"][-1][1] == 359


@cuda
def test_no_host_device_syncs_on_non_log_steps_on_cuda(tmp_path):
    """torch.cuda.set_sync_debug_mode catches every sync; none may happen between non-log steps.

    fp16 + GradScaler with the (default) fused optimizer: the scaler hands its
    inf check to the fused kernel instead of reading it on the host each step.
    """
    from helpers.counting import count_steps

    log_every = 5
    args = [
        "model=resnet18",
        "num_epochs=1",
        f"log_every_n_steps={log_every}",
        "grad_clip=1.0",
        "amp=true",
        "amp_dtype=float16",
        "perf.channels_last=true",
        "progress=none",
        "run_dir=run",
    ]
    (steps,) = count_steps(tmp_path, 1, args)
    for k in range(1, len(steps)):
        if k % log_every:
            assert steps[k]["cuda_syncs"] == 0 and steps[k]["syncs"] == 0 and steps[k]["collectives"] == 0, (
                k,
                steps[k],
            )
    assert sum(s["cuda_syncs"] for s in steps) > 0  # the log steps do sync: the detector works


@cuda
def test_profiler_records_a_cuda_memory_snapshot_of_its_steps(tmp_path):
    """callbacks=[profiler] on CUDA: besides the trace, the allocations of its steps as a snapshot that
    torch's viewer (pytorch.org/memory_viz) reads — a pickle with segments and the recorded events."""
    import pickle

    cfg = compose_cfg(
        [
            "model=mlp",
            "num_epochs=1",
            "callbacks=[profiler]",
            "callbacks.profiler.steps=[3,5]",
            "progress=none",
        ],
        run_dir=tmp_path,
    )
    ddplab.run(cfg)
    snap = pickle.loads((tmp_path / "profile" / "memory-rank0.pickle").read_bytes())
    # memory held, allocations recorded
    assert snap["segments"] and any(trace for trace in snap["device_traces"])
    assert any(e["action"] == "alloc" for trace in snap["device_traces"] for e in trace)
    assert (tmp_path / "profile" / "trace-rank0.json").stat().st_size > 0


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dataparallel_replicas_compute_in_the_callers_autocast_dtype():
    """torch runs each DataParallel replica in its own thread under autocast with the default dtype (fp16 on
    CUDA); distributed=dp's wrapper carries the caller's (bf16 here) into them."""
    from ddplab.strategy.local import _DataParallel

    seen: list[torch.dtype] = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(torch.get_autocast_dtype("cuda"))
            return super().forward(x)

    dp = _DataParallel(Probe(8, 8).cuda())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dp(torch.randn(16, 8, device="cuda"))
    assert (
        len(seen) == torch.cuda.device_count()
        and set(seen) == {torch.bfloat16}
        and out.dtype == torch.bfloat16
    )


@cuda
def test_a_resume_on_cuda_leaves_adams_step_counts_on_the_host_and_restores_the_devices_generator(tmp_path):
    """The checkpoint loads onto the CPU: the moments go to the GPU with their parameters, Adam's step counts
    stay on the host as torch keeps them (on the GPU, the per-tensor kernels would sync to read each one every
    step), and the CUDA generator saved is this rank's device's alone; the resumed run equals the straight
    one."""
    import toy
    from helpers.compare import load

    args = ["model=mlp", "optimizer=adamw", "perf.fused_optimizer=false", "progress=none"]  # mlp: dropout 0.1
    straight = ddplab.run(compose_cfg([*args, "num_epochs=2"], run_dir=tmp_path / "straight"))
    ddplab.run(compose_cfg([*args, "num_epochs=2", "stop_after_epochs=1"], run_dir=tmp_path / "r"))
    toy.LOADED.clear()
    resumed = ddplab.run(
        compose_cfg(
            [*args, "num_epochs=2", "resume=auto", "+callbacks.probe._target_=toy.OptimizerStateOnLoad"],
            run_dir=tmp_path / "r",
        )
    )
    assert toy.LOADED == [{"step": {"cpu"}, "exp_avg": {"cuda:0"}}]
    assert isinstance(
        load(tmp_path / "r" / "checkpoints" / "last.pt")["rng"]["ranks"][0]["cuda"], torch.Tensor
    )
    assert resumed["val/loss"] == straight["val/loss"]
