"""CUDA paths (NCCL, fp16 GradScaler, per-rank devices): run on a GPU machine, skipped elsewhere."""

import pytest
import torch

import ddplab
from conftest import assert_ok, compose_cfg, job_dirs, read_scalars, torchrun

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype,scaler", [("bfloat16", False), ("float16", True)])
def test_amp_on_cuda(tmp_path, dtype, scaler):
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("GPU without bf16")
    cfg = compose_cfg(["model=resnet18", "num_epochs=1", "amp=true", f"amp_dtype={dtype}", "progress=none"],
                      run_dir=tmp_path)
    out = ddplab.run(cfg)
    s = read_scalars(tmp_path / "tb")
    assert ("train/loss_scale" in s) == scaler  # GradScaler only for fp16
    assert s["perf/peak_mem_gb"][-1][1] > 0
    assert out["val/num_samples"] == 359


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_ranks_each_on_its_own_gpu(tmp_path):
    proc = torchrun(2, ["model=resnet18", "num_epochs=1", "amp=true", "progress=log"], tmp_path)
    assert_ok(proc)
    assert "2 rank(s) on cuda:0 (nccl)" in proc.stdout + proc.stderr
    assert read_scalars(job_dirs(tmp_path)[0] / "tb")["val/num_samples"][-1][1] == 359
