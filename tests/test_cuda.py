"""CUDA paths (NCCL, fp16 GradScaler, per-rank devices): run on a GPU machine, skipped elsewhere."""

import pytest
import torch

import ddplab
from helpers.jobs import assert_ok, compose_cfg, job_dirs, read_scalars, torchrun

pytestmark = pytest.mark.slow
cuda = pytest.mark.cuda  # skipped without a GPU (conftest)


@cuda
@pytest.mark.parametrize("dtype,scaler", [("bfloat16", False), ("float16", True)])
def test_amp_on_cuda(tmp_path, dtype, scaler):
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("GPU without bf16")
    cfg = compose_cfg(["model=resnet18", "num_epochs=1", "amp=true", f"amp_dtype={dtype}", "progress=none"],
                      run_dir=tmp_path)
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
    args = ["model=resnet18", "num_epochs=1", f"log_every_n_steps={log_every}", "grad_clip=1.0", "amp=true",
            "amp_dtype=float16", "perf.channels_last=true", "progress=none", "run_dir=run"]
    (steps,) = count_steps(tmp_path, 1, args)
    for k in range(1, len(steps)):
        if k % log_every:
            assert steps[k]["cuda_syncs"] == 0 and steps[k]["syncs"] == 0 and steps[k]["collectives"] == 0, (k, steps[k])
    assert sum(s["cuda_syncs"] for s in steps) > 0  # the log steps do sync: the detector works


@cuda
def test_profiler_records_a_cuda_memory_snapshot_of_its_steps(tmp_path):
    """callbacks=[profiler] on CUDA: besides the trace, the allocations of its steps as a snapshot that
    torch's viewer (pytorch.org/memory_viz) reads — a pickle with segments and the recorded events."""
    import pickle

    cfg = compose_cfg(["model=mlp", "num_epochs=1", "callbacks=[profiler]", "callbacks.profiler.steps=[3,5]",
                       "progress=none"], run_dir=tmp_path)
    ddplab.run(cfg)
    snap = pickle.loads((tmp_path / "profile" / "memory-rank0.pickle").read_bytes())
    assert snap["segments"] and any(trace for trace in snap["device_traces"])  # memory held, allocations recorded
    assert any(e["action"] == "alloc" for trace in snap["device_traces"] for e in trace)
    assert (tmp_path / "profile" / "trace-rank0.json").stat().st_size > 0
