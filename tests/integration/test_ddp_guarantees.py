"""What ddplab guarantees under DDP (docs/guarantees.md) for the job as a whole: exactness across world sizes,
an unused parameter named at the first step, uneven or too little data, and the ways ranks are launched and
meet (torch.distributed.launch, init methods, two nodes).

Each test runs real processes (gloo on CPU) and asserts numbers.
"""

import re
import subprocess
import sys
import time

import pytest
import torch
from helpers.compare import max_rel_weight_diff
from helpers.jobs import (
    TRAIN,
    assert_ok,
    compose_cfg,
    free_port,
    job_dirs,
    ranks,
    read_scalars,
    run_cmd,
    start,
    torchrun,
)

pytestmark = pytest.mark.dist


# --------------------------------------------------------------- exactness
EXACT = [
    "model=convnet",
    "model.dropout=0",
    "distributed.sync_batchnorm=true",
    "batch_size=48",
    "num_epochs=2",
    "log_every_n_steps=10",
    "progress=none",
    "run_dir=run",
]


def test_world_sizes_1_2_3_train_the_same_model(tmp_path):
    """Same seed, same global batch (48), 1,438 digits (not divisible by 48 x world): same weights and logs.
    Three ranks under torchrun here (the other world-size tests self-launch them): the launchers agree too."""
    runs = {}
    for w in (1, 2, 3):
        d = tmp_path / f"w{w}"
        d.mkdir()
        assert_ok(torchrun(3, EXACT, d) if w == 3 else ranks(w, EXACT, d))
        runs[w] = (
            torch.load(d / "run" / "checkpoints" / "last.pt", weights_only=True),
            read_scalars(d / "run" / "tb"),
        )
    ref_ck, ref_s = runs[1]
    print("\nworld | max rel weight diff | train/loss (last) | val/loss | val/acc")
    for w, (ck, s) in runs.items():
        diff = max_rel_weight_diff(ck["model"], ref_ck["model"])
        print(
            f"{w:5} | {diff:19.3e} | {s['train/loss'][-1][1]:.9g} | "
            f"{ck['results']['last_val']['val/loss']:.9g} | "
            f"{ck['results']['last_val']['val/acc']:.9g}"
        )
        assert diff <= 1e-5
        assert [st for st, _ in s["train/loss"]] == [st for st, _ in ref_s["train/loss"]]
        for (_, a), (_, b) in zip(s["train/loss"], ref_s["train/loss"]):
            assert a == pytest.approx(b, rel=1e-6)  # the same to 6 significant digits
        for tag in ("train/acc", "val/acc", "val/num_samples"):
            assert s[tag] == ref_s[tag], tag  # counts: exactly equal
        assert ck["results"]["last_val"]["val/loss"] == pytest.approx(
            ref_ck["results"]["last_val"]["val/loss"], rel=1e-6
        )

    # Validation on 3 ranks equals single-process evaluation of the same weights.
    from ddplab import build
    from ddplab.data import digits

    ck3 = runs[3][0]
    net = build.model(compose_cfg(EXACT))
    net.load_state_dict(ck3["model"])
    net.eval()
    val = digits().val
    with torch.no_grad():
        logits = net(val.x)
    acc = (logits.argmax(-1) == val.y).double().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, val.y).item()
    assert ck3["results"]["last_val"]["val/acc"] == pytest.approx(acc, abs=1e-12)
    assert ck3["results"]["last_val"]["val/num_samples"] == len(val) == 359
    assert ck3["results"]["last_val"]["val/loss"] == pytest.approx(loss, rel=1e-5)


# ------------------------------------------------------- 1. unused params
def test_unused_parameter_fails_at_first_step_naming_it(tmp_path):
    args = ["model=mlp", "model._target_=toy.UnusedParamMLP", "num_epochs=1", "progress=log"]
    proc = torchrun(2, args, tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "failed in epoch 1, step 1" in out  # the first step, not the cryptic error at step 2
    assert "aux_head.weight, aux_head.bias" in out
    assert "distributed.find_unused_parameters=true" in out
    assert "Expected to have finished reduction" not in out

    ok = torchrun(2, args + ["distributed.find_unused_parameters=true"], tmp_path, timeout=120)
    assert_ok(ok)
    assert "val/acc=" in ok.stdout


def test_unused_parameter_is_named_at_the_first_step_even_when_that_step_is_dropped(tmp_path):
    """fp16's scaler skips the first update (its gradient made inf here; unfused, the optimizer's step is not
    even called): the check runs after the first backward all the same, not DDP's riddle at step 2."""
    args = [
        "model=mlp",
        "model._target_=toy.UnusedParamMLP",
        "num_epochs=1",
        "progress=log",
        "amp=true",
        "amp_dtype=float16",
        "perf.fused_optimizer=false",
        "+callbacks.inf._target_=toy.InfGradAtStep",
        "+callbacks.inf.step=1",
    ]
    proc = torchrun(2, args, tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "failed in epoch 1, step 1" in out and "aux_head.weight, aux_head.bias" in out
    assert "Expected to have finished reduction" not in out


# ----------------------------------------------------------- 2. uneven data
def test_uneven_data_never_crashes_or_hangs(tmp_path):
    # 1,001 train samples over 3 ranks x 16; 2 val samples: one rank has none.
    proc = torchrun(
        3,
        [
            "dataset=synthetic",
            "dataset.num_train=1001",
            "dataset.num_val=2",
            "model=mlp",
            "batch_size=48",
            "num_epochs=1",
            "progress=log",
        ],
        tmp_path,
        timeout=180,
    )
    assert_ok(proc)
    s = read_scalars(job_dirs(tmp_path)[0] / "tb")
    assert s["val/num_samples"] == [(1001 // 48, 2.0)]


def test_dataset_smaller_than_one_global_batch_is_a_clear_error(tmp_path):
    t0 = time.perf_counter()
    proc = torchrun(
        3, ["dataset=synthetic", "dataset.num_train=5", "model=mlp", "batch_size=6"], tmp_path, timeout=120
    )
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60
    out = proc.stdout + proc.stderr
    assert "needs 6 samples per optimizer step, but the training set has 5" in out and "Fix:" in out


# A batch smaller than the world size: tests/integration/test_integrity.py's config error under torchrun
# (batch_size=2, 3 ranks).


# ------------------------------------------------------ 3. legacy launcher
def test_legacy_torch_distributed_launch(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node=2",
        str(TRAIN),
        "model=mlp",
        "num_epochs=1",
        "progress=log",
    ]
    proc = run_cmd(cmd, tmp_path, timeout=120)
    assert_ok(proc)
    assert "ranks: 0@" in proc.stdout and "(local 1)" in proc.stdout
    assert len(job_dirs(tmp_path)) == 1


# --------------------------------------------------------- 4. init methods
@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_init_methods(tmp_path, scheme):
    url = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path}/rendezvous"
    proc = torchrun(
        2,
        ["model=mlp", "num_epochs=1", f"distributed.init_method={url}", "progress=log"],
        tmp_path,
        timeout=120,
    )
    assert_ok(proc)
    assert read_scalars(job_dirs(tmp_path)[0] / "tb")["val/num_samples"][-1][1] == 359
    # Two plain processes (no launcher, no MASTER_ADDR/PORT): env:// cannot join them, so their joining
    # shows the init_method is what does.
    plain = tmp_path / "plain"
    plain.mkdir()
    url = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path}/rendezvous2"
    args = ["model=mlp", "num_epochs=1", "progress=log", "distributed.timeout_s=60"]
    procs = [
        start(
            [sys.executable, str(TRAIN), *args, f"distributed.init_method={url}"],
            plain,
            stderr=subprocess.STDOUT,
            extra_env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)},
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 rank(s) on cpu (gloo)" in outs[0]
    assert read_scalars(job_dirs(plain)[0] / "tb")["val/num_samples"][-1][1] == 359
    if scheme == "file":
        return  # the control below is the same for both schemes: run once
    control = run_cmd(
        [sys.executable, str(TRAIN), *args, "distributed.init_method=env://"],
        plain,
        timeout=120,
        extra_env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
    )
    assert control.returncode != 0 and "MASTER_ADDR" in control.stdout + control.stderr


# ------------------------------------------------------------ 5. multi-node
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_nodes_form_one_job(tmp_path, rdzv):
    port = free_port()
    # static: node ranks given, node 0 hosts the store; c10d: docs/launching.md's multi-node form, where the
    # agents agree on node ranks through the store at the endpoint (one of them hosts it).
    how = {
        "static": lambda n: [f"--node_rank={n}", "--master_addr=127.0.0.1", f"--master_port={port}"],
        "c10d": lambda n: ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonodes"],
    }[rdzv]
    procs = [
        start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                *how(n),
                "--nproc_per_node=1",
                str(TRAIN),
                "model=mlp",
                "num_epochs=1",
                "progress=log",
            ],
            tmp_path,
            stderr=subprocess.STDOUT,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    node0 = next(o for o in outs if "ranks: 0@" in o)  # under c10d either agent may become node 0
    # Global rank = node_rank * nproc_per_node + local_rank: node 1's process is rank 1, local rank 0.
    assert re.search(r"ranks: 0@\S+:cpu\(local 0\) cfg=(\w+), 1@\S+:cpu\(local 0\) cfg=\1", node0)
    assert "2 rank(s) on cpu (gloo)" in node0
    dirs = job_dirs(tmp_path)
    assert len(dirs) == 1
    assert len(list((dirs[0] / "tb").glob("events.out.tfevents*"))) == 1
    assert sum("val/acc=" in o for o in outs) == 1  # the other node is quiet
