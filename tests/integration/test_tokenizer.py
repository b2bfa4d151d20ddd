"""Token files written with a subword tokenizer, and trained on (issue 34, item 3): scripts/make_tokens.py
with a local tokenizer.json or a BPE it trains on the text, encoded a chunk at a time (and in worker
processes) to exactly the ids of the whole text, the tokenizer named in the sidecar so a smaller vocabulary is
one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tokens
from helpers.extras import needs
from helpers.jobs import compose_cfg, python_train
from helpers.tokenizer import ids, make_tokens, text_file

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.data import tokenizer as tz

needs("tokenizers", "hf")
LM = tokens.LM + ["num_epochs=1"]


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_bpe_trained_on_the_text_is_deterministic_and_chunked_encoding_in_workers_is_the_whole_texts(
    tmp_path, monkeypatch
):
    """Chunks of 4 KB (some 40 cuts; 2 workers) give the ids of the text encoded whole, train then val."""
    book, script = text_file(tmp_path), make_tokens()
    monkeypatch.setattr(script, "TEXT_CHUNK", 4096)
    for out, workers in (("a", 1), ("b", 2)):
        script.main(
            [str(book), "--out", str(tmp_path / out), "--train-bpe", "380", "--workers", str(workers)]
        )
    a, b = tmp_path / "a", tmp_path / "b"
    # the same text, the same BPE
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    for name in ("train.bin", "val.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    tok = tz.load(a / "tokenizer.json")
    whole = tok.encode(book.read_text(encoding="utf-8"), add_special_tokens=False).ids
    got = np.concatenate([ids(a / "train.bin"), ids(a / "val.bin")])
    assert tok.get_vocab_size() == 380 and got.tolist() == whole
    assert len(got) < 0.6 * book.stat().st_size  # subwords: fewer ids than bytes
    n_val = len(ids(a / "val.bin"))
    val_bytes = len(tok.decode(ids(a / "val.bin").tolist()).encode())
    # the last tenth, cut at a line break
    assert abs(val_bytes - 0.1 * book.stat().st_size) < 200 and n_val > 0
    meta = json.loads((a / "train.bin.json").read_text())
    assert meta["vocab_size"] == 380 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == {
        "file": "tokenizer.json",
        "model": "BPE",
        "vocab_size": 380,
        "sha256": hashlib.sha256((a / "tokenizer.json").read_bytes()).hexdigest(),
    }


@pytest.mark.slow  # a whole in-process training run: seconds (the inner loop keeps tests under ~1.5 CPU-s)
def test_a_local_tokenizer_json_is_used_as_it_is_and_a_run_trains_on_its_ids(tmp_path, monkeypatch):
    """The user's tokenizer learnt across lines (tokens like "\\n\\n", "\\n  "): the file is cut only where
    its ids cannot change (4 KB chunks: some 20 cuts), and equals the text encoded whole."""
    book, script = text_file(tmp_path, 1500), make_tokens()
    text = book.read_text(encoding="utf-8")
    mine = tz.train_bpe([text[i : i + 3000] for i in range(0, len(text), 3000)], 400)
    assert [t for t in mine.get_vocab() if len(t) > 1 and t.startswith("Ċ")]  # merges across a line break
    mine.save(str(tmp_path / "mine.json"))
    monkeypatch.setattr(script, "TEXT_CHUNK", 4096)
    script.main(
        [str(book), "--out", str(tmp_path / "d"), "--tokenizer", str(tmp_path / "mine.json"), "--shards", "2"]
    )
    shards = sorted((tmp_path / "d" / "train").glob("*.bin"))
    got = np.concatenate([ids(s) for s in shards] + [ids(tmp_path / "d" / "val.bin")])
    assert len(shards) == 2 and got.tolist() == mine.encode(book.read_text(encoding="utf-8")).ids
    assert json.loads(Path(f"{shards[1]}.json").read_text())["tokenizer"]["vocab_size"] == 400
    d = tmp_path / "d"
    train = LM + [
        "dataset=token_shards",
        f"dataset.path={d / 'train'}",
        f"dataset.val_path={d / 'val.bin'}",
        "dataset.vocab_size=400",
    ]
    result = ddplab.run(compose_cfg(train, tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"
    assert result["step"] > 0 and np.isfinite(result["val/loss"])


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_vocabulary_smaller_than_the_tokenizers_is_one_line_naming_it_exit_2(tmp_path):
    book, script = text_file(tmp_path, 1500), make_tokens()
    script.main([str(book), "--out", str(tmp_path / "d"), "--train-bpe", "330"])
    d = tmp_path / "d"
    proc = python_train(
        LM + [f"dataset.path={d / 'train.bin'}", f"dataset.val_path={d / 'val.bin'}"], tmp_path
    )
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if "dataset.vocab_size=256" in line]
    assert proc.returncode == 2 and "Traceback" not in out, out[-2000:]
    assert len(lines) == 1 and "written with tokenizer.json: a BPE of 330 ids" in lines[0]
    assert "Fix: dataset.vocab_size=330" in lines[0]
    with pytest.raises(
        ConfigError,
        match=r"model.vocab_size=256, but the data's ids go up to 329 "
        r"\(dataset.vocab_size=330\).*Fix: model.vocab_size=\$\{dataset.vocab_size\}",
    ):
        ddplab.run(
            compose_cfg(
                LM
                + [
                    f"dataset.path={d / 'train.bin'}",
                    f"dataset.val_path={d / 'val.bin'}",
                    "dataset.vocab_size=330",
                    "model.vocab_size=256",
                ],
                tmp_path / "run",
            )
        )
