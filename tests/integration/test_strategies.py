"""distributed=ddp | none | dp | fsdp."""

from __future__ import annotations

import pytest
import torch
from helpers.jobs import assert_ok, compose_cfg, ranks, read_scalars, torchrun
from helpers.strategies import ARGS

import ddplab


def curves(run_dir) -> dict[str, list[tuple[int, float]]]:
    s = read_scalars(run_dir / "tb")
    return {k: s[k] for k in ("train/loss", "train/acc", "val/loss", "val/acc")}


def max_rel(a, b) -> float:
    assert [s for s, _ in a] == [s for s, _ in b]
    return max(abs(x - y) / max(abs(x), 1e-12) for (_, x), (_, y) in zip(a, b))


@pytest.mark.dist
def test_fsdp2_matches_ddp_and_resumes_from_sharded_checkpoints(tmp_path):
    """FSDP2 (fully_shard, gloo, 2 ranks): same loss curve as DDP; torch.distributed.checkpoint
    save/resume."""
    assert_ok(ranks(2, ARGS + ["run_dir=ddp"], tmp_path))
    assert_ok(ranks(2, ARGS + ["distributed=fsdp", "run_dir=fsdp", "checkpoint.keep_last=1"], tmp_path))
    ddp, fsdp = curves(tmp_path / "ddp"), curves(tmp_path / "fsdp")
    for k in ddp:
        assert max_rel(ddp[k], fsdp[k]) < 1e-5, k  # measured: 1.4e-7
    ck = tmp_path / "fsdp" / "checkpoints"
    shards = sorted(p.name for p in ck.glob("step-*.dcp"))
    assert shards == ["step-00000044.dcp"]  # keep_last=1: the epoch-1 shards were removed
    assert {p.name for p in (ck / shards[0]).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert "model" not in torch.load(ck / "last.pt", weights_only=True)  # the weights live in the shards

    # Stop after epoch 1, resume: the same curve as the uninterrupted run.
    assert_ok(ranks(2, ARGS + ["distributed=fsdp", "run_dir=part", "stop_after_epochs=1"], tmp_path))
    assert_ok(ranks(2, ARGS + ["distributed=fsdp", "run_dir=part", "resume=auto"], tmp_path))
    part = curves(tmp_path / "part")
    for k in fsdp:
        assert part[k] == fsdp[k], k

    # Cross-strategy resume is refused with the reason (the check is the model entry's, whatever the world
    # size: one process says it as two would).
    from ddplab.config import ConfigError

    with pytest.raises(ConfigError, match="saved with distributed=fsdp"):
        ddplab.run(compose_cfg(ARGS + [f"resume={ck / 'last.pt'}"], run_dir=tmp_path / "ddp_from_fsdp"))


@pytest.mark.slow
def test_none_and_dp_run_one_process(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="ddplab"):
        dp = ddplab.run(compose_cfg(ARGS + ["distributed=dp"], run_dir=tmp_path / "dp"))
    assert (
        "distributed=dp: torch.nn.DataParallel" in caplog.text
        and "DistributedDataParallel is faster" in caplog.text
    )
    none = ddplab.run(compose_cfg(ARGS + ["distributed=none"], run_dir=tmp_path / "none"))
    # On CPU DataParallel simply calls the module: the same training.
    assert dp["val/loss"] == none["val/loss"] and none["val/num_samples"] == 359


@pytest.mark.dist
def test_single_process_strategies_refuse_torchrun(tmp_path):
    proc = torchrun(2, ARGS + ["distributed=none"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "distributed.strategy=none: runs ONE process" in out and "distributed=ddp (or fsdp)" in out


@pytest.mark.slow
def test_dp_vs_ddp_bench_skips_without_two_gpus(tmp_path):
    import sys

    from helpers.jobs import REPO, run_cmd

    if torch.cuda.device_count() >= 2:
        pytest.skip("has 2 GPUs: the benchmark would run for real")
    proc = run_cmd([sys.executable, str(REPO / "scripts" / "bench_dp_vs_ddp.py")], tmp_path, timeout=120)
    assert proc.returncode == 0 and "needs at least 2 GPUs" in proc.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["distributed=dp", "distributed.nproc_per_node=2"],
            "distributed.nproc_per_node=2: distributed=dp runs one process. Fix: distributed=ddp (or fsdp)",
        ),
        (
            ["distributed=fsdp", "distributed.sync_batchnorm=true"],
            "distributed.sync_batchnorm=True: not supported with distributed=fsdp. Fix: "
            "distributed.sync_batchnorm=false",
        ),
        (
            ["distributed=fsdp", "perf.compile=true"],
            "perf.compile=True: not wired for distributed=fsdp yet. Fix:",
        ),
        (
            ["distributed=fsdp", "model=convnet", "perf.channels_last=true"],
            "perf.channels_last=True: FSDP shards only contiguous parameters. Fix: perf.channels_last=false",
        ),
    ],
)
def test_strategy_refusals_name_the_key_and_the_fix_before_any_process_starts(tmp_path, args, says):
    from ddplab.config import ConfigError

    with pytest.raises(ConfigError) as e:
        ddplab.run(compose_cfg(ARGS + args, run_dir=tmp_path / "r"))
    assert str(e.value).startswith(says), str(e.value)
    assert not (tmp_path / "r").exists()  # refused before the run dir, the group, any rank


@pytest.mark.parametrize(
    "args,n",
    [
        (["distributed=none"], 1),
        (["distributed=dp"], 1),
        (["distributed=ddp"], 1),
        (["distributed=ddp", "distributed.nproc_per_node=2"], 2),
        (["distributed=fsdp", "distributed.nproc_per_node=3"], 3),
    ],
)
def test_a_strategy_says_how_many_ranks_a_job_starts_by_itself(args, n):
    from ddplab.strategy import ranks_started

    assert ranks_started(compose_cfg(args)) == n
