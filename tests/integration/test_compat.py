"""ddplab.compat's entries for GradScaler, CUDA memory, the rank server, exit handlers, dynamo, LR schedulers,
torchdata and DDP's buckets, called for real, most in a fork server, a fresh interpreter, loader workers or on
a GPU: when a torch upgrade renames or drops one, the test of that entry fails and names it (rather than a run
failing, or silently degrading, somewhere later). The entries checked in this process:
tests/unit/test_compat.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab import compat


@pytest.mark.slow  # 1.4-2.1 s in the inner loop: a second or more, as the marker says
def test_found_inf_reads_the_flag_unscale_set_per_device():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale((w * torch.tensor([1.0, float("inf"), 1.0])).sum()).backward()
    scaler.unscale_(opt)
    flags = compat.found_inf(scaler, opt)
    assert len(flags) == 1 and flags[0].item() == 1.0  # an inf gradient: the step will be skipped
    opt.zero_grad()
    scaler.update()
    scaler.scale((w * 2).sum()).backward()
    scaler.unscale_(opt)
    assert [f.item() for f in compat.found_inf(scaler, opt)] == [0.0]


@pytest.mark.cuda
def test_cuda_memory_history_records_and_dumps(tmp_path):
    import pickle

    compat.record_cuda_memory_history(True)
    x = torch.ones(1024, device="cuda")
    compat.dump_cuda_memory(str(tmp_path / "snap.pickle"))
    compat.record_cuda_memory_history(False)
    snap = pickle.loads((tmp_path / "snap.pickle").read_bytes())
    assert any(e["action"] == "alloc" for trace in snap["device_traces"] for e in trace), x.shape


def _what_a_fork_of_the_server_has(conn) -> None:
    import signal
    import sys

    conn.send(("colorsys" in sys.modules, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN))


@pytest.mark.slow  # starts a fork server (a process)
def test_rank_server_is_a_server_of_its_own_that_preloads_outlives_stop_signals_and_ends_with_the_launch():
    import multiprocessing
    import os
    import signal
    import time
    from multiprocessing import forkserver

    pids = []
    # each launch its own server: one an earlier launch started holds that launch's environment
    for _ in range(2):
        with compat.rank_server(["colorsys"], (signal.SIGTERM,)) as method:
            assert method == "forkserver"
            pid = forkserver._forkserver._forkserver_pid
            os.kill(pid, signal.SIGTERM)  # a stop signal to the whole process group reaches the server too
            time.sleep(0.3)
            assert open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"  # still serving
            ours, theirs = multiprocessing.Pipe()
            child = multiprocessing.get_context("forkserver").Process(
                target=_what_a_fork_of_the_server_has, args=(theirs,)
            )
            child.start()
            # preloaded; the server's ignoring inherited (a rank sets its own)
            assert ours.recv() == (True, True)
            child.join(30)
            assert child.exitcode == 0
        pids.append(pid)
        with pytest.raises(ProcessLookupError):  # stopped, and reaped, as the launch ended
            os.kill(pid, 0)
    assert pids[0] != pids[1]


@pytest.mark.slow  # a process of its own: the test's own atexit handlers must not run
def test_run_exit_handlers_runs_each_atexit_handler_now_and_once():
    import subprocess
    import sys

    code = (
        "import atexit, os\nfrom ddplab import compat\natexit.register(print, 'ran', flush=True)\n"
        "compat.run_exit_handlers()\ncompat.run_exit_handlers()\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "ran\n"), out.stderr


_TRAIN_A_LITTLE = """
import hashlib, sys, torch
from torch.utils.flop_counter import FlopCounterMode
from ddplab import compat
if sys.argv[1] == "deferred":
    compat.defer_dynamo()
torch.manual_seed(0)
m = torch.nn.Linear(5, 3)
sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
for opt in (sgd, torch.optim.AdamW(m.parameters(), lr=0.01)):
    for _ in range(3):
        m(torch.randn(4, 5)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.is_grad_enabled()  # the step's grad mode is put back
    opt.load_state_dict(opt.state_dict())
with FlopCounterMode(display=False):
    m(torch.randn(1, 5))
weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()
print("dynamo", "torch._dynamo" in sys.modules, weights)
f = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")  # imports dynamo: the marks come off first
zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__
print("compiled", f(torch.zeros(2)).tolist(), getattr(zero_grad, "__dynamo_disable", None) is zero_grad)
"""


@pytest.mark.slow
def test_defer_dynamo_trains_bitwise_as_torch_does_without_importing_its_compiler_until_a_compile(tmp_path):
    """A process that never compiles never imports torch._dynamo (2 s of CPU): optimizer steps, zero_grad,
    state dicts, manual_seed and the FLOP counter train the same weights, bit for bit, as torch's own
    wrappers; a compile afterwards finds torch's wrappers as they were."""
    import subprocess
    import sys

    said = {}
    for mode in ("deferred", "torch"):
        proc = subprocess.run(
            [sys.executable, "-c", _TRAIN_A_LITTLE, mode],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        said[mode] = proc.stdout.split("\n")
    assert said["torch"][0].startswith("dynamo True ")  # what torch does by itself
    assert said["deferred"][0] == said["torch"][0].replace("dynamo True", "dynamo False")  # same weights
    assert said["deferred"][1] == said["torch"][1] == "compiled [0.0, 0.0] False"


_BUILD_A_DDP = """
import os, sys, torch, torch.distributed as dist
from ddplab import compat
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
with compat.ddp_reducer_without_dynamo():
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
print("deferred", "torch._dynamo" in sys.modules, "_dynamo" in torch.__dict__, ddp._use_python_reducer)
import torch._dynamo.utils
print("real", torch._dynamo.utils.get_optimize_ddp_mode() == compat.DDP_MODE_BY_DEFAULT)
with compat.ddp_reducer_without_dynamo():  # dynamo is here now: torch's own answer
    print("after", type(torch._dynamo).__name__)
dist.destroy_process_group()
"""


@pytest.mark.slow  # a process of its own or a model built: seconds
def test_ddp_reducer_without_dynamo_answers_what_dynamos_default_config_does(tmp_path):
    """The stand-in's answer is the real get_optimize_ddp_mode()'s in a process that has not changed dynamo's
    config; a DDP built under it neither imports torch._dynamo nor leaves the stand-in behind."""
    import subprocess
    import sys

    from helpers.jobs import free_port

    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_A_DDP, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:3] == ["deferred False False False", "real True", "after module"]


def test_set_last_lr_is_what_get_last_lr_reports():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    assert sched.get_last_lr() == [0.1]
    compat.set_last_lr(sched, [0.025])
    assert sched.get_last_lr() == [0.025]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_workers_and_stream_state_read_torchdatas_loader_state(workers):
    """torchdata's state layout: the workers a state was saved with, and the request count set to the samples
    consumed (the raw count runs ahead by the requests a worker whose stream ended wasted), leaving the
    loader's own state untouched; a loader restored from it yields the rest."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Numbers(torch.utils.data.IterableDataset):  # worker 1's stream ends after 2 numbers
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            return iter(
                [1, 3] if info and info.id == 1 else [n for n in range(40) if not info or n not in (1, 3)]
            )

    loader = StatefulDataLoader(
        Numbers(), batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None
    )
    it = iter(loader)
    head = [next(it) for _ in range(10)]
    raw = loader.state_dict()
    state = compat.stream_state(raw)
    assert compat.loader_workers(state) == workers
    if workers:
        assert raw["_snapshot"]["_main_snapshot"]["_sampler_iter_yielded"] > 10  # wasted requests counted
        assert state["_snapshot"]["_main_snapshot"]["_sampler_iter_yielded"] == 10
        assert loader.state_dict() == raw  # the loader's own state as it was
    again = StatefulDataLoader(
        Numbers(), batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None
    )
    again.load_state_dict(state)
    assert head + list(again) == list(range(40))


def test_settle_ddp_buckets_gives_ddp_its_final_layout_before_any_step(tmp_path):
    """The layout DDP would rebuild after step 1, last-defined parameters first, fixed at construction: the
    first real backward rebuilds nothing (``has_rebuilt_buckets`` before it, the same layout after it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(
            torch.nn.Linear(300, 300), torch.nn.Linear(300, 1000), torch.nn.Linear(1000, 300)
        )
        ddp = DDP(model, bucket_cap_mb=1)
        assert len(ddp.reducer._get_zeros_like_grad_buckets()) == 1  # DDP's start: one bucket, until step 1
        assert compat.settle_ddp_buckets(ddp) is True
        sizes = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
        assert sizes == [1000 * 300 + 300, 300 * 1000 + 1000, 300 * 300 + 300]  # 1 MiB each, last layer first
        assert all(p.grad is None for p in model.parameters())  # the zeros it reduced are no gradient
        for _ in range(2):  # DDP's logger samples its runtime data from the second iteration on
            ddp(torch.randn(2, 300)).sum().backward()
        data = ddp._get_ddp_logging_data()
        assert (
            data["rebuilt_per_bucket_param_indices"] == "5 4, 3 2, 1 0" and data["has_rebuilt_buckets"] == 1
        )
        assert compat.settle_ddp_buckets(DDP(model, find_unused_parameters=True)) is False  # never rebuilds
    finally:
        dist.destroy_process_group()
