"""The host allocator of a rank that trains on the CPU: a step's freed blocks kept for the next step.

torch takes CPU tensors from the C library's ``malloc``. glibc's serves a block over its mmap threshold
(128 KiB at first) straight from the kernel and unmaps it on free, and gives the heap's free top back to the
kernel once it exceeds the trim threshold (twice the mmap threshold, which only ever grows to the largest
block freed so far). A training step allocates and frees the same activations every step, so every step the
kernel hands the rank fresh zeroed pages again: 600-1,700 page faults per step per rank for the
language-model benchmark's TinyGPT (``scripts/bench_lm.py``), 5-10 % of its step. Fixing both thresholds
keeps what a step freed in the heap for the next. The price: memory freed between phases (an evaluation's)
is kept, so the peak can be a little higher (+2-4 % measured, docs/performance.md). A block over 32 MiB (a
checkpoint's buffers, a whole dataset) is still mapped and unmapped on its own, so big transient peaks
still go back.

``perf.host_allocator=system`` leaves the C library's defaults. Settings the user made (``MALLOC_*_``
variables, ``GLIBC_TUNABLES``) or another allocator preloaded (jemalloc, tcmalloc, mimalloc) are left alone;
so is a GPU rank (its tensors live in CUDA's caching allocator) and a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import platform

from ddplab.runtime import env

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# glibc's own ceiling for its moving threshold: bigger blocks keep their own mapping
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20  # free heap top kept before it is returned (a step's churn fits many times)
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_done = False  # once per process: a sweep runs many jobs in one


def keep_freed_host_memory(device_type: str, setting: str) -> str:
    """Set glibc's thresholds on a CPU rank (``setting`` ``tuned``); what was done or why not, one phrase."""
    global _done
    if setting == "system":  # glibc's moving defaults cannot be set back once fixed: a sweep over the key
        return (
            "still tuned: an earlier job in this process set the thresholds"
            if _done
            else "system defaults (perf.host_allocator=system)"
        )
    if device_type != "cpu":
        return f"untouched: tensors live on {device_type}"
    why_not = _left_alone()
    if why_not:
        return f"untouched: {why_not}"
    if not _done:
        mallopt = ctypes.CDLL(None).mallopt
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            return "untouched: glibc refused the thresholds"
        _done = True
    return (
        f"freed blocks up to {MMAP_THRESHOLD >> 20} MiB kept for reuse "
        f"(heap top trimmed past {TRIM_THRESHOLD >> 20} MiB)"
    )


def _left_alone() -> str:
    """Why this process's allocator is not ddplab's to set ("" when it is)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    users = env.malloc_settings()
    other = next((a for a in _OTHER_ALLOCATORS if a in users.pop("LD_PRELOAD", "")), None)
    if other:
        return f"{other} is preloaded"
    return f"set by the user ({', '.join(users)})" if users else ""
