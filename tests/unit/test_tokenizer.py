"""scripts/make_tokens.py's refusals (issue 34, item 3), in-process: a tokenizer whose ids cross a line break,
bad tokenizer arguments, the hf extra missing, and text that is not UTF-8 are each one line."""

from __future__ import annotations

import sys

import pytest
from helpers.extras import needs
from helpers.tokenizer import make_tokens, text_file

from ddplab.data import tokenizer as tz

needs("tokenizers", "hf")


def test_a_tokenizer_whose_ids_cross_a_line_break_is_refused_not_encoded_differently(tmp_path, monkeypatch):
    """ByteLevel(add_prefix_space=True) gives a chunk's first word a space the whole text does not have."""
    import tokenizers

    book, script = text_file(tmp_path, 1500), make_tokens()
    tok = tz.train_bpe(book.read_text(encoding="utf-8").splitlines(True), 300)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.save(str(tmp_path / "prefixed.json"))
    monkeypatch.setattr(script, "TEXT_CHUNK", 4096)
    with pytest.raises(SystemExit) as e:
        script.main([str(book), "--out", str(tmp_path / "d"), "--tokenizer", str(tmp_path / "prefixed.json")])
    assert (
        str(e.value).startswith("make_tokens.py: the tokenizer encodes ") and "\n" not in str(e.value).strip()
    )
    assert "add_prefix_space=false" in str(e.value) and not (tmp_path / "d" / "train.bin").exists()


@pytest.mark.parametrize(
    "args, said",
    [
        (["--tokenizer", "nowhere.json"], "make_tokens.py: --tokenizer nowhere.json: no such file. Fix: "),
        (
            ["--tokenizer", "book.txt"],
            "make_tokens.py: --tokenizer book.txt: not a Hugging Face tokenizer.json (",
        ),
        (
            ["--train-bpe", "200"],
            "make_tokens.py: --train-bpe 200: a byte-level BPE has the 256 bytes as its first ids",
        ),
    ],
)
def test_bad_tokenizer_arguments_are_one_line(tmp_path, monkeypatch, args, said):
    book, script = text_file(tmp_path, 200), make_tokens()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        script.main([str(book), "--out", str(tmp_path / "d")] + args)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_without_the_hf_extra_the_tokenizer_path_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    book, script = text_file(tmp_path, 200), make_tokens()
    with pytest.raises(SystemExit) as e:
        script.main([str(book), "--out", str(tmp_path / "d"), "--train-bpe", "300"])
    assert str(e.value) == (
        "make_tokens.py: a subword tokenizer needs Hugging Face tokenizers, which is not "
        "installed. Fix: pip install 'ddplab[hf]'"
    )


def test_text_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path):
    book = tmp_path / "latin1.txt"
    book.write_bytes("Le café est fermé.\nIl pleut.\n".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        make_tokens().main([str(book), "--out", str(tmp_path / "d"), "--train-bpe", "300"])
    assert str(e.value) == (
        "make_tokens.py: byte 6 of the text is not UTF-8 (invalid continuation byte). Fix: "
        "convert the file to UTF-8 (iconv -t utf-8), or write its bytes as tokens without --tokenizer"
    )
