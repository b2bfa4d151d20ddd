"""dataset=hf dataset.streaming=true in runs (issue 34, item 2): local files read row by row through datasets'
streaming mode. The samples are the in-memory source's (one file) or its per-file windows; a resume from any
sample — mid- read, at a read's end, at a file's end — continues exactly, through datasets' own state_dict;
under ranks and loader workers the run is the one-rank run's and a killed rank resumes bitwise; a num_samples
the files do not hold, or a bad file met in a loader worker under torchrun, is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.compare import assert_same_checkpoint
from helpers.hf_data import GPT, source
from helpers.hf_stream import datasets, files, lm_args, same
from helpers.jobs import assert_ok, compose_cfg, rank_kills_itself, ranks, torchrun

import ddplab
from ddplab.data import hf_stream
from ddplab.data import tokenizer as tz


def result_of(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())["metrics"]


@pytest.mark.parametrize("task", ["lm", "labelled"])
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_stream_resumed_from_any_sample_continues_exactly(tmp_path, monkeypatch, task):
    """Reads of 5 rows: resumes mid-read, at a read's end, at a file's end and after the last sample."""
    monkeypatch.setattr(hf_stream, "ROWS_PER_READ", 5)
    train, val, parts = files(tmp_path)
    extra = {"y": "label", "num_classes": 2} if task == "labelled" else {}
    s = source(tmp_path, train, val, streaming=True, **extra).train
    whole = list(s)
    tok = tz.load(tmp_path / "tokenizer.json")
    per_file = [
        len(p) if task == "labelled" else (sum(len(tok.encode(t).ids) for t in p) - 1) // 16 for p in parts
    ]
    assert len(s) == len(whole) == sum(per_file)
    # Every sample of the first reads (a read of 5 rows: 5 samples, or ~12 windows), and around the files'
    # ends.
    cuts = set(range(27)) | {per_file[0] - 1, per_file[0], per_file[0] + 1, len(whole) - 1, len(whole)}
    for k in sorted(cuts):
        it = iter(s)
        head = [next(it) for _ in range(k)]
        state = s.state_dict()
        fresh = source(tmp_path, train, val, streaming=True, num_samples=len(whole), **extra).train
        fresh.load_state_dict(state)
        assert same(head + list(fresh), whole), k


@pytest.mark.dist
@pytest.mark.slow
def test_a_stream_of_files_under_2_ranks_and_2_workers_is_the_one_rank_run_and_a_killed_rank_resumes_bitwise(
    tmp_path,
):
    """3 files, 2 loader workers per rank: 2 ranks give the 1-rank run (fp32); rank 1 SIGKILLed at step 63
    (last checkpoint: step 60, 6 steps into epoch 2 of 54 steps) resumes at 2 ranks into the uninterrupted
    run's checkpoint, bitwise."""
    args = lm_args(tmp_path) + [
        "num_epochs=2",
        "checkpoint.every_n_steps=10",
        "perf.num_workers=2",
        "+callbacks.soak._target_=soak_toy.SoakCallback",
    ]
    one = ddplab.run(compose_cfg(args, tmp_path / "one"))
    assert_ok(ranks(2, args + [f"hydra.run.dir={tmp_path / 'two'}"], tmp_path, timeout=240))
    two = result_of(tmp_path / "two")
    assert one["step"] == two["step"] == 2 * 54 and two["val/loss"] == pytest.approx(
        one["val/loss"], rel=1e-5
    )
    crashed = ranks(
        2,
        args + [f"hydra.run.dir={tmp_path / 'killed'}"],
        tmp_path,
        timeout=240,
        extra_env=rank_kills_itself(tmp_path / "fault", rank=1, k=63),
    )
    assert crashed.returncode != 0
    assert_ok(ranks(2, args + [f"hydra.run.dir={tmp_path / 'killed'}", "resume=auto"], tmp_path, timeout=240))
    assert "1 epoch(s), 60 step(s) done" in (tmp_path / "killed" / "train.log").read_text()
    assert_same_checkpoint(
        tmp_path / "two" / "checkpoints" / "last.pt",
        tmp_path / "killed" / "checkpoints" / "last.pt",
        entries=("model", "optimizer", "scheduler", "loop", "data"),
    )
    assert result_of(tmp_path / "killed")["val/loss"] == two["val/loss"]


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_a_num_samples_the_files_do_not_hold_is_one_line_naming_it(tmp_path):
    from ddplab.data.streams import StreamEnded

    with pytest.raises(
        StreamEnded,
        match=r"HFStream ended after \d+ global batches of 12 in epoch 1, but its __len__ "
        r"\(5000\) promises 416\. Fix: drop dataset.num_samples=5000 \(the samples "
        r"are then counted at start-up\)",
    ):
        ddplab.run(
            compose_cfg(lm_args(tmp_path) + ["dataset.num_samples=5000", "num_epochs=1"], tmp_path / "run")
        )


@pytest.mark.dist
def test_a_bad_file_read_in_a_loader_worker_under_torchrun_is_one_line(tmp_path):
    """An id beyond the vocabulary in the second file, met by a loader worker (num_samples given: no counting
    pass found it at start-up), under torchrun: the ranks say one line naming the key and the fix, exit 2."""
    from helpers.lines import ddplab_lines

    (tmp_path / "train").mkdir()
    for i, bad in enumerate((False, True)):
        rows = [[(j * 7 + k) % 100 for k in range(40)] for j in range(30)]
        rows[20][5] = 999 if bad else rows[20][5]
        datasets.Dataset.from_dict({"ids": rows}).to_parquet(tmp_path / "train" / f"part-{i}.parquet")
    (tmp_path / "val.jsonl").write_text(
        "".join(json.dumps({"ids": list(range(40))}) + "\n" for _ in range(10))
    )
    args = [
        "task=lm",
        "dataset=hf",
        "dataset.streaming=true",
        f"dataset.path={tmp_path / 'train'}",
        f"dataset.val_path={tmp_path / 'val.jsonl'}",
        "dataset.x=ids",
        "dataset.vocab_size=100",
        "dataset.block_size=16",
        "dataset.num_samples=140",
        "batch_size=12",
        "perf.num_workers=2",
        "progress=none",
        "num_epochs=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ] + GPT
    proc = torchrun(2, args, tmp_path, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, out[-3000:]
    lines = ddplab_lines(out)
    said = [line for line in lines if "token id 999" in line]
    assert said and all(
        re.search(r"dataset.path: token id 999 >= dataset.vocab_size=100\. Fix: dataset.vocab_size=", s)
        for s in said
    ), out[-3000:]
    assert not any("Traceback" in line for line in lines), "\n".join(lines)[-3000:]


def test_one_file_streams_exactly_the_in_memory_windows_and_rows(tmp_path):
    train, val, _ = files(tmp_path, n=1, rows=120)
    for extra in ({}, {"y": "label", "num_classes": 2}):
        mem = source(tmp_path, train, val, cache_dir=str(tmp_path / "c"), **extra)
        stream = source(tmp_path, train, val, streaming=True, **extra)
        got = list(stream.train)
        assert len(stream.train) == len(got) == len(mem.train) > 100
        assert same(got, list(zip(mem.train.x, mem.train.y)))
        assert same(list(stream.val), list(zip(mem.val.x, mem.val.y)))
