"""The soak's data, written once per soak run beside its trials: a token file, a folder of token shards, and
JSONL text with a BPE trained on it (scripts/soak.py)."""

from __future__ import annotations

import json
from pathlib import Path

from soak_plan import HF_VOCAB, TOKEN_BLOCK, TOKEN_WINDOWS


def token_file(root: Path) -> Path:
    """The data=tokens trials' token file, written once per soak run beside the trials (bytes of a generated
    corpus: TOKEN_WINDOWS windows of TOKEN_BLOCK tokens)."""
    from ddplab.data import write_tokens
    from ddplab.data.tabular import generated_corpus

    path = root / "tokens.bin"
    if not path.exists():
        text = generated_corpus(sentences=4000, seed=0).encode()[: TOKEN_WINDOWS * TOKEN_BLOCK + 1]
        write_tokens(list(text), path, "uint16", 256)
    return path


def shard_dir(root: Path) -> Path:
    """The data=shards trials' folder: the same corpus as the token file, its first 90% as 4 token files under
    train/ (streamed shard by shard), the rest as val.bin."""
    from ddplab.data import write_tokens
    from ddplab.data.tabular import generated_corpus

    folder = root / "shards"
    if not folder.exists():
        text = list(generated_corpus(sentences=4000, seed=0).encode()[: TOKEN_WINDOWS * TOKEN_BLOCK + 1])
        (folder / "train").mkdir(parents=True)
        cut, n = TOKEN_WINDOWS * 9 // 10 * TOKEN_BLOCK, 4
        for i in range(n):
            write_tokens(
                text[i * cut // n : (i + 1) * cut // n + 1],
                folder / "train" / f"shard-{i:04d}.bin",
                "uint16",
                256,
            )
        write_tokens(text[cut:], folder / "val.bin", "uint16", 256)
    return folder


def hf_dir(root: Path) -> Path:
    """The data=hf/hf_stream trials' folder: the generated corpus's sentences as JSONL rows (``text``), a BPE
    of at most HF_VOCAB ids trained on them, and enough rows for TOKEN_WINDOWS windows of TOKEN_BLOCK ids (the
    last tenth of the windows' rows for validation), as the token file has."""
    from ddplab.data.tabular import generated_corpus
    from ddplab.data.tokenizer import train_bpe

    folder = root / "hf"
    if (folder / "val.jsonl").exists():
        return folder
    folder.mkdir()
    lines = [
        sentence + "."
        for sentence in generated_corpus(sentences=12000, seed=0).split(".")
        if sentence.strip()
    ]
    tok = train_bpe(lines, HF_VOCAB)
    tok.save(str(folder / "tokenizer.json"))
    rows, ids, cut = [[], []], 0, TOKEN_WINDOWS * 9 // 10 * TOKEN_BLOCK + 1
    for line in lines:  # rows until the training split holds its windows, then as many for validation
        part = 0 if ids < cut else 1
        rows[part].append(line)
        ids += len(tok.encode(line).ids)
        if ids >= cut + TOKEN_WINDOWS // 10 * TOKEN_BLOCK + 1 + TOKEN_BLOCK:
            break
    for name, part in (("train", rows[0]), ("val", rows[1])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in part))
    return folder
