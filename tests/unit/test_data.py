"""Samplers and in-memory datasets, in-process: who gets which sample at any world size, that the split is
fixed, reshuffles and accumulation, the bijection order, batched augmentation, and batches of any nesting on
their way to the device."""

import os

import pytest
import torch

from ddplab.data import ShardedGlobalSampler, digits, eval_shard, synthetic
from ddplab.runtime.env import consume_legacy_local_rank


def rank_batches(n, gb, world, epoch, accum=1, seed=0):
    out = []
    for r in range(world):
        s = ShardedGlobalSampler(n, gb, world, r, seed, accum)
        s.set_epoch(epoch)
        out.append(s.batches())
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_are_disjoint_and_cover_whole_steps(world):
    n, gb = 1001, 48  # 1001 % 48 != 0: an incomplete last global batch
    per_rank = rank_batches(n, gb, world, epoch=3)
    flat = torch.cat([b.reshape(-1) for b in per_rank])
    assert len(flat) == len(set(flat.tolist())) == (n // gb) * gb  # disjoint, no padding duplicates
    assert all(b.shape == (n // gb, gb // world) for b in per_rank)


def test_global_order_is_the_same_for_any_world_size():
    n, gb = 1001, 48
    ref = rank_batches(n, gb, 1, epoch=2)[0]  # (steps, 48)
    for world in (2, 3):
        per_rank = rank_batches(n, gb, world, epoch=2)
        joined = torch.cat(per_rank, dim=1)  # micro-batch m = ranks' slices side by side
        assert torch.equal(joined, ref)


def test_epochs_reshuffle_reproducibly():
    a0, a1 = rank_batches(500, 50, 2, 0)[0], rank_batches(500, 50, 2, 1)[0]
    assert not torch.equal(a0, a1)
    assert torch.equal(a1, rank_batches(500, 50, 2, 1)[0])
    assert not torch.equal(a1, rank_batches(500, 50, 2, 1, seed=1)[0])


def test_accumulation_drops_only_incomplete_optimizer_steps():
    s = ShardedGlobalSampler(1000, 64, 2, 0, 0, grad_accum_steps=3)  # 192 samples per step
    assert s.steps_per_epoch == 5 and s.num_micro_batches == 15 and len(s) == 15 * 32
    assert len(list(iter(s))) == len(s)


@pytest.mark.parametrize("n,world", [(359, 2), (7, 3), (2, 3)])
def test_eval_shards_count_every_sample_once(n, world):
    shards = [eval_shard(n, world, r) for r in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_digits_split_is_fixed_and_normalised():
    a, b = digits(), digits()
    assert len(a.train) == 1438 and len(a.val) == 359 and a.num_classes == 10
    assert a.train.x.shape[1:] == (1, 8, 8)
    assert torch.equal(a.val.y, b.val.y) and torch.equal(a.val.x, b.val.x)
    assert abs(a.train.x.mean().item()) < 1e-4 and abs(a.train.x.std().item() - 1) < 1e-3
    with pytest.raises(ValueError, match="dataset.num_classes=5"):
        digits(num_classes=5)


def test_synthetic_is_seeded_and_shaped():
    a = synthetic(num_train=20, num_val=5, num_classes=4, in_channels=2, image_size=6, seed=3)
    assert a.train.x.shape == (20, 2, 6, 6) and len(a.val) == 5 and int(a.train.y.max()) < 4
    assert torch.equal(
        a.train.x,
        synthetic(num_train=20, num_val=5, num_classes=4, in_channels=2, image_size=6, seed=3).train.x,
    )


@pytest.mark.parametrize(
    "argv,kept,local",
    [
        (["train.py", "--local-rank=1", "model=mlp"], ["train.py", "model=mlp"], "1"),
        (["train.py", "--local_rank=2"], ["train.py"], "2"),
        (["train.py", "--local_rank", "3", "x=1"], ["train.py", "x=1"], "3"),
    ],
)
def test_legacy_launcher_local_rank_is_consumed(monkeypatch, argv, kept, local):
    # setenv first: a bare delenv of an absent key records nothing, and the LOCAL_RANK written below would
    # outlive the test (on a GPU host every later in-process run would then ask for cuda:1)
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("LOCAL_RANK")
    assert consume_legacy_local_rank(argv) == kept
    assert os.environ["LOCAL_RANK"] == local


def test_batched_random_crop_and_flip_match_a_per_sample_reference():
    from ddplab.data import BatchAugment

    x = torch.randn(16, 3, 8, 8)
    aug = BatchAugment(crop_padding=2, hflip=True)
    torch.manual_seed(5)
    out = aug(x)
    # Replay the same random draws and build each sample by hand.
    torch.manual_seed(5)
    dy, dx = torch.randint(0, 5, (16, 1)), torch.randint(0, 5, (16, 1))
    flip = torch.rand(16) < 0.5
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(16):
        ref = padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8]
        assert torch.equal(out[i], ref.flip(2) if flip[i] else ref)
    assert out.shape == x.shape
    assert (
        0 < flip.sum() < 16 and len({(a, b) for a, b in zip(dy.view(-1).tolist(), dx.view(-1).tolist())}) > 3
    )


def test_augmentation_off_is_the_identity_and_negative_padding_is_refused():
    from ddplab.data import BatchAugment

    x = torch.randn(4, 1, 8, 8)
    assert not BatchAugment().enabled and torch.equal(BatchAugment()(x), x)
    with pytest.raises(ValueError, match="crop_padding=-1"):
        BatchAugment(crop_padding=-1)


def test_batches_of_namedtuples_lists_and_dicts_keep_their_types_on_the_way_to_the_device():
    """A user's collate may yield any nesting; the trainer moves it (map_tensors) and the task finds the
    tensors (tensors) without knowing its shape."""
    import collections

    from ddplab.data.batches import first_tensor, map_tensors, tensors

    Pair = collections.namedtuple("Pair", "x y")
    x, y, m = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 0]), torch.ones(2)
    batch = [Pair(x, y), {"mask": m, "name": "digits"}, (y,)]
    doubled = map_tensors(batch, lambda t: t * 2)
    assert type(doubled) is list and type(doubled[0]) is Pair and type(doubled[2]) is tuple
    assert torch.equal(doubled[0].x, x * 2) and torch.equal(doubled[0].y, y * 2)
    assert torch.equal(doubled[1]["mask"], m * 2) and doubled[1]["name"] == "digits"  # non-tensors untouched
    assert [where for where, _ in tensors(batch)] == [
        "batch[0][0]",
        "batch[0][1]",
        "batch[1]['mask']",
        "batch[2][0]",
    ]
    assert first_tensor(batch) is x and first_tensor([{"name": "none"}]) is None


# ------------------------------------------------------------------ constant-memory order (token files)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097, 65536, 65537])
def test_an_index_bijection_is_a_seeded_permutation_of_range_n(n):
    import numpy as np

    from ddplab.data.bijection import IndexBijection

    order = IndexBijection(n, seed=5)(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    # the same order on every rank and machine
    assert (IndexBijection(n, seed=5)(np.arange(n)) == order).all()
    if n >= 1000:
        other = IndexBijection(n, seed=6)(np.arange(n))
        assert (other != order).mean() > 0.99 and abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.1


def test_the_bijection_order_gives_the_same_global_batches_at_any_world_size_and_resumes_by_position():
    n, gb, accum = 10_007, 12, 2
    per_world = {}
    for ws in (1, 2, 3):
        ranks = [
            ShardedGlobalSampler(n, gb, ws, r, seed=3, grad_accum_steps=accum, order="bijection")
            for r in range(ws)
        ]
        for s in ranks:
            s.set_epoch(4)
        rows = [list(s) for s in ranks]  # each rank's indices, micro-batch after micro-batch
        per_rank = gb // ws
        per_world[ws] = [
            i
            for mb in range(ranks[0].num_micro_batches)
            for r in range(ws)
            for i in rows[r][mb * per_rank : (mb + 1) * per_rank]
        ]
    assert per_world[1] == per_world[2] == per_world[3]
    epoch = per_world[1]
    # each window at most once, whole steps
    assert len(epoch) == len(set(epoch)) == (n // (gb * accum)) * gb * accum
    s = ShardedGlobalSampler(n, gb, 2, 1, seed=3, grad_accum_steps=accum, order="bijection")
    s.set_epoch(4, skip=7)  # a mid-epoch resume after 7 micro-batches
    assert list(s) == [i for mb in range(7, s.num_micro_batches) for i in epoch[mb * gb + 6 : mb * gb + 12]]
    s.set_epoch(5)
    assert list(s)[:6] != epoch[6:12]  # a new order each epoch
    assert s.batches().tolist()[3] == list(s)[18:24]  # the indexed path holds the same order
