"""IterableDatasets (ddplab.data.streams) through loaders, workers and real ranks: one global stream that
every rank slices — the same global batches at any world size, each sample once per epoch, every rank the same
number of steps, the loader's (and its workers') state in the checkpoint, bitwise kill + resume, and a resume
at another world size that loses or doubles nothing; a stream that differs between ranks is refused."""

from __future__ import annotations

import json
import pickle
import re
from collections import namedtuple

import numpy as np
import pytest
import torch
import toy
from helpers.compare import assert_same_checkpoint, result
from helpers.data_ranks import (
    assert_failed_saying,
    metrics_at_world_sizes,
    rank_1_killed_at_step_13,
    resumed_at_2_and_3,
)
from helpers.jobs import assert_ok, compose_cfg, python_train, run_killed_after_step, torchrun
from helpers.streams import STREAM, ids, loader, stream

import ddplab


@pytest.mark.parametrize("stateful,workers", [(True, 0), (False, 0), (True, 2), (False, 2)])
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_checkpointed_position_continues_where_it_stopped(stateful, workers):
    """The loader's state after 3 batches (torchdata: the dataset's own state in each worker, or a replay)
    makes a fresh loader yield exactly the rest; at another world size too, since the state is the
    stream's."""
    ref = loader(stream(stateful=stateful), 2, 1, workers)
    ref.set_epoch(1)
    full = ids(ref)
    first = loader(stream(stateful=stateful), 2, 1, workers)
    first.set_epoch(1)
    it = iter(first)
    head = [next(it)[1].tolist() for _ in range(3)]
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds, plain
    for world, rank in ((2, 1), (3, 2)):
        again = loader(stream(stateful=stateful), world, rank, workers)
        again.load_state_dict(saved)
        again.set_epoch(1, skip=3)
        rest = ids(again)
        if world == 2:
            assert head + rest == full
        else:  # rank 2 of 3 keeps samples 8..11 of each later global batch
            whole = loader(stream(stateful=stateful), 1, 0, workers)
            whole.set_epoch(1)
            assert rest == [b[8:12] for b in ids(whole)[3:]]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow  # a second or more: loader workers start
def test_a_position_saves_the_same_state_whether_or_not_the_loader_was_resumed_on_the_way(workers):
    """The soak's seed 569002207 (verify_resume failed: checkpoints differed only in torchdata's count of the
    requests sent to the workers, which a resume restarts with a fresh batch in flight and a worker whose
    stream ended wastes): the state at a position is the same for a loader that ran there and one resumed on
    the way (after 1 to 4 batches), with one worker's stream ending long before the other's, so a resumed
    run's checkpoints are bitwise those of the run it replaces; and it yields the same batches."""

    def run(batches: int, resumed_at: int | None) -> tuple[list, dict]:
        x = torch.arange(200, dtype=torch.float32)[:, None]

        def make():
            return loader(toy.UnevenDigitStream(x, torch.arange(200), short=10), 2, 1, workers)

        first, got = make(), []
        first.set_epoch(1)
        it = iter(first)
        if resumed_at is not None:
            got += [next(it)[1].tolist() for _ in range(resumed_at)]
            saved = json.loads(json.dumps(first.state_dict()))
            first = make()
            first.load_state_dict(saved)
            first.set_epoch(1, skip=resumed_at)
            it = iter(first)
        got += [next(it)[1].tolist() for _ in range(batches - len(got))]
        return got, json.loads(json.dumps(first.state_dict()))

    ref = run(6, None)
    assert [run(6, k) for k in (1, 2, 3, 4)] == [ref] * 4


# --------------------------------------------------------------------------- real runs
@pytest.mark.slow
@pytest.mark.parametrize("stateful", [True, False])
def test_kill_and_resume_mid_epoch_on_a_stream_is_bitwise(tmp_path, stateful):
    args = STREAM + [f"+dataset.stateful={stateful}", "num_epochs=2", "checkpoint.every_n_steps=5"]
    ref = ddplab.run(compose_cfg(args, tmp_path / "ref"))
    # last checkpoint: step 10 of 29, mid-epoch
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 13)
    rest = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    last = [
        torch.load(d / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
        for d in (tmp_path / "ref", tmp_path / "run")
    ]
    assert_same_checkpoint(*last, entries=("model", "optimizer", "scheduler", "loop", "data"))
    assert rest["val/loss"] == ref["val/loss"] and rest["step"] == ref["step"] == 2 * (1438 // 48)


@pytest.mark.dist
def test_a_stream_is_exact_over_world_sizes_and_a_killed_rank_resumes_at_2_and_at_3_ranks(tmp_path):
    """World sizes 1/2/3 give the same run (2 loader workers). Rank 1 SIGKILLed at step 13 of a 2-rank job
    (last checkpoint: step 10, mid-epoch) resumes bitwise at 2 ranks; at 3 ranks it ends where the
    uninterrupted run does (to float32 reduction order): no sample lost or seen twice."""
    args = STREAM + [
        "num_epochs=2",
        "checkpoint.every_n_steps=5",
        "perf.num_workers=2",
        "model.dropout=0",
        "+callbacks.soak._target_=soak_toy.SoakCallback",
    ]
    runs = metrics_at_world_sizes(args, tmp_path)
    assert runs[1]["step"] == 2 * (1438 // 48)
    for n in (2, 3):
        assert runs[n]["val/loss"] == pytest.approx(runs[1]["val/loss"], rel=1e-5), n
    # One crash, its run dir copied: each copy resumes at another world size.
    assert rank_1_killed_at_step_13(args, tmp_path).returncode != 0
    for resumed_at, run in resumed_at_2_and_3(args, tmp_path).items():
        if resumed_at == 2:
            assert_same_checkpoint(
                tmp_path / "2" / "checkpoints" / "last.pt",
                run / "checkpoints" / "last.pt",
                entries=("model", "optimizer", "scheduler", "loop", "data"),
            )
        assert result(run)["metrics"]["step"] == runs[1]["step"]
        assert result(run)["metrics"]["val/loss"] == pytest.approx(runs[1]["val/loss"], rel=1e-5)


@pytest.mark.dist
def test_a_stream_shorter_on_one_rank_stops_every_rank_naming_it(tmp_path):
    """A user's rank-dependent stream runs dry on rank 1 only: the job fails within seconds, naming the stream
    and the shortfall (no rank left waiting in a collective)."""
    args = STREAM + [
        "num_epochs=1",
        "+dataset.short_on_rank=1",
        "+dataset.short=500",
        "distributed.timeout_s=60",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    assert_failed_saying(
        torchrun(2, args, tmp_path, timeout=120),
        r"rank 1/2 failed in epoch 1, step \d+: StreamEnded: StatefulDigitStream ended after 19 global "
        r"batches of 48 in epoch 1, but its __len__ \(1438\) promises 29",
        tmp_path / "run",
    )


ON_2_RANKS = ["num_epochs=1", "limit_train_steps=3", "distributed.nproc_per_node=2"]


@pytest.mark.dist
def test_a_stream_the_same_on_every_rank_trains_and_the_start_up_line_says_ddplab_shards_it(tmp_path):
    proc = python_train(STREAM + ON_2_RANKS + [f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=180)
    assert_ok(proc)
    out = re.sub(r"^\S+ ", "", proc.stdout + proc.stderr, flags=re.M)  # without the time stamps
    assert (
        "data:\n  a stream (StatefulDigitStream, 0 worker(s)), sharded by ddplab: every rank reads the whole "
        "stream and keeps its slice of each global batch (checked: the same stream on every rank)\n"
    ) in out
    assert result(tmp_path / "run")["metrics"]["step"] == 3


@pytest.mark.dist
@pytest.mark.parametrize("how", ["shards_itself", "python_shuffle"])
def test_a_stream_that_differs_between_ranks_is_refused_in_one_line(tmp_path, how):
    """A stream that shards itself (each rank would get a quarter of the samples, half never used) or shuffles
    per rank (some samples twice, others never) is refused at its first global batch, exit 2, no traceback."""
    args = [
        "model=mlp",
        "dataset._target_=toy.rank_dependent_stream",
        f"+dataset.how={how}",
        "progress=none",
        "batch_size=48",
        *ON_2_RANKS,
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = python_train(args, tmp_path, timeout=180)
    out = proc.stdout + proc.stderr
    said = [ln for ln in out.splitlines() if "is not the same on every rank" in ln]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in out, out[-3000:]
    assert re.search(
        r"config error: dataset._target_='toy.rank_dependent_stream': the training stream is not the same "
        r"on every rank, so samples would be lost or used twice: its first global batch read has, on "
        r"rank 1, other samples \(\w+( of 48)? in common\): it shards itself by rank \(torch.distributed"
        r".get_rank\(\), datasets' split_dataset_by_node\), which ddplab then shards again, or shuffles "
        r"with a generator that differs between ranks \(Python's random or numpy's global generator, which "
        r"ddplab seeds per rank, or an unseeded one\). Fix: yield the whole stream on every rank, in an "
        r"order seeded from the seed and set_epoch's epoch alone, and let ddplab give each rank its slice$",
        said[0],
    ), said[0]
    assert result(tmp_path / "run")["status"] == "failed"


@pytest.mark.slow
def test_a_stream_resumed_mid_epoch_with_other_num_workers_exits_2_naming_both(tmp_path):
    args = STREAM + ["num_epochs=1", "checkpoint.every_n_steps=5"]
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 7)  # last checkpoint: step 5 of 29, mid-epoch
    proc = python_train(
        args + ["resume=auto", "perf.num_workers=2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path
    )
    out = proc.stdout + proc.stderr
    said = [ln for ln in out.splitlines() if "config error: " in ln]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in out, out[-3000:]
    assert (
        "config error: perf.num_workers=2: the checkpoint stopped mid-epoch (epoch 1, micro-batch 5)"
        in said[0]
    )


Pair = namedtuple("Pair", "a b")  # a sample's namedtuple (module level: pickled by reference)


def test_a_workers_samples_reach_the_rank_as_torch_would_hand_them_over():
    """Loader workers send a sample's plain CPU tensors by value (numpy bytes) rather than through shared
    memory (4x the samples/s: scripts/bench_stream_workers.py); the rank gets what torch's own conversion
    gives — the same types, dtypes, shapes and bytes; numpy arrays become tensors; bfloat16 and other dtypes
    numpy lacks go as torch sends them; containers (dict, list, tuple, namedtuple) and other values as they
    were."""
    from torch.utils.data import default_convert

    from ddplab.data.streams import _by_value, _unwrapped

    sample = {
        "x": torch.randn(3, 2)[:, 1],
        "ids": [torch.arange(4), np.arange(3, dtype=np.int16)],
        "half": (torch.ones(2, dtype=torch.bfloat16), torch.tensor([True, False])),
        "p": Pair(torch.tensor(7, dtype=torch.uint8), "text"),
        "n": 5,
        # a lazy view numpy() refuses: sent as torch sends it
        "conj": torch.conj(torch.tensor([1 + 2j])),
    }
    sent = pickle.loads(pickle.dumps(_by_value(sample)))  # as the loader's queue carries it
    assert "_ByValue" in repr(type(sent["x"])) and not isinstance(sent["half"][0], np.ndarray)
    got, want = _unwrapped(sent), default_convert(sample)

    def same(a, b) -> bool:
        if isinstance(b, torch.Tensor):
            return type(a) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(b, dict):
            return type(a) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
        if isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return type(a) is type(b) and a == b

    assert same(got, want) and got["ids"][1].dtype == torch.int16 and type(got["p"]).__name__ == "Pair"

    workers = [ids(loader(stream(), 2, 1, w)) for w in (0, 2)]  # whole batches, either way alike
    assert workers[0] == workers[1] and len(workers[0]) == 100 // 12
