"""What ddplab.runtime.allocator does to the C library's malloc thresholds, and says, in-process: a user's own
settings (MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES, a preloaded jemalloc), a GPU rank and
perf.host_allocator=system leave them alone; a later job in the same process says an earlier job's tuning
stays (glibc's moving defaults cannot be set back)."""

from __future__ import annotations

import pytest

from ddplab.runtime import allocator


@pytest.mark.parametrize(
    "env, said",
    [
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "untouched: set by the user (MALLOC_TRIM_THRESHOLD_)"),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
            "untouched: set by the user (GLIBC_TUNABLES)",
        ),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "untouched: jemalloc is preloaded"),
    ],
)
def test_a_users_own_allocator_settings_are_left_alone(monkeypatch, env, said):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert allocator.keep_freed_host_memory("cpu", "tuned") == said


def test_a_gpu_rank_and_the_system_setting_leave_the_c_library_alone(monkeypatch):
    monkeypatch.setattr(
        allocator, "_done", False
    )  # a process no earlier job tuned (the worker may have run one)
    assert allocator.keep_freed_host_memory("cuda", "tuned") == "untouched: tensors live on cuda"
    assert allocator.keep_freed_host_memory("cpu", "system") == "system defaults (perf.host_allocator=system)"


def test_a_later_job_in_the_same_process_says_the_thresholds_stay(monkeypatch):
    """A sweep in one process over perf.host_allocator: glibc's moving defaults cannot be set back, and the
    log says so instead of claiming the system defaults."""
    monkeypatch.setattr(allocator, "_done", True)
    assert (
        allocator.keep_freed_host_memory("cpu", "system")
        == "still tuned: an earlier job in this process set the thresholds"
    )
