"""distributed=ddp | none | dp | fsdp."""

from __future__ import annotations

import pytest
from helpers.jobs import compose_cfg
from helpers.strategies import ARGS

import ddplab


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
