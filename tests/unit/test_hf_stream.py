"""dataset=hf dataset.streaming=true's start-up, in-process (issue 34, item 2; issue 45): the count is what an
epoch yields and dataset.num_samples skips it, a kept num_samples is checked against the files there now, no
connection is opened; a missing validation file, a null text or files that disagree on columns are one
line."""

from __future__ import annotations

import pytest
from helpers.hf_data import source
from helpers.hf_stream import datasets, files, lm_args, texts
from helpers.jobs import compose_cfg

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.data import hf_stream
from ddplab.data.hf import hf


def test_the_count_is_what_an_epoch_yields_and_num_samples_skips_it(tmp_path, monkeypatch):
    train, val, _ = files(tmp_path, n=2, rows=20)
    counted = []
    monkeypatch.setattr(hf_stream.HFStream, "_count", lambda self: counted.append(1) or 999)
    s = hf(str(train), str(val), tokenizer=str(tmp_path / "tokenizer.json"), streaming=True, num_samples=12)
    # only the validation stream counted
    assert len(s.train) == 12 and len(s.val) == 999 and len(counted) == 1


def test_a_num_samples_kept_after_files_were_added_is_refused_naming_them(tmp_path):
    """Issue 45: the count line's dataset.num_samples, kept after a file was added to the folder, trained on
    the first N samples every epoch, never read the new file, and said completed. Each count is recorded with
    the file set's fingerprint; a given N is checked against it."""
    from ddplab.errors import InputError

    train, val, _ = files(tmp_path, n=2, rows=20)
    n = len(source(tmp_path, train, val, streaming=True).train)  # counted, and recorded
    # the same files: taken as given
    assert len(source(tmp_path, train, val, streaming=True, num_samples=n).train) == n
    with pytest.raises(
        InputError, match=rf"dataset.num_samples={n - 1}: dataset.path's files held {n} samples"
    ):
        source(tmp_path, train, val, streaming=True, num_samples=n - 1)
    datasets.Dataset.from_dict({"text": texts(30)[-10:]}).to_parquet(train / "part-9.parquet")
    with pytest.raises(
        InputError,
        match=rf"dataset.num_samples={n}: it was counted \({n} samples\) on other files "
        r"than dataset.path holds now \(added: part-9.parquet\).*Fix: drop "
        r"dataset.num_samples",
    ):
        source(tmp_path, train, val, streaming=True, num_samples=n)


def test_streaming_without_a_validation_file_is_one_config_error(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"dataset.val_path=None: a stream has no last fraction to hold out\. "
        r"Fix: pass dataset.val_path=<validation files>",
    ):
        ddplab.run(compose_cfg(lm_args(tmp_path) + ["dataset.val_path=null"], tmp_path / "run"))


@pytest.mark.parametrize("streaming", [False, True])
def test_reading_local_files_opens_no_connection(tmp_path, monkeypatch, streaming):
    """datasets counts downloads with a request to the Hub on every load_dataset (3 s each without a
    network)."""
    import socket

    train, val, _ = files(tmp_path, n=2, rows=20)
    dialled = []
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda *a, **k: dialled.append(a) or (_ for _ in ()).throw(OSError("no"))
    )
    monkeypatch.setattr(
        socket.socket,
        "connect",
        lambda self, addr: dialled.append(addr) or (_ for _ in ()).throw(OSError("no")),
    )
    s = hf(
        str(train),
        str(val),
        tokenizer=str(tmp_path / "tokenizer.json"),
        vocab_size=320,
        streaming=streaming,
        cache_dir=str(tmp_path / "c"),
    )
    assert len(list(s.train)) == len(s.train) > 0 and dialled == []


@pytest.mark.parametrize("streaming", [False, True])
def test_a_null_in_the_text_column_is_one_line_naming_file_row_and_column(tmp_path, streaming):
    """Issue 45: tokenizers' TypeError named no file, row or column."""
    from ddplab.errors import InputError

    train, val, parts = files(tmp_path, n=2, rows=20)
    rows = parts[1][:]
    rows[13] = None
    datasets.Dataset.from_dict({"text": rows, "label": [0] * 20}).to_parquet(train / "part-1.parquet")
    with pytest.raises(
        InputError,
        match=r"dataset.path: part-1.parquet row 13 has no value \(null\) in column "
        r"'text' \(dataset.x\)\. Fix: drop or fill",
    ):
        source(tmp_path, train, val, streaming=streaming, cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("streaming", [False, True])
def test_files_that_disagree_on_columns_are_named_and_the_fix_is_not_another_column(tmp_path, streaming):
    """Issue 45: a folder whose files disagree on columns named no file, and the advice (another column) broke
    the other files."""
    from ddplab.errors import InputError

    train, val, parts = files(tmp_path, n=2, rows=20)
    datasets.Dataset.from_dict({"body": parts[1]}).to_parquet(train / "part-1.parquet")
    with pytest.raises(
        InputError,
        match=r"part-1.parquet has (no column 'text'|columns \['body'\]).*Fix: give "
        r"every file of one split the same columns",
    ):
        s = source(tmp_path, train, val, streaming=streaming, cache_dir=str(tmp_path / "c"))
        list(s.train)
