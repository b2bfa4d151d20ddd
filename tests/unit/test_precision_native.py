"""amp_dtype=auto's choice in-process, from device features faked here and this CPU's own: bf16 only where the
device computes it natively, oneDNN's ISA cap counted; elsewhere fp32 and ONE warning line.

A CPU without AVX512-BF16/AMX (or aarch64's bf16) emulates bf16 autocast: ~2x slower than fp32 with AVX-512,
~40x with AVX2 only (ResNet-18 on digits), so `amp=true` must not silently pick it.
"""

import logging
from pathlib import Path

import pytest
import torch
from helpers.precision_native import AVX512, CPU, EMULATED

import ddplab.precision as precision
from ddplab.precision import Precision


@pytest.fixture
def features(monkeypatch):
    """Pretend the CPU has the given feature flags (the probe, not /proc/cpuinfo)."""

    def set_(flags):
        monkeypatch.setattr(precision, "cpu_features", lambda: frozenset(flags))

    return set_


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "ddplab.precision" and r.levelno == logging.WARNING
    ]


def test_auto_without_native_bf16_trains_fp32_and_says_so_once(features, caplog):
    features(AVX512)
    with caplog.at_level("INFO", logger="ddplab"):
        p = Precision(True, "auto", CPU)
    assert p.dtype == torch.float32 and not p.enabled and p.scaler is None
    assert p.describe() == "fp32 (amp=true: no native bf16 here)"
    assert isinstance(p.autocast(), type(Precision(False, "auto", CPU).autocast()))  # no autocast at all
    [msg] = warnings_of(caplog)
    assert "\n" not in msg
    assert msg == f"amp=true: {EMULATED}, ~2x slower than fp32: training in fp32 (amp_dtype=bf16 forces bf16)"


def test_avx2_only_cpu_names_the_bigger_slowdown(features, caplog):
    features({"avx", "avx2", "fma"})
    with caplog.at_level("INFO", logger="ddplab"):
        assert Precision(True, "auto", CPU).dtype == torch.float32
    [msg] = warnings_of(caplog)
    assert msg.endswith(
        "(no avx512_bf16/amx_bf16), ~40x slower than fp32: training in fp32 (amp_dtype=bf16 forces bf16)"
    )


@pytest.mark.parametrize("asked", ["bf16", "bfloat16"])
def test_explicit_bf16_is_honoured_with_the_same_warning(features, caplog, asked):
    features(AVX512)
    with caplog.at_level("INFO", logger="ddplab"):
        p = Precision(True, asked, CPU)
    assert p.dtype == torch.bfloat16 and p.enabled and p.scaler is None
    assert p.describe() == "amp bfloat16"
    with p.autocast():
        assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.bfloat16  # it does train in bf16
    assert warnings_of(caplog) == [
        f"amp_dtype={asked}: {EMULATED}, ~2x slower than fp32: training in bf16 as asked (auto: fp32)"
    ]


def test_explicit_fp16_on_cpu_is_honoured_with_its_warning(features, caplog):
    features(AVX512)
    with caplog.at_level("INFO", logger="ddplab"):
        p = Precision(True, "fp16", CPU)
    assert p.dtype == torch.float16 and p.scaler is not None and p.describe() == "amp float16 + GradScaler"
    assert warnings_of(caplog) == [
        "amp_dtype=fp16: fp16 autocast on this CPU is emulated (no avx512_fp16/amx_fp16), "
        "~70x slower than fp32: training in fp16 as asked (auto: fp32)"
    ]


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])  # bf16: aarch64's Features name
def test_native_bf16_cpu_keeps_bf16_quietly(features, caplog, flag):
    features(AVX512 | {flag})
    with caplog.at_level("INFO", logger="ddplab"):
        auto, asked = Precision(True, "auto", CPU), Precision(True, "bf16", CPU)
    assert auto.dtype == asked.dtype == torch.bfloat16 and auto.describe() == "amp bfloat16"
    assert warnings_of(caplog) == []


def test_amp_off_never_probes_or_warns(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_features", lambda: pytest.fail("probed with amp=false"))
    with caplog.at_level("INFO", logger="ddplab"):
        assert Precision(False, "bf16", CPU).describe() == "fp32"
    assert warnings_of(caplog) == []


def test_the_real_probe_reads_this_cpu():
    flags = precision.hardware_features()
    assert precision.hardware_features() is flags  # read once per process
    if Path("/proc/cpuinfo").is_file() and "avx2" in Path("/proc/cpuinfo").read_text():
        assert {"avx", "avx2"} <= flags


NATIVE_HW = frozenset({"avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "avx512_fp16"})


@pytest.mark.parametrize(
    "cap,kept",
    [
        ("AVX2", {"avx2", "avx512f"}),  # avx512f: no rule needs it; oneDNN's bf16 and wide paths are all gone
        ("avx512_core", {"avx2", "avx512f", "avx512bw"}),
        ("AVX512_CORE_BF16", {"avx2", "avx512f", "avx512bw", "avx512_bf16"}),
        ("AVX512_CORE_FP16", {"avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16"}),
        ("AVX10_1_512_AMX", NATIVE_HW),
        ("ALL", NATIVE_HW),
        ("DEFAULT", NATIVE_HW),
        (None, NATIVE_HW),
    ],
)
def test_onednns_isa_cap_takes_away_what_it_will_not_use(monkeypatch, cap, kept):
    """ONEDNN_MAX_CPU_ISA=AVX2 on an avx512_bf16 CPU: bf16 autocast of a conv + linear went from 4.6x faster
    than fp32 to 6x slower (issue 32's measurement), so the flag must not count as native any more."""
    monkeypatch.setattr(precision, "hardware_features", lambda: NATIVE_HW)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert precision.cpu_features() == kept


def test_an_avx2_cap_on_a_native_cpu_falls_back_to_fp32_with_the_avx2_figure(monkeypatch, caplog):
    monkeypatch.setattr(precision, "hardware_features", lambda: NATIVE_HW)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # the older name counts too
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with caplog.at_level("INFO", logger="ddplab"):
        assert Precision(True, "auto", CPU).dtype == torch.float32
    assert warnings_of(caplog) == [
        f"amp=true: {EMULATED}, ~40x slower than fp32: training in fp32 (amp_dtype=bf16 forces bf16)"
    ]


@pytest.mark.parametrize("native,auto", [(True, torch.bfloat16), (False, torch.float16)])
def test_cuda_auto_counts_only_native_bf16(monkeypatch, native, auto):
    """torch.cuda.is_bf16_supported() is True on pre-Ampere GPUs too (emulation): only the native answer
    counts."""
    monkeypatch.setattr(precision, "_cuda_native_bf16", lambda: native)
    gpu = torch.device("cuda", 0)
    assert precision._resolve_dtype("auto", gpu) == (auto, None)
    assert precision._resolve_dtype("fp16", gpu) == (torch.float16, None)
    dtype, note = precision._resolve_dtype("bf16", gpu)
    assert dtype == torch.bfloat16
    assert note == (
        None
        if native
        else "amp_dtype=bf16: bf16 autocast on this GPU is emulated (compute capability "
        "< 8.0): training in bf16 as asked (auto: fp16)"
    )


def test_the_cuda_probe_asks_without_emulation():
    assert precision._cuda_native_bf16() is (
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8 or bool(torch.version.hip)
    )
