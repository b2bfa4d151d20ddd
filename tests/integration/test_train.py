"""End-to-end jobs launched as users launch them: torchrun (2 ranks, gloo) and plain python."""

import math
import re
import sys
import time

import pytest
import torch
import yaml
from helpers.jobs import REPO, assert_ok, job_dirs, own_tmpdir, python_train, read_scalars, run_cmd, torchrun

pytestmark = pytest.mark.dist

DIGITS_TRAIN, DIGITS_VAL = 1438, 359  # val is odd: exact eval must report 359 on 2 ranks
VAL = 17  # the resnet18 test's synthetic validation set: odd too


# Three steps of 8 digit-sized images, 17 to validate (odd: each exactly once over 2 ranks).
RESNET_AMP = [
    *("model=resnet18", "amp=true", "amp_dtype=bf16", "num_epochs=1", "batch_size=8", "dataset=synthetic"),
    *("dataset.in_channels=1", "dataset.image_size=8", "dataset.num_train=48", f"dataset.num_val={VAL}"),
    *("limit_train_steps=3", "log_every_n_steps=2", "progress=log"),
]
LOGGED = ("train/loss", "train/acc", "vitals/lr", "val/loss", "val/acc", "vitals/samples_per_s")
LOGGED += ("vitals/step_time_ms", "vitals/step_time_ms_max", "vitals/data_time_ms")


def test_torchrun_resnet18_amp_two_ranks(tmp_path):
    # Three steps of 8 digit-sized images, 17 to validate (odd: each exactly once over 2 ranks): where the CPU
    # lacks avx512_bf16, oneDNN emulates bf16 (~50 s a step of 64 samples a rank on an AVX2 EPYC; 3 steps of
    # 32 and the 359 digits were 74 CPU-s there).
    tmp_env, scratch_left = own_tmpdir(tmp_path)
    proc = torchrun(2, RESNET_AMP, tmp_path, timeout=240, extra_env=tmp_env)
    assert_ok(proc)
    dirs = job_dirs(tmp_path)
    assert len(dirs) == 1, dirs  # one dir for the job, none per rank
    run = dirs[0]
    assert (run / ".hydra" / "config.yaml").is_file()
    assert (run / "checkpoints" / "last.pt").is_file()
    assert scratch_left() == []  # rank 1's throwaway Hydra dir was removed
    events = list((run / "tb").glob("events.out.tfevents*"))
    assert len(events) == 1  # rank 0 alone writes

    s = read_scalars(run / "tb")
    steps = 3  # limit_train_steps
    assert [st for st, _ in s["train/loss"]] == [2, 3]  # every 2 steps + the epoch's tail
    assert [st for st, _ in s["val/acc"]] == [steps]
    for tag in LOGGED:
        assert all(math.isfinite(v) for _, v in s[tag]), tag
    assert s["val/num_samples"] == [(steps, float(VAL))]  # each val sample exactly once
    assert all(0 <= v <= 1 for _, v in s["train/acc"] + s["val/acc"])
    assert all(v > 0 for _, v in s["vitals/samples_per_s"])
    assert all(
        mx >= mean for (_, mx), (_, mean) in zip(s["vitals/step_time_ms_max"], s["vitals/step_time_ms"])
    )
    assert "amp bfloat16" in proc.stderr + proc.stdout  # bf16 on CPU as asked, no GradScaler
    # ddplab's lines
    first = next(line for line in proc.stdout.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line))
    assert "ranks: 0@" in first and ", 1@" in first  # the rank table is the job's first log line

    table = run_cmd(
        [sys.executable, str(REPO / "scripts" / "show_metrics.py"), str(run), "--prefix", "val/"], tmp_path
    )
    assert_ok(table)
    assert f"| val/num_samples              |     {steps:>2} |          {VAL:>3} |" in table.stdout


def _val_acc_and_log(proc) -> tuple[float, str]:
    out = proc.stdout + proc.stderr
    accs = re.findall(r"val/acc=([0-9.]+)", out)
    assert accs, out[-3000:]
    return float(accs[-1]), out


def test_readme_main_command_reaches_95_percent_in_two_minutes(tmp_path):
    t0 = time.perf_counter()
    proc = torchrun(2, [], tmp_path, timeout=240)  # the README's command: defaults, 2 ranks
    elapsed = time.perf_counter() - t0
    assert_ok(proc)
    acc, out = _val_acc_and_log(proc)
    print(f"README main command: val/acc={acc:.4f} in {elapsed:.1f}s")
    assert acc >= 0.95
    assert elapsed < 120
    s = read_scalars(job_dirs(tmp_path)[0] / "tb")
    assert s["val/acc"][-1][1] == pytest.approx(acc, abs=1e-4)


def test_single_process_has_the_same_config_semantics(tmp_path):
    args = ["model=mlp", "num_epochs=2", "batch_size=64", "progress=log"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    p1 = python_train(args, one)
    p2 = torchrun(2, args, two)
    assert_ok(p1), assert_ok(p2)
    d1, d2 = job_dirs(one)[0], job_dirs(two)[0]
    c1 = yaml.safe_load((d1 / ".hydra" / "config.yaml").read_text())
    c2 = yaml.safe_load((d2 / ".hydra" / "config.yaml").read_text())
    assert c1 == c2  # the same command composes the same config with or without torchrun
    # ... and every rank trained exactly it: the digests of the resolved config each rank used, and the
    # config rank 0 stored in its checkpoint (what Hydra wrote above is only what was composed).
    digests = re.findall(r"cfg=(\w+)", p1.stdout + p1.stderr) + re.findall(
        r"cfg=(\w+)", p2.stdout + p2.stderr
    )
    assert len(digests) == 3 and len(set(digests)) == 1, digests
    m1, m2 = (torch.load(d / "checkpoints" / "last.pt", weights_only=True)["meta"] for d in (d1, d2))
    assert m1["config"] == m2["config"] and (m1["world_size"], m2["world_size"]) == (1, 2)
    # batch_size is global: both runs take the same optimizer steps over the same samples.
    assert "batch: 64 samples per optimizer step = 1 rank(s) x 64 per rank" in p1.stdout + p1.stderr
    assert "batch: 64 samples per optimizer step = 2 rank(s) x 32 per rank" in p2.stdout + p2.stderr
    s1, s2 = read_scalars(d1 / "tb"), read_scalars(d2 / "tb")
    assert [st for st, _ in s1["val/acc"]] == [st for st, _ in s2["val/acc"]] == [22, 44]
    assert s1["val/num_samples"][-1][1] == s2["val/num_samples"][-1][1] == DIGITS_VAL
    assert s1["val/acc"][-1][1] > 0.9 and s2["val/acc"][-1][1] > 0.9


def test_accumulation_clipping_syncbn_and_fp16_scaler_together(tmp_path):
    proc = torchrun(
        2,
        [
            "num_epochs=1",
            "grad_accum_steps=2",
            "grad_clip=1.0",
            "distributed.sync_batchnorm=true",
            "amp=true",
            "amp_dtype=float16",
            "log_every_n_steps=5",
            "progress=log",
        ],
        tmp_path,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "amp float16 + GradScaler" in out
    assert "batch: 128 samples per optimizer step = 2 rank(s) x 32 per rank x 2 accumulation" in out
    assert "| 11 steps/epoch x 1 epochs" in out
    s = read_scalars(job_dirs(tmp_path)[0] / "tb")
    assert [st for st, _ in s["train/loss"]] == [5, 10, 11]  # 1438 // 128 optimizer steps
    assert all(v > 0 and math.isfinite(v) for _, v in s["train/grad_norm"])  # pre-clip norm, logged
    assert all(v >= 1.0 for _, v in s["vitals/loss_scale"])
    assert s["val/num_samples"][-1][1] == DIGITS_VAL


def test_progress_bar_on_a_terminal_and_quiet_other_ranks(tmp_path):
    # torchrun writes each rank's stdout/stderr to its own file: what rank 1 printed, by any means, is there.
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--redirects=3",
        f"--log-dir={logs}",
        str(REPO / "train.py"),
        "num_epochs=1",
        "model=mlp",
        "progress=bar",
    ]
    assert_ok(run_cmd(cmd, tmp_path))
    streams = {(p.parent.name, p.stem): p.read_text() for p in logs.glob("*/attempt_0/*/std*.log")}
    assert sorted(streams) == [("0", "stderr"), ("0", "stdout"), ("1", "stderr"), ("1", "stdout")]
    # tqdm draws on stderr
    assert "epoch 1/1:" in streams["0", "stderr"] and "/22 [" in streams["0", "stderr"]
    assert "ranks: 0@" in streams["0", "stdout"]  # rank 0 logs as usual
    # the bar replaces the periodic log lines
    assert not re.search(r"step 10/\d+  loss=", streams["0", "stdout"])
    assert streams["1", "stdout"] == "" and streams["1", "stderr"] == ""  # rank 1 said nothing at all


def test_a_run_ends_with_a_summary_and_a_hint_when_it_is_not_converging(tmp_path, caplog):
    import logging

    from helpers.jobs import compose_cfg

    import ddplab

    run = tmp_path / "ok"
    with caplog.at_level(logging.INFO, logger="ddplab"):
        out = ddplab.run(compose_cfg(["model=mlp", "num_epochs=3", "progress=none"], run))
    text = caplog.text
    assert f"done: 3/3 epochs, 66 steps, {out['time_s']:.1f} s this run" in text
    best = out["val/acc_best"]
    assert f"best val/acc={best:.4g} at epoch " in text and f"final: val/loss={out['val/loss']:.4g}" in text
    assert f"checkpoints: {run / 'checkpoints'}" in text and f"events: {run / 'tb'}" in text
    assert f"open: tensorboard --logdir {run}\n" in text
    assert "hint:" not in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddplab"):  # lr 50: the loss explodes after step 1 (logged)
        out = ddplab.run(
            compose_cfg(
                ["model=mlp", "num_epochs=1", "optimizer.lr=50", "log_every_n_steps=1", "progress=none"],
                tmp_path / "bad",
            )
        )
    assert "hint: val/loss ended at" in caplog.text and "not converging" in caplog.text, caplog.text[-2000:]
