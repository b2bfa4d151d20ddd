"""dataset=hf (issue 34, item 2): local Parquet / JSON Lines / CSV / Arrow files through Hugging Face datasets
— text tokenized with a locally trained BPE into language-model windows, or one labelled sample per row — then
ddplab's own sampler: bitwise resume here; the same run at 1 and 2 ranks in
tests/integration/test_hf_integration.py. An already node-split stream is refused."""

from __future__ import annotations

import pytest
import torch
from helpers.compare import assert_same_checkpoint
from helpers.hf_data import corpus, datasets, lm_args, source
from helpers.jobs import compose_cfg, run_killed_after_step

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.data import tokenizer as tz
from ddplab.data.hf import hf


def node_split_stream(**_: object):
    """A user's factory returning a Hugging Face stream already split by node (as the datasets docs show)."""
    from datasets.distributed import split_dataset_by_node

    rows = datasets.Dataset.from_dict({"x": [[float(i)] for i in range(64)], "y": [i % 2 for i in range(64)]})
    stream = split_dataset_by_node(rows.to_iterable_dataset(), rank=0, world_size=2)
    return stream, stream


@pytest.mark.slow  # 1.4-2.1 s in the inner loop: a second or more, as the marker says
def test_text_rows_become_the_windows_of_their_ids_joined_in_row_order(tmp_path):
    train, val, texts = corpus(tmp_path)
    s = source(tmp_path, train, val, cache_dir=str(tmp_path / "cache"))
    tok = tz.load(tmp_path / "tokenizer.json")
    ids = [t for text in texts for t in tok.encode(text).ids]
    n = (len(ids) - 1) // 16
    assert len(s.train) == n and s.num_classes == 320
    assert s.train.x[5].tolist() == ids[80:96] and s.train.y[5].tolist() == ids[81:97]
    assert len(s.val) > 0 and s.val.x.dtype == torch.int64


@pytest.mark.slow
def test_a_language_model_on_parquet_text_resumes_bitwise(tmp_path):
    args = lm_args(tmp_path) + ["num_epochs=2", "checkpoint.every_n_steps=4", "optimizer=adamw"]
    ref = ddplab.run(compose_cfg(args, tmp_path / "ref"))
    steps = ref["step"] // 2
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), steps + 2)  # mid-epoch 2
    rest = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    assert_same_checkpoint(
        tmp_path / "ref" / "checkpoints" / "last.pt", tmp_path / "run" / "checkpoints" / "last.pt"
    )
    assert rest["val/loss"] == ref["val/loss"]


@pytest.mark.slow
def test_labelled_text_rows_train_a_sequence_classifier_with_exact_accuracy(tmp_path):
    pytest.importorskip("transformers")
    train, _, texts = corpus(tmp_path)
    labels = [int("dog" in t) for t in texts]
    datasets.Dataset.from_dict({"review": texts, "label": labels}).to_json(tmp_path / "labelled.jsonl")
    args = [
        "dataset=hf",
        f"dataset.path={tmp_path / 'labelled.jsonl'}",
        "dataset.x=review",
        "dataset.y=label",
        "dataset.num_classes=2",
        f"dataset.tokenizer={tmp_path / 'tokenizer.json'}",
        "dataset.vocab_size=320",
        "dataset.block_size=24",
        "dataset.pad_id=0",
        "model=hf",
        "model.kind=sequence_classification",
        "model.num_labels=2",
        "model.config.n_embd=32",
        "model.config.n_layer=1",
        "model.config.n_head=2",
        "+model.config.pad_token_id=0",
        "batch_size=16",
        "num_epochs=1",
        "progress=none",
        "optimizer=adamw",
        f"dataset.cache_dir={tmp_path / 'cache'}",
    ]
    out = ddplab.run(compose_cfg(args, tmp_path / "run"))
    n = int(out["val/num_samples"])
    assert n == 21 and out["val/acc"] * n == round(out["val/acc"] * n)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "arrow"])
def test_every_file_format_gives_the_parquet_files_samples(tmp_path, fmt):
    rows = datasets.Dataset.from_dict(
        {"f": [[float(i), float(-i)] for i in range(50)], "label": [i % 3 for i in range(50)]}
    )
    rows.to_parquet(tmp_path / "d.parquet")
    if fmt == "jsonl":
        rows.to_json(tmp_path / "d.jsonl")
    elif fmt == "csv":  # CSV has no lists: one number a column, x the first
        datasets.Dataset.from_dict(
            {"f": [float(i) for i in range(50)], "label": [i % 3 for i in range(50)]}
        ).to_csv(tmp_path / "d.csv", index=False)
    else:
        (tmp_path / "arrow").mkdir()
        rows.save_to_disk(tmp_path / "arrow")
    path = next((tmp_path / "arrow").glob("*.arrow")) if fmt == "arrow" else tmp_path / f"d.{fmt}"
    got = hf(str(path), x="f", y="label", num_classes=3, cache_dir=str(tmp_path / "cache"))
    want = hf(str(tmp_path / "d.parquet"), x="f", y="label", num_classes=3, cache_dir=str(tmp_path / "cache"))
    assert torch.equal(got.train.y, want.train.y) and torch.equal(got.val.y, want.val.y) and len(got.val) == 5
    if fmt != "csv":
        assert torch.equal(got.train.x, want.train.x)


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "dataset.x=body",
            r"dataset.x=body: no such column; the data has \['text', 'id'\]. Fix: dataset.x=<one of them>",
        ),
        (
            "dataset.tokenizer=null",
            r"dataset.x is a text column, so it needs dataset.tokenizer=<a local tokenizer.json>",
        ),
        (
            "dataset.vocab_size=256",
            r"dataset.path: token id 3\d\d >= dataset.vocab_size=256. Fix: dataset.vocab_size=",
        ),
    ],
)
def test_what_the_files_do_not_fit_is_one_config_error(tmp_path, override, said):
    with pytest.raises(ConfigError, match=said):
        ddplab.run(compose_cfg(lm_args(tmp_path) + [override], tmp_path / "run"))


def test_a_stream_already_split_by_node_is_refused_in_one_line(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"its training stream is already split by node \(split_dataset_by_node: "
        r"rank 0 of 2\).*Fix: return the dataset before split_dataset_by_node",
    ):
        ddplab.run(
            compose_cfg(
                ["model=mlp", "dataset._target_=integration.test_hf_data.node_split_stream", "progress=none"],
                tmp_path / "run",
            )
        )
