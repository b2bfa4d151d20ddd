"""dataset=tokens: flat binary token files (nanoGPT's layout) read a window at a time — exact windows,
exact sharding over world sizes, bitwise kill + resume at 1 and 2 ranks, a resume at another world
size that neither loses nor doubles a sample, and one-line errors for files that do not match."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.compare import assert_same_checkpoint
from helpers.jobs import (
    REPO,
    assert_ok,
    compose_cfg,
    python_train,
    rank_kills_itself,
    ranks,
    run_cmd,
    run_killed_after_step,
    torchrun,
)

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.config.validate import validate
from ddplab.data.tokens import TokenFileError, tokens, write_tokens

LM = [
    "task=lm",
    "dataset=tokens",
    "dataset.block_size=16",
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
    "batch_size=12",
    "progress=none",
]


def corpus(tmp_path: Path, mb: float = 0.01) -> tuple[Path, Path]:
    """train.bin / val.bin written by the shipped script: 49 steps an epoch at a batch of 12 (two epochs, a
    checkpoint mid-epoch before the step 13 a kill stops at, as the tests need; each step more costs six
    runs)."""
    out = tmp_path / "data"
    proc = run_cmd(
        [
            sys.executable,
            str(REPO / "scripts" / "make_tokens.py"),
            "--generated-mb",
            str(mb),
            "--out",
            str(out),
        ],
        tmp_path,
    )
    assert_ok(proc)
    return out / "train.bin", out / "val.bin"


def files(train: Path, val: Path) -> list[str]:
    return [f"dataset.path={train}", f"dataset.val_path={val}"]


def last(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def metrics(run: Path) -> dict[str, float]:
    return json.loads((run / "result.json").read_text())["metrics"]


# --------------------------------------------------------------------------- the file and its windows
def test_windows_are_the_files_tokens_and_the_dataset_pickles_for_workers(tmp_path):
    ids = np.arange(1000) % 300
    write_tokens(ids, tmp_path / "t.bin", "uint16", vocab_size=300)
    s = tokens(str(tmp_path / "t.bin"), dtype="uint16", block_size=10, vocab_size=300, val_fraction=0.1)
    assert (len(s.train), len(s.val)) == (89, 10)  # (1000 - 1) // 10 windows, the last tenth for validation
    x, y = s.train[3]
    assert x.tolist() == ids[30:40].tolist() and y.tolist() == ids[31:41].tolist() and x.dtype == torch.int64
    x, y = s.val[0]  # the first validation window follows the training windows
    assert x.tolist() == ids[890:900].tolist()
    again = pickle.loads(pickle.dumps(s.train))  # a DataLoader worker gets its own file handle
    assert torch.equal(again[88][1], s.train[88][1])
    big = write_tokens(np.array([70000, 1, 2] * 10), tmp_path / "u.bin", "uint32")
    assert tokens(str(big), dtype="uint32", block_size=4, vocab_size=70001).train[0][0].tolist() == [
        70000,
        1,
        2,
        70000,
    ]


def test_a_batch_is_read_whole_and_equals_its_windows_stacked_and_a_bad_token_in_it_names_its_offset(
    tmp_path,
):
    """The DataLoader's batched fetch (``__getitems__``): the same tensors as its windows one by one, stacked
    (contiguous; through a Subset too, as validation shards are), and an id past the vocabulary in its third
    window is named at the offset the per-window read names."""
    from torch.utils.data import DataLoader, Subset, default_collate

    ids = np.random.default_rng(0).integers(0, 300, 5000)
    write_tokens(ids, tmp_path / "t.bin", "uint16", vocab_size=300)
    s = tokens(str(tmp_path / "t.bin"), dtype="uint16", block_size=16, vocab_size=300)
    picked = [7, 250, 3, 3, 100]
    x, y = s.train.__getitems__(picked)
    want = default_collate([s.train[i] for i in picked])
    assert torch.equal(x, want[0]) and torch.equal(y, want[1]) and x.is_contiguous() and y.is_contiguous()
    got = list(DataLoader(Subset(s.val, range(5, 20)), batch_size=4, collate_fn=s.collate_fn))
    assert [b[0].shape[0] for b in got] == [4, 4, 4, 3]
    assert torch.equal(torch.cat([b[1] for b in got]), torch.stack([s.val[i][1] for i in range(5, 20)]))
    bad = ids.copy()
    bad[250 * 16 + 5] = 299 + 1  # window 250, position 5
    bad.astype(np.uint16).tofile(tmp_path / "b.bin")  # no sidecar: found only where it is read
    wrong = tokens(str(tmp_path / "b.bin"), dtype="uint16", block_size=16, vocab_size=300)
    with pytest.raises(TokenFileError, match=r"token 300 at offset 8010 is >= dataset.vocab_size=300") as one:
        wrong.train[250]
    with pytest.raises(TokenFileError) as batch:
        wrong.train.__getitems__(picked)
    assert str(batch.value) == str(one.value)


def test_token_files_that_do_not_match_are_one_line_errors_naming_file_and_offset(tmp_path):
    f = write_tokens(np.arange(200) % 256, tmp_path / "t.bin", "uint16", vocab_size=256)
    with pytest.raises(
        TokenFileError, match=r"t.bin was written as uint16 \(t.bin.json\), but dataset.dtype=uint32"
    ):
        tokens(str(f), dtype="uint32", block_size=8)
    with pytest.raises(
        TokenFileError, match=r"ids up to 255 .* dataset.vocab_size=100. Fix: dataset.vocab_size=256"
    ):
        tokens(str(f), block_size=8, vocab_size=100)
    with open(f, "ab") as out:  # appended after it was written: the sidecar no longer describes it
        out.write(b"\0\0")
    with pytest.raises(TokenFileError, match=r"201 tokens, but t.bin.json says 200: .*truncated or changed"):
        tokens(str(f), block_size=8)
    raw = tmp_path / "raw.bin"  # nanoGPT's own files have no sidecar: what can be checked still is
    raw.write_bytes(b"\1" * 101)
    with pytest.raises(TokenFileError, match=r"raw.bin: 101 bytes is not a whole number of uint16 tokens"):
        tokens(str(raw), block_size=8)
    np.array([5] * 40 + [999] + [5] * 59, dtype=np.uint16).tofile(raw)
    s = tokens(str(raw), block_size=8, vocab_size=256)
    with pytest.raises(TokenFileError, match=r"raw.bin: token 999 at offset 80 is >= dataset.vocab_size=256"):
        s.train[5]  # window 5 = tokens 40..48: the 999 is token 40, byte 80
    os.truncate(raw, 60)  # cut under a running job
    with pytest.raises(
        TokenFileError, match=r"raw.bin: truncated: 0 of 18 bytes at offset 160; the file is 60 bytes"
    ):
        s.train[10]


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
    runs = {}
    for n in (1, 2, 3):
        assert_ok(ranks(n, args + [f"hydra.run.dir={tmp_path / str(n)}"], tmp_path, timeout=240))
        runs[n] = metrics(tmp_path / str(n))
    # 2 epochs of 49 steps
    assert runs[1]["step"] == 2 * (len(tokens(str(train), str(val), block_size=16).train) // 12)
    for n in (2, 3):
        assert runs[n]["val/num_samples"] == runs[1]["val/num_samples"]
        assert runs[n]["val/loss"] == pytest.approx(runs[1]["val/loss"], rel=1e-5), n
    # One crash (rank 1 SIGKILLed), its run dir copied: each copy resumes at another world size.
    crashed = ranks(
        2,
        args + [f"hydra.run.dir={tmp_path / 'killed_then_2'}"],
        tmp_path,
        timeout=240,
        extra_env=rank_kills_itself(tmp_path / "fault", rank=1, k=13),
    )
    fired = json.loads((tmp_path / "fault" / "fired").read_text())
    assert crashed.returncode != 0 and fired["step"] == 12, (crashed.stderr[-2000:], fired)
    shutil.copytree(tmp_path / "killed_then_2", tmp_path / "killed_then_3")
    for resumed_at, ref in ((2, "2"), (3, "1")):
        run = tmp_path / f"killed_then_{resumed_at}"
        assert_ok(ranks(resumed_at, args + [f"hydra.run.dir={run}", "resume=auto"], tmp_path, timeout=240))
        assert "0 epoch(s), 10 step(s) done" in (run / "train.log").read_text()
        if resumed_at == 2:
            assert_same_checkpoint(last(tmp_path / ref), last(run))
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
    proc = torchrun(2, args, tmp_path, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(
        r"rank \d/2 failed in epoch 1, step \d+: TokenFileError: \S*t.bin: token 60000 at offset 24690 "
        r"is >= dataset.vocab_size=256",
        out,
    ), out[-3000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "failed"


# --------------------------------------------------------------------------- a folder of shards, streamed
def shards(tmp_path: Path, n: int = 4) -> tuple[Path, Path]:
    out = tmp_path / "data"
    assert_ok(
        run_cmd(
            [
                sys.executable,
                str(REPO / "scripts" / "make_tokens.py"),
                "--generated-mb",
                "0.02",
                "--out",
                str(out),
                "--shards",
                str(n),
            ],
            tmp_path,
        )
    )
    return out / "train", out / "val.bin"


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
