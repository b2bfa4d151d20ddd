"""A rank training on the CPU keeps what a step freed for the next step (ddplab.runtime.allocator): no stream of
page faults per step, the thresholds left alone where they are not ddplab's to set."""

from __future__ import annotations

import pytest

from ddplab.data.tokens import write_tokens
from ddplab.runtime import allocator
from helpers.jobs import assert_ok, python_train, torchrun

# The language-model benchmark's job (scripts/bench_lm.py): TinyGPT, 2 ranks x 32 windows of 64 tokens.
LM = ["task=lm", "dataset=tokens", "dataset.block_size=64", "dataset.vocab_size=256", "model=gpt", "batch_size=64",
      "max_steps=45", "num_epochs=null", "progress=none"]


def _faults_per_step(tmp_path, launcher: str, setting: str) -> list[float]:
    import numpy as np

    write_tokens(np.random.default_rng(0).integers(0, 256, 200_000), tmp_path / "t.bin", "uint16", 256)
    args = LM + [f"dataset.path={tmp_path / 't.bin'}", f"perf.host_allocator={setting}",
                 "+callbacks.pf._target_=toy.CountsPageFaults", f"+callbacks.pf.dir={tmp_path}",
                 f"hydra.run.dir={tmp_path / 'run'}"]
    proc = (python_train(args + ["distributed.nproc_per_node=2"], tmp_path, timeout=180) if launcher == "self"
            else torchrun(2, args, tmp_path, timeout=180))
    assert_ok(proc)
    return [float((tmp_path / f"faults-rank{r}").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("launcher", ["self", "torchrun"])
def test_a_cpu_rank_takes_no_stream_of_page_faults_per_step(tmp_path, launcher):
    """Measured here: 1,270-1,660 faults per step per rank with glibc's defaults (the pages of the activations
    freed at one step's end mapped afresh at the next), 30-170 kept. Steps 10-40: the heap is built by then."""
    faults = _faults_per_step(tmp_path, launcher, "tuned")
    assert max(faults) < 300, faults


@pytest.mark.slow
@pytest.mark.dist
def test_with_the_system_defaults_the_same_steps_fault_their_pages_again(tmp_path):
    """The control: the same job with perf.host_allocator=system, so the bound above says something."""
    faults = _faults_per_step(tmp_path, "torchrun", "system")
    assert min(faults) > 1000, faults


@pytest.mark.parametrize("env, said", [
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "untouched: set by the user (MALLOC_TRIM_THRESHOLD_)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "untouched: set by the user (GLIBC_TUNABLES)"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "untouched: jemalloc is preloaded"),
])
def test_a_users_own_allocator_settings_are_left_alone(monkeypatch, env, said):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert allocator.keep_freed_host_memory("cpu", "tuned") == said


def test_a_gpu_rank_and_the_system_setting_leave_the_c_library_alone():
    assert allocator.keep_freed_host_memory("cuda", "tuned") == "untouched: tensors live on cuda"
    assert allocator.keep_freed_host_memory("cpu", "system") == "system defaults (perf.host_allocator=system)"


def test_a_later_job_in_the_same_process_says_the_thresholds_stay(monkeypatch):
    """A sweep in one process over perf.host_allocator: glibc's moving defaults cannot be set back, and the
    log says so instead of claiming the system defaults."""
    monkeypatch.setattr(allocator, "_done", True)
    assert allocator.keep_freed_host_memory("cpu", "system") == \
        "still tuned: an earlier job in this process set the thresholds"
