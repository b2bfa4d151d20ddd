"""bf16 autocast against fp32 on this CPU, and what `amp=true` picks here.

    python scripts/bench_precision.py
    ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_precision.py   # oneDNN capped: bf16 emulated

One conv + linear forward/backward (batch 64, 3x64x64 input), median of 30 steps after warm-up, one
thread. ddplab's choice (`ddplab.precision.Precision(amp=True, "auto")`) should be bf16 exactly where
bf16 is the faster of the two.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ddplab.precision import Precision


def step_ms(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None, steps: int = 30) -> float:
    times = []
    for i in range(steps + 5):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(x).float().square().mean()
        loss.backward()
        if i >= 5:  # warm-up: oneDNN builds its kernels on the first calls
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 64 * 64, 10)
    )
    x = torch.randn(64, 3, 64, 64)
    fp32, bf16 = step_ms(model, x, None), step_ms(model, x, torch.bfloat16)
    picked = Precision(True, "auto", torch.device("cpu")).describe()
    print(
        f"fp32 {fp32:.1f} ms | bf16 autocast {bf16:.1f} ms ({fp32 / bf16:.2f}x fp32's speed) | amp=true "
        f"picks: {picked}"
    )


if __name__ == "__main__":
    main()
