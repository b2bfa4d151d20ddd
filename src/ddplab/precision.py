"""Mixed precision as one object: autocast context + the backward/step recipe.

scale → backward → unscale → clip → step → update, with a GradScaler only for
float16: bfloat16 has float32's exponent range, so its gradients do not
underflow and scaling would only cost time.

``amp_dtype=auto`` picks a 16-bit dtype only where the device computes it
natively: a CPU without AVX512-BF16/AMX emulates bf16 autocast, slower than
fp32, so auto trains in fp32 there and says so in one warning line.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from ddplab import compat
from ddplab.runtime import env

log = logging.getLogger(__name__)

_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# CPU flags that make a dtype's autocast native: x86 names as in /proc/cpuinfo and torch's probe;
# "bf16" is aarch64's (Features line). Without one, oneDNN emulates the dtype.
_CPU_NATIVE = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
# Emulated step time / fp32 step time, ResNet-18 on digits (batch 32, 1 thread), measured on a Xeon with
# AVX-512 but no avx512_bf16 (oneDNN's AVX-512 bf16 emulation is cheap) and with oneDNN capped at AVX2.
_SLOWDOWN = {
    (torch.bfloat16, True): "~2x",
    (torch.bfloat16, False): "~40x",
    (torch.float16, True): "~70x",
    (torch.float16, False): "~40x",
}


# oneDNN's instruction-set levels, lowest first (its ONEDNN_MAX_CPU_ISA names; the AVX10 names alias the
# AVX512 ones), and the lowest level at which oneDNN uses each flag. A cap below it makes oneDNN emulate
# what the hardware has, so the flag does not count: the cap, not /proc/cpuinfo, decides the speed.
_ISA_LEVELS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
)
_ISA_ALIASES = {
    "AVX512_CORE_FP16": "AVX10_1_512",
    "AVX512_CORE_AMX": "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16",
}
_FLAG_NEEDS = {
    "avx512bw": "AVX512_CORE",
    "avx512_bw": "AVX512_CORE",
    "avx512_bf16": "AVX512_CORE_BF16",
    "avx512_fp16": "AVX10_1_512",
    "amx_bf16": "AVX10_1_512_AMX",
    "amx_fp16": "AVX10_1_512_AMX_FP16",
}


def _under_isa_cap(flags: frozenset[str], cap: str | None) -> frozenset[str]:
    """``flags`` less those oneDNN will not use under ``cap`` (None, ALL, DEFAULT or a name it does not
    know: no cap, as oneDNN itself treats them)."""
    cap = _ISA_ALIASES.get(cap or "", cap)
    if cap not in _ISA_LEVELS:
        return flags
    level = _ISA_LEVELS.index(cap)
    return frozenset(f for f in flags if f not in _FLAG_NEEDS or _ISA_LEVELS.index(_FLAG_NEEDS[f]) <= level)


def cpu_features() -> frozenset[str]:
    """The feature flags oneDNN will use on this CPU: the hardware's (:func:`hardware_features`) less those
    above the ISA oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``). Tests monkeypatch this function."""
    return _under_isa_cap(hardware_features(), env.onednn_isa_cap())


@functools.cache
def hardware_features() -> frozenset[str]:
    """This CPU's feature flags, lower case: /proc/cpuinfo's first processor plus torch's own
    probe (which also works off Linux). Read once per process."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block: every core of a host has the same ISA
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    flags |= set(value.lower().split())
    except OSError:
        pass
    try:  # a private torch API (compat): /proc/cpuinfo above still answers if it vanishes
        flags |= compat.cpu_capability()
    except Exception:
        pass
    return frozenset(flags)


def _cuda_native_bf16() -> bool:
    # including_emulation=False: pre-Ampere GPUs report bf16 "supported" by emulating it, slowly.
    return torch.cuda.is_bf16_supported(including_emulation=False)


def _emulation_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``dtype`` autocast is slow on ``device`` (one line), or None where it is native."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not _cuda_native_bf16():
        return "bf16 autocast on this GPU is emulated (compute capability < 8.0)"
    if device.type != "cpu":
        return None
    feats = cpu_features()
    if feats.intersection(_CPU_NATIVE[dtype]):
        return None
    wide = bool(feats & {"avx512bw", "avx512_bw"})  # oneDNN's emulation is fast with AVX-512 only
    return (
        f"{_SHORT[dtype]} autocast on this CPU is emulated (no {'/'.join(_CPU_NATIVE[dtype][:2])}), "
        f"{_SLOWDOWN[dtype, wide]} slower than fp32"
    )


def _auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if _cuda_native_bf16() else torch.float16  # fp16 tensor cores + GradScaler
    return torch.float32 if _emulation_note(torch.bfloat16, device) else torch.bfloat16


def _resolve_dtype(amp_dtype: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """The autocast dtype (float32: none), and a one-line warning where the device emulates the asked one."""
    name = _ALIASES.get(str(amp_dtype), str(amp_dtype))
    if name == "auto":
        dtype = _auto_dtype(device)
        note = _emulation_note(torch.bfloat16, device) if dtype == torch.float32 else None
        return dtype, note and f"amp=true: {note}: training in fp32 (amp_dtype=bf16 forces bf16)"
    dtype = getattr(torch, name)
    note = _emulation_note(dtype, device)
    auto = _SHORT.get(_auto_dtype(device), "fp32")
    return (
        dtype,
        note and f"amp_dtype={amp_dtype}: {note}: training in {_SHORT[dtype]} as asked (auto: {auto})",
    )


def _warn_from_rank0(msg: str) -> None:
    # A property of the host, the same on every rank: rank 0 says it (other ranks log only warnings).
    others = dist.is_available() and dist.is_initialized() and dist.get_rank() > 0
    log.log(logging.INFO if others else logging.WARNING, msg)


class Precision:
    def __init__(self, amp: bool, amp_dtype: str, device: torch.device):
        self.device = device
        self.dtype, note = _resolve_dtype(amp_dtype, device) if amp else (torch.float32, None)
        self.enabled = self.dtype != torch.float32
        self.fell_back = amp and not self.enabled  # amp=true, but this device would only emulate bf16
        if note:
            _warn_from_rank0(note)
        use_scaler = amp and self.dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type, enabled=use_scaler) if use_scaler else None
        # the schedule counts ddplab's steps, a skipped one too (the same at any world size and
        if use_scaler:
            # on resume); torch warns at the scheduler's first step after the scaler skipped the first update
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        # fp16 steps the scaler skipped (inf/nan gradients): counted on the device, read at log steps.
        self.overflow_steps = torch.zeros((), device=device)

    def describe(self) -> str:
        if not self.enabled:
            return "fp32 (amp=true: no native bf16 here)" if self.fell_back else "fp32"
        return f"amp {str(self.dtype).removeprefix('torch.')}" + (" + GradScaler" if self.scaler else "")

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: the gradients divided back by the loss scale, so clipping sees the real ones (else
        nothing)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step; fp16: skipped when a gradient is inf/nan (counted), and the scale updated."""
        if not self.scaler:
            optimizer.step()
            return
        found = compat.found_inf(self.scaler, optimizer)  # set by unscale_; no sync to read
        self.overflow_steps += sum(f.to(self.overflow_steps.device) for f in found).clamp(max=1)
        self.scaler.step(optimizer)
        self.scaler.update()

    def loss_scale(self) -> float | None:
        """Current fp16 loss scale; a host-device sync, so call it on log steps only."""
        return self.scaler.get_scale() if self.scaler else None

    def pop_overflow_steps(self) -> float | None:
        """fp16 steps skipped since the last call (a host sync: log steps only)."""
        if not self.scaler:
            return None
        n = self.overflow_steps.item()
        self.overflow_steps.zero_()
        return n

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
