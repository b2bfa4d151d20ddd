"""dataset=hf (issue 34, item 2): local Parquet / JSON Lines / CSV / Arrow files through Hugging Face datasets
— text tokenized with a locally trained BPE into language-model windows, or one labelled sample per row — then
ddplab's own sampler: bitwise resume here; the same run at 1 and 2 ranks in
tests/integration/test_hf_integration.py. An already node-split stream is refused."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_data import datasets, lm_args
from helpers.jobs import compose_cfg

import ddplab
from ddplab.config.errors import ConfigError
from ddplab.data.hf import hf


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


def node_split_stream(**_: object):
    """A user's factory returning a Hugging Face stream already split by node (as the datasets docs show)."""
    from datasets.distributed import split_dataset_by_node

    rows = datasets.Dataset.from_dict({"x": [[float(i)] for i in range(64)], "y": [i % 2 for i in range(64)]})
    stream = split_dataset_by_node(rows.to_iterable_dataset(), rank=0, world_size=2)
    return stream, stream


def test_a_stream_already_split_by_node_is_refused_in_one_line(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"its training stream is already split by node \(split_dataset_by_node: "
        r"rank 0 of 2\).*Fix: return the dataset before split_dataset_by_node",
    ):
        ddplab.run(
            compose_cfg(
                ["model=mlp", "dataset._target_=test_hf_data.node_split_stream", "progress=none"],
                tmp_path / "run",
            )
        )
