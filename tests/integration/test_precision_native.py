"""train.py with amp, for real: under oneDNN's AVX2 cap (bf16 emulated) amp=true trains fp32 with ONE warning
line, and two ranks with amp_dtype=bf16 say it once; a CPU with native bf16 and no cap trains bf16 without a
warning.

A CPU without AVX512-BF16/AMX (or aarch64's bf16) emulates bf16 autocast: ~2x slower than fp32 with AVX-512,
~40x with AVX2 only (ResNet-18 on digits), so `amp=true` must not silently pick it.
"""

import pytest
from helpers.jobs import assert_ok, job_dirs, python_train, torchrun
from helpers.precision_native import EMULATED

import ddplab.precision as precision

# oneDNN emulates bf16 on any x86 CPU when capped at AVX2, so the fallback runs for real on every machine.
AVX2_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.slow  # runs train.py
def test_train_py_amp_true_without_native_bf16_logs_fp32_and_one_warning(tmp_path):
    proc = python_train(
        ["model=mlp", "num_epochs=1", "amp=true", "progress=log"], tmp_path, extra_env=AVX2_CAP
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert out.count(EMULATED) == 1, out
    [line] = [ln for ln in out.splitlines() if EMULATED in ln]
    assert "WARNING: amp=true: " in line and line.endswith(
        "~40x slower than fp32: training in fp32 (amp_dtype=bf16 forces bf16)"
    )
    assert "| fp32 (amp=true: no native bf16 here) |" in out and "amp bfloat16" not in out
    [run] = job_dirs(tmp_path)
    assert (run / "train.log").read_text().count(EMULATED) == 1  # and once in the job's log


@pytest.mark.dist
def test_two_ranks_say_it_once(tmp_path):
    """A property of the host: rank 0 warns for the job, rank 1 (which logs only warnings) stays quiet."""
    proc = torchrun(
        2,
        ["model=mlp", "num_epochs=1", "limit_train_steps=2", "amp=true", "amp_dtype=bf16", "progress=log"],
        tmp_path,
        timeout=180,
        extra_env=AVX2_CAP,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert out.count(EMULATED) == 1 and "[rank 1]" not in next(
        ln for ln in out.splitlines() if EMULATED in ln
    )
    assert "| amp bfloat16 |" in out


@pytest.mark.slow  # runs train.py
def test_train_py_amp_true_on_a_native_bf16_cpu_trains_bf16_quietly(tmp_path):
    """The other path, for real: without a cap, a CPU with avx512_bf16/amx_bf16 trains in bf16, no warning."""
    if not precision.hardware_features() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("needs a CPU that computes bf16 natively (avx512_bf16/amx_bf16)")
    proc = python_train(
        ["model=mlp", "num_epochs=1", "limit_train_steps=3", "amp=true", "progress=log"],
        tmp_path,
        extra_env={"ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": ""},
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "| amp bfloat16 |" in out and "emulated" not in out
