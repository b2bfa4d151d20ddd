"""Shared by tests/unit/test_precision_native.py and tests/integration/test_precision_native.py."""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


AVX512 = frozenset({"avx2", "avx512f", "avx512bw"})  # this machine's kind: AVX-512, no avx512_bf16


EMULATED = "bf16 autocast on this CPU is emulated (no avx512_bf16/amx_bf16)"
