"""Subword token ids for token files (``scripts/make_tokens.py``): a local Hugging Face ``tokenizer.json``, or
a byte-level BPE trained on the text itself. Nothing is downloaded. Needs Hugging Face ``tokenizers`` (the
``hf`` extra); its absence is one line naming it.

A corpus bigger than memory is encoded a chunk at a time, in worker processes, and the ids are the ones the
whole text would get: a chunk is cut only at a line break between two non-space characters (``...x\\nY...``),
where every common pre-tokenizer (byte-level, whitespace, BERT's) ends a piece anyway, and each cut is checked
(the two lines around it encoded together and apart) so a tokenizer whose pieces cross it is refused, not
silently encoded differently.

A run keeps the tokenizer its ids came from in its dir (``keep``), so that export and generate find it from
the run dir alone (``of_run``); a run over bytes gets one whose ids are the bytes (``byte_level``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import re
import shutil
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ddplab.errors import InputError

# a line break between two non-space bytes: where chunks may be cut
CUT = re.compile(rb"(?<=[^\s])\n(?=[^\s])")
MAX_CARRY = 64 << 20  # bytes without any such break before the text is refused (no exact cut is possible)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise InputError(
            "a subword tokenizer needs Hugging Face tokenizers, which is not installed. "
            "Fix: pip install 'ddplab[hf]'"
        ) from None
    return tokenizers


def load(path: str | Path) -> Any:
    """The tokenizer of a local ``tokenizer.json``; one line if it is missing or not one."""
    path = Path(path)
    if not path.is_file():
        raise InputError(
            f"--tokenizer {path}: no such file. Fix: the path of a local tokenizer.json "
            "(tokenizer.save(path) writes one), or --train-bpe VOCAB to train one on the text"
        )
    try:
        return _tokenizers().Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a plain Exception with serde's message
        raise InputError(
            f"--tokenizer {path}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}). "
            "Fix: a file written by tokenizers' Tokenizer.save"
        ) from None


def train_bpe(lines: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2's pre-tokenizer, every byte in its alphabet: no unknown token) of
    ``vocab_size`` ids, trained on ``lines``. Deterministic: the same text gives the same tokenizer."""
    if vocab_size <= 256:
        raise InputError(
            f"--train-bpe {vocab_size}: a byte-level BPE has the 256 bytes as its first ids. "
            "Fix: a vocabulary above 256 (e.g. 4096), or no tokenizer for bytes as ids"
        )
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def describe(tok: Any, path: Path) -> dict[str, Any]:
    """What a token file's sidecar records of the tokenizer that wrote it (saved at ``path``)."""
    return {
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "vocab_size": tok.get_vocab_size(),
        "model": json.loads(tok.to_str())["model"]["type"],
    }


def _text(data: bytes, start: int, errors: str = "strict") -> str:
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as e:
        raise InputError(
            f"byte {start + e.start} of the text is not UTF-8 ({e.reason}). Fix: convert the file "
            "to UTF-8 (iconv -t utf-8), or write its bytes as tokens without --tokenizer"
        ) from None


def pieces(chunks: Iterable[bytes], split_at: int, last_errors: str = "strict") -> Iterator[tuple[int, str]]:
    """(part, text) of a byte stream cut where ids cannot change: part 0 up to the first cut at or after byte
    ``split_at``, part 1 after it (a train/val split), each piece ending at a cut but the last (decoded with
    ``last_errors``: "ignore" where the stream was cut short at any byte)."""
    carry, seen, part = b"", 0, 0
    for chunk in chunks:
        buf, start = carry + chunk, seen - len(carry)
        seen += len(chunk)
        cuts = [m.end() for m in CUT.finditer(buf)]
        if part == 0 and start + len(buf) > split_at:
            at = next((c for c in cuts if start + c >= split_at), None)
            if at is not None:
                yield 0, _text(buf[:at], start)
                buf, start, part = buf[at:], start + at, 1
                cuts = [c - at for c in cuts if c > at]
        if not cuts:
            if len(buf) > MAX_CARRY:
                raise InputError(
                    f"bytes {start}-{start + len(buf)}: no line break between two non-space "
                    f"characters in {MAX_CARRY >> 20} MB, so no exact place to cut the text. Fix: "
                    "break its lines, or encode it with your tokenizer and ddplab.data.write_tokens"
                )
            carry = buf
            continue
        yield part, _text(buf[: cuts[-1]], start)
        carry = buf[cuts[-1] :]
    if carry:
        yield part, _text(carry, seen - len(carry), last_errors)


def check_cut(tok: Any, before: str, after: str) -> None:
    """The ids of the last line before a cut and the first after it, encoded together, are their ids apart."""
    a, b = before[before.rfind("\n", 0, len(before) - 1) + 1 :], after[: after.find("\n") + 1 or len(after)]
    together, apart = (
        tok.encode(a + b, add_special_tokens=False).ids,
        (tok.encode(a, add_special_tokens=False).ids + tok.encode(b, add_special_tokens=False).ids),
    )
    if together != apart:
        raise InputError(
            f"the tokenizer encodes {a[-30:] + b[:30]!r} differently whole and cut at its line break "
            "(a prefix space or a piece across lines), so a file cannot be encoded a chunk at a time "
            "exactly. Fix: a tokenizer whose pre-tokenizer splits at line breaks (add_prefix_space="
            "false), or encode it yourself and write the ids with ddplab.data.write_tokens"
        )


_WORKER: Any = None


def _init(tok_json: str) -> None:
    global _WORKER
    _WORKER = _tokenizers().Tokenizer.from_str(tok_json)


def _encode(text: str) -> np.ndarray:
    return np.asarray(_WORKER.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def encode(tok: Any, texts: Iterable[tuple[int, str]], workers: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """(part, ids) of each (part, text) piece, in order; ``workers`` > 1: encoded in that many processes, at
    most two pieces each in flight (memory stays bounded by the chunk size, whatever the corpus)."""
    last = None
    if workers <= 1:
        _init(tok.to_str())
        for part, text in texts:
            if last is not None:
                check_cut(tok, last, text)
            last = text
            yield part, _encode(text)
        return
    ctx = multiprocessing.get_context("spawn")  # tokenizers' threads do not survive a fork
    with ctx.Pool(workers, initializer=_init, initargs=(tok.to_str(),)) as pool:
        pending: deque = deque()
        for part, text in texts:
            if last is not None:
                check_cut(tok, last, text)
            last = text
            pending.append((part, pool.apply_async(_encode, (text,))))
            if len(pending) >= 2 * workers:
                done = pending.popleft()
                yield done[0], done[1].get()
        while pending:
            done = pending.popleft()
            yield done[0], done[1].get()


# --------------------------------------------------------------------------- the run's tokenizer
RUN_FILE = "tokenizer.json"  # the copy a run keeps in its dir (keep): export and generate read it first


def named_by(dataset: Any) -> Path | None:
    """The tokenizer.json a dataset config's ids come from: dataset.tokenizer (dataset=hf), or the one the
    token files' sidecar names (dataset=tokens and token_shards: saved beside them by make_tokens.py, its
    hash checked); None for bytes, or ids written without a tokenizer ddplab knows of."""
    if dataset.get("tokenizer"):
        return Path(str(dataset.tokenizer)).expanduser()
    path = dataset.get("path")
    if not path or "tokens" not in str(dataset.get("_target_", "")):
        return None
    path = Path(str(path)).expanduser()
    first = path if path.is_file() else next(iter(sorted(path.glob("*.bin"))), None)
    side = Path(f"{first}.json") if first else None
    if side is None or not side.is_file():
        return None
    meta = json.loads(side.read_text()).get("tokenizer")
    if not meta:
        return None
    for folder in (side.parent, side.parent.parent):  # beside a token file, or above a folder of shards
        f = folder / meta["file"]
        if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() == meta["sha256"]:
            return f
    return None


def keep(dataset: Any, run_dir: Path) -> None:
    """The run's own copy of its tokenizer (``<run dir>/tokenizer.json``), so that the run dir alone samples
    and exports with it, wherever the data went."""
    try:
        src = named_by(dataset)
        if src is not None and src.is_file():
            shutil.copyfile(src, run_dir / RUN_FILE)
    except (OSError, ValueError, KeyError, TypeError):  # a sidecar that is not one: the dataset says so
        pass


def of_run(cfg: Any, run_dir: Path | None) -> tuple[Any, str] | None:
    """The tokenizer a task=lm run's ids mean, and where it came from: the run's copy, the one its dataset
    names, or bytes (a vocabulary of 256 and no tokenizer named); None where ddplab cannot know it."""
    if run_dir is not None and (run_dir / RUN_FILE).is_file():
        return load(run_dir / RUN_FILE), f"the run's tokenizer ({RUN_FILE} in its dir)"
    named = named_by(cfg.dataset)
    if named is not None:
        return load(named), f"the run's tokenizer ({named.name}, named by its dataset)"
    target = str(cfg.dataset.get("_target_", ""))
    if cfg.dataset.get("vocab_size") == 256 and target.endswith((".text", ".tokens", ".token_shards")):
        return byte_level(), "a byte-level tokenizer (the run's ids are the text's UTF-8 bytes)"
    return None


def byte_level() -> Any:
    """A tokenizer whose ids are the text's UTF-8 bytes, as a byte-level run's are: GPT-2's alphabet of one
    character per byte, in byte order, and no merges (decoding gives the bytes back)."""
    tk = _tokenizers()
    vocab = {ch: b for b, ch in enumerate(_byte_chars())}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte 0-255: itself where printable, else 256 + n in order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
