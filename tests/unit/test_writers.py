"""Rank 0's TensorBoard writer: opened beside the steps, never in the loop's first log step."""

from __future__ import annotations

import threading

import pytest
import torch.utils.tensorboard
from helpers.compare import tb_texts
from helpers.jobs import compose_cfg
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddplab.errors import ResourceError
from ddplab.writers import TensorBoardWriter


@pytest.fixture
def opened_on(monkeypatch) -> list[str]:
    """The names of the threads that constructed a SummaryWriter."""
    names: list[str] = []

    class Recorded(torch.utils.tensorboard.SummaryWriter):
        def __init__(self, *args, **kwargs):
            names.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", Recorded)
    return names


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_training_opens_the_event_file_beside_its_steps_and_logs_every_log_step(tmp_path, opened_on):
    """Opened at the first log step (step 5 here), importing TensorBoard and opening the file stalled the loop
    by 0.1-0.4 s; the Trainer now asks for it after the first step, and a thread of its own opens it."""
    from ddplab.runtime import group
    from ddplab.train.assemble import build_state
    from ddplab.train.loop import Trainer

    cfg = compose_cfg(
        [
            "model=mlp",
            "dataset=synthetic",
            "dataset.num_train=160",
            "dataset.num_val=32",
            "dataset.image_size=4",
            "batch_size=16",
            "num_epochs=1",
            "log_every_n_steps=5",
            "progress=none",
        ],
        run_dir=tmp_path,
    )
    dist = group.init(cfg.distributed)
    try:
        trainer = Trainer(build_state(cfg, dist, tmp_path))
        trainer.train_epoch()
        trainer.state.writer.close()
    finally:
        group.teardown()
    assert opened_on == ["ddplab-tensorboard"]
    assert [step for step, _ in scalars(tmp_path / "tb")["train/loss"]] == [5, 10]


def test_text_written_before_the_file_opens_lands_in_it_once(tmp_path, opened_on):
    w = TensorBoardWriter(str(tmp_path))
    w.text("config", "lr: 0.1")
    w.open_soon()
    w.open_soon()  # asked again: still one file, one thread
    w.scalars({"train/loss": 2.5}, 3)
    w.close()
    assert opened_on == ["ddplab-tensorboard"]
    assert tb_texts(tmp_path, "config") == {0: "lr: 0.1"}
    assert scalars(tmp_path)["train/loss"] == [(3, 2.5)]


def test_a_file_that_cannot_open_on_its_thread_is_said_in_one_line_at_the_next_write(tmp_path):
    (tmp_path / "taken").write_text("a file where the run's folder would be")
    log_dir = tmp_path / "taken" / "tb"
    w = TensorBoardWriter(str(log_dir))
    w.open_soon()
    with pytest.raises(ResourceError) as e:
        w.scalars({"train/loss": 1.0}, 1)
    assert str(e.value).startswith(f"could not write TensorBoard events to {log_dir}: ")
    assert "Fix: free space" in str(e.value)


@pytest.mark.slow  # TensorBoard's files of one second: the second file waits for the next (1-2 s)
def test_a_purge_decided_after_the_file_opened_on_its_thread_still_drops_the_later_steps(tmp_path):
    """As test_dashboards' purge test, the file opened by open_soon: the next write opens a purging file."""
    first = TensorBoardWriter(str(tmp_path))
    for step in (1, 2, 3):
        first.scalars({"train/loss": float(step)}, step)
    first.close()
    resumed = TensorBoardWriter(str(tmp_path))
    resumed.open_soon()
    resumed.purge_after(1)
    resumed.scalars({"train/loss": 20.0}, 2)
    resumed.close()
    assert scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 20.0)]
