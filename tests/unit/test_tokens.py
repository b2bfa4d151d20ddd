"""dataset=tokens' reader, in-process: a window is the file's tokens, a batch read whole is its windows
stacked (a bad token named at its offset), the dataset pickles for loader workers, and token files that do not
match are one-line errors naming file and offset."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from ddplab.data.tokens import TokenFileError, tokens, write_tokens


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
