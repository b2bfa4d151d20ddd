"""dataset=tokens in real runs: flat binary token files (nanoGPT's layout) read a window at a time — exact
windows, exact sharding over world sizes, bitwise kill + resume at 1 and 2 ranks, a resume at another world
size that neither loses nor doubles a sample, token shards streamed once an epoch, and one-line errors for a
corrupt token (in a loader worker, under two ranks) and for the config."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.compare import assert_same_checkpoint
from helpers.data_ranks import (
    assert_failed_saying,
    metrics_at_world_sizes,
    rank_1_killed_at_step_13,
    resumed_at_2_and_3,
)
from helpers.jobs import (
    assert_ok,
    compose_cfg,
    python_train,
    rank_kills_itself,
    ranks,
    run_killed_after_step,
    torchrun,
)
from helpers.tokens import LM, files, generated, shards

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.config.validate import validate
from ddplab.data.tokens import tokens, write_tokens


def corpus(tmp_path: Path, mb: float = 0.01) -> tuple[Path, Path]:
    """train.bin / val.bin written by the shipped script: 49 steps an epoch at a batch of 12 (two epochs, a
    checkpoint mid-epoch before the step 13 a kill stops at, as the tests need; each step more costs six
    runs)."""
    out = generated(tmp_path / "data", mb)
    return out / "train.bin", out / "val.bin"


def last(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def metrics(run: Path) -> dict[str, float]:
    return json.loads((run / "result.json").read_text())["metrics"]


# --------------------------------------------------------------------------- training on it
@pytest.mark.slow
def test_kill_and_resume_mid_epoch_on_a_token_file_is_bitwise(tmp_path):
    args = LM + files(*corpus(tmp_path)) + ["num_epochs=2", "model.dropout=0.1", "checkpoint.every_n_steps=5"]
    ref = ddplab.run(compose_cfg(args, tmp_path / "ref"))
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 13)  # last checkpoint: step 10, mid-epoch
    rest = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    assert_same_checkpoint(last(tmp_path / "ref"), last(tmp_path / "run"))
    assert rest["val/loss"] == ref["val/loss"] and rest["step"] == ref["step"]


@pytest.mark.dist
def test_token_lm_is_exact_over_world_sizes_and_a_killed_rank_resumes_bitwise_or_at_another_world_size(
    tmp_path,
):
    """World sizes 1/2/3 give the same run (global batch 12). Rank 1 SIGKILLed at step 13 of a 2-rank job (its
    last checkpoint: step 10, mid-epoch) resumes bitwise at 2 ranks; resumed at 3 ranks instead, it ends where
    the uninterrupted run does (to float32 reduction order): no window lost or seen twice."""
    train, val = corpus(tmp_path)
    args = (
        LM
        + files(train, val)
        + ["num_epochs=2", "checkpoint.every_n_steps=5", "+callbacks.soak._target_=soak_toy.SoakCallback"]
    )
    runs = metrics_at_world_sizes(args, tmp_path)
    # 2 epochs of 49 steps
    assert runs[1]["step"] == 2 * (len(tokens(str(train), str(val), block_size=16).train) // 12)
    for n in (2, 3):
        assert runs[n]["val/num_samples"] == runs[1]["val/num_samples"]
        assert runs[n]["val/loss"] == pytest.approx(runs[1]["val/loss"], rel=1e-5), n
    # One crash (rank 1 SIGKILLed), its run dir copied: each copy resumes at another world size.
    crashed = rank_1_killed_at_step_13(args, tmp_path)
    fired = json.loads((tmp_path / "fault" / "fired").read_text())
    assert crashed.returncode != 0 and fired["step"] == 12, (crashed.stderr[-2000:], fired)
    for resumed_at, run in resumed_at_2_and_3(args, tmp_path).items():
        if resumed_at == 2:
            assert_same_checkpoint(last(tmp_path / "2"), last(run))
        assert metrics(run)["step"] == runs[1]["step"]
        assert metrics(run)["val/loss"] == pytest.approx(runs[1]["val/loss"], rel=1e-5)


def corrupt_token_file(tmp_path: Path) -> Path:
    """A token id past the vocabulary at byte 24690 (token 12345), deep in the file: found while training."""
    ids = np.arange(20_000) % 200
    ids[12_345] = 60_000  # fits uint16, not the 256-token vocabulary
    return write_tokens(ids, tmp_path / "t.bin", vocab_size=256)


@pytest.mark.slow
def test_a_corrupt_token_read_by_a_dataloader_worker_is_one_line_naming_file_and_offset_exit_2(tmp_path):
    """torch re-raises a worker's error with its traceback inside the message: the user gets the original
    error's one line (and which worker), exit 2 like any input error, and no traceback."""
    f = corrupt_token_file(tmp_path)
    proc = python_train(
        LM + [f"dataset.path={f}", "num_epochs=1", "perf.num_workers=2", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    said = [ln for ln in out.splitlines() if "ERROR" in ln or "Error" in ln]
    assert proc.returncode == 2 and "Traceback" not in out and len(said) == 1, out[-3000:]
    assert re.search(
        r"ERROR: rank 0/1 failed in epoch 1, step \d+: TokenFileError: \S*t.bin: token 60000 at offset "
        r"24690 is >= dataset.vocab_size=256. Fix: [^\n]* \(in DataLoader worker [01]\)$",
        said[0],
    ), said
    error = json.loads((tmp_path / "run" / "result.json").read_text())["error"]
    assert error == said[0].split("ERROR: ", 1)[1]


@pytest.mark.dist
def test_a_corrupt_token_under_two_ranks_names_file_and_offset_and_stops_both(tmp_path):
    """A token id past the vocabulary deep in the file (a corrupt byte): the rank that reads it fails naming
    the file and byte offset; the other rank is stopped with it (the job ends in seconds, not at
    timeout_s)."""
    f = corrupt_token_file(tmp_path)
    args = LM + [
        f"dataset.path={f}",
        "num_epochs=1",
        "distributed.timeout_s=120",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert_failed_saying(
        torchrun(2, args, tmp_path, timeout=100),
        r"rank \d/2 failed in epoch 1, step \d+: TokenFileError: \S*t.bin: token 60000 at offset 24690 "
        r"is >= dataset.vocab_size=256",
        tmp_path / "run",
    )


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_token_shards_stream_every_window_once_an_epoch_and_resume_from_their_state(tmp_path):
    from ddplab.data.sampling import ShardedGlobalSampler
    from ddplab.data.streams import StreamLoader
    from ddplab.data.tokens import token_shards

    train, val = shards(tmp_path)
    s = token_shards(str(train), str(val), block_size=16)
    expected = sorted(
        tuple(s.train.shards[k][i][0].tolist()) for k in range(4) for i in range(len(s.train.shards[k]))
    )
    assert (
        len(s.train) == len(expected) == sum((os.path.getsize(f) // 2 - 1) // 16 for f in train.glob("*.bin"))
    )

    def epoch(workers: int, e: int, stop: int | None = None, state=None):
        ld = StreamLoader(
            token_shards(str(train), str(val), block_size=16).train,
            ShardedGlobalSampler(len(expected), 1, 1, 0, 0),
            torch.device("cpu"),
            workers,
        )
        if state is not None:
            ld.load_state_dict(state)
        ld.set_epoch(e, skip=0 if state is None else state["micro_batches"])
        it, got = iter(ld), []
        for x, _ in it:
            got.append(tuple(x[0].tolist()))
            if stop is not None and len(got) == stop:
                return got, json.loads(json.dumps(ld.state_dict()))
        return got, None

    for workers in (0, 2):
        first, _ = epoch(workers, 0)
        assert sorted(first) == expected, workers  # every window once (2 workers: shards split between them)
        assert epoch(workers, 1)[0] != first  # a new order each epoch
        head, state = epoch(workers, 0, stop=100)
        assert head + epoch(workers, 0, state=state)[0] == first  # the saved position continues exactly


@pytest.mark.dist
def test_token_shards_under_two_ranks_match_one_and_a_killed_rank_resumes_bitwise(tmp_path):
    train, val = shards(tmp_path)
    args = [
        "task=lm",
        "dataset=token_shards",
        f"dataset.path={train}",
        f"dataset.val_path={val}",
        "dataset.block_size=16",
        "model.n_embd=32",
        "model.n_layer=1",
        "model.n_head=2",
        "batch_size=12",
        "progress=none",
        "num_epochs=2",
        "checkpoint.every_n_steps=5",
        "perf.num_workers=2",
        "+callbacks.soak._target_=soak_toy.SoakCallback",
    ]
    for n in (1, 2):
        assert_ok(ranks(n, args + [f"hydra.run.dir={tmp_path / str(n)}"], tmp_path, timeout=240))
    assert metrics(tmp_path / "2")["val/loss"] == pytest.approx(metrics(tmp_path / "1")["val/loss"], rel=1e-5)
    run = tmp_path / "killed"
    crashed = ranks(
        2,
        args + [f"hydra.run.dir={run}"],
        tmp_path,
        timeout=240,
        extra_env=rank_kills_itself(tmp_path / "fault", rank=1, k=13),
    )
    assert crashed.returncode != 0
    assert_ok(ranks(2, args + [f"hydra.run.dir={run}", "resume=auto"], tmp_path, timeout=240))
    assert "0 epoch(s), 10 step(s) done" in (run / "train.log").read_text()
    assert_same_checkpoint(
        last(tmp_path / "2"), last(run), entries=("model", "optimizer", "scheduler", "loop", "data")
    )
    assert metrics(run)["step"] == metrics(tmp_path / "2")["step"]


@pytest.mark.parametrize(
    "override,match",
    [
        ([], r"dataset.path=None: is not set. Fix: pass dataset.path=train.bin"),
        (["dataset.path=/nonexistent/train.bin"], r"dataset.path='/nonexistent/train.bin': no such file"),
        (["dataset.path=X", "dataset.dtype=int8"], r"dataset.dtype='int8': must be uint16 or uint32"),
        (
            ["dataset.path=X", "dataset.vocab_size=70000"],
            r"dataset.vocab_size=70000: must be in \[2, 65536\] for "
            r"uint16. Fix: pass dataset.dtype=uint32",
        ),
    ],
)
def test_token_config_errors_name_the_key_the_value_and_the_fix(tmp_path, override, match):
    f = write_tokens(np.arange(100) % 256, tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(LM + [o.replace("=X", f"={f}") for o in override], tmp_path / "run"))
