"""ddplab.data.streams in one process: every rank slices the same global batches and each sample comes once,
validation splits contiguously, a short stream or a shuffle that differs between ranks is named, sample ids do
not depend on objects' addresses, and what a stream cannot do is refused in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import toy
from helpers.jobs import compose_cfg
from helpers.streams import STREAM, ids, loader, stream

from ddplab import build
from ddplab.config.errors import ConfigError
from ddplab.data.streams import StreamEnded, sample_id, stream_differs, stream_eval_batches


# --------------------------------------------------------------------------- in-process
def test_ranks_slice_the_same_global_batches_and_each_sample_comes_once():
    whole = ids(loader(stream(), 1, 0))
    assert len(whole) == 100 // 12 and len({i for b in whole for i in b}) == 96  # 8 whole batches, no repeats
    for world in (2, 3):
        parts = [ids(loader(stream(), world, r)) for r in range(world)]
        assert [sum((p[k] for p in parts), []) for k in range(len(whole))] == whole, world


def test_a_short_stream_says_so_and_a_resume_without_its_position_is_refused():
    short = toy.DigitStream(torch.zeros(50, 1), torch.arange(50), short_on_rank=0, short=20)
    with pytest.raises(
        StreamEnded,
        match=r"DigitStream ended after 2 global batches of 12 in epoch 1, but its "
        r"__len__ \(50\) promises 4. Fix: make __len__",
    ):
        ids(loader(short, 1, 0))
    lost = loader(stream(), 1, 0)
    lost.set_epoch(0, skip=2)
    with pytest.raises(RuntimeError, match=r"no saved stream position for epoch 0, micro-batch 2"):
        ids(lost)


def test_validation_streams_split_contiguously_each_sample_on_one_rank():
    val = toy.ValStream(torch.zeros(10, 1), torch.arange(10))
    for world in (1, 2, 3):
        got = [
            [y.tolist() for _, y in stream_eval_batches(val, world, r, 2, torch.device("cpu"))]
            for r in range(world)
        ]
        assert sum((sum(g, []) for g in got), []) == list(range(10)), world


def test_a_reordered_first_batch_is_named_a_shuffle_that_differs_between_ranks():
    first, other = torch.tensor([3, 11, 12, 13]), torch.tensor([3, 13, 11, 12])  # (count, sample ids...)
    line = stream_differs("dataset._target_='x.y'", first, other, rank=1)
    assert line == (
        "dataset._target_='x.y': the training stream is not the same on every rank, so samples would be "
        "lost or used twice: its first global batch read has, on rank 1, the same samples in another "
        "order: it shuffles with a generator that differs between ranks (Python's random or numpy's global "
        "generator, which ddplab seeds per rank, or an unseeded one). Fix: shuffle with a generator of "
        "your own seeded from the seed and set_epoch's epoch alone"
    )
    assert sample_id((torch.ones(2), 1)) == sample_id((torch.ones(2), 1)) != sample_id((torch.ones(2), 2))


def test_a_sample_id_is_the_same_for_the_same_data_in_another_object():
    """Each rank's process makes its own objects: an id from an address (a PIL image's or a plain object's
    repr) refused a stream that was the same on every rank; numpy's repr elides, so it missed differences."""
    from PIL import Image

    class Record:  # a user's sample type with the default repr: '<Record object at 0x7f...>'
        pass

    a, b = np.zeros(5000), np.zeros(5000)
    b[2500] = 1.0
    assert repr(a) == repr(b) and sample_id(a) != sample_id(b) and sample_id(a) == sample_id(np.zeros(5000))
    img = lambda v: Image.new("RGB", (4, 4), (v, 0, 0))  # noqa: E731
    assert sample_id((img(1), 3)) == sample_id((img(1), 3)) != sample_id((img(2), 3))
    one, two = Record(), Record()  # both alive: two addresses
    assert sample_id(one) == sample_id(two) and sample_id("ab") != sample_id(b"ab ")
    assert (
        sample_id({"text": "hello", "n": 2})
        == sample_id({"text": "hello", "n": 2})
        != sample_id({"text": "hellp", "n": 2})
    )


ONE_RANK = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))


def test_overfit_batches_on_a_stream_is_refused_in_one_line(tmp_path):
    cfg = compose_cfg(STREAM + ["overfit_batches=1"], tmp_path / "run")
    with pytest.raises(
        ConfigError,
        match=r"overfit_batches: not for an IterableDataset \(dataset._target_="
        r"'toy.digit_stream'\). Fix: drop overfit_batches",
    ):
        build.train_data(cfg, ONE_RANK, 48, 1)


def test_a_stream_without_len_is_refused_in_one_line(tmp_path):
    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield torch.zeros(1), 0

    data = SimpleNamespace(train=Endless(), val=Endless(), collate_fn=None)
    with pytest.raises(
        ConfigError, match=r"its training IterableDataset has no __len__. Fix: give it __len__"
    ):
        build._stream_data(compose_cfg(STREAM, tmp_path / "run"), ONE_RANK, data, None, 48, 1)


def test_a_position_saved_with_other_loader_workers_is_refused_in_one_line():
    """The order in which workers hand over samples is part of the stream: a mid-epoch position saved with 0
    workers means other samples with 2 (torchdata would fail on it with an AssertionError)."""
    first = loader(stream(), 1, 0, workers=0)
    first.set_epoch(1)
    it = iter(first)
    next(it), next(it)
    again = loader(stream(), 1, 0, workers=2)
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    again.set_epoch(1, skip=2)
    with pytest.raises(
        ConfigError,
        match=r"^perf.num_workers=2: the checkpoint stopped mid-epoch \(epoch 2, micro-batch "
        r"2\) in a stream read with perf.num_workers=0.* Fix: resume with "
        r"perf.num_workers=0 \(change it at an epoch's end\)$",
    ):
        ids(again)
