"""mode=verify_resume's comparison, in-process: the first difference named bitwise or to a tolerance, the
default stop mid-epoch, the likely cause from what differs first and when; under torchrun or through
ddplab.run it says how to start it."""

from __future__ import annotations

import pytest
import torch
from helpers.jobs import compose_cfg

from ddplab import run, verify
from ddplab.checkpoint.compare import first_difference
from ddplab.config.errors import ConfigError


# --------------------------------------------------------------------------- in-process
def test_first_difference_names_the_path_bitwise_or_to_a_tolerance():
    a = {
        "model": {"w": torch.tensor([1.0, 0.0, 3.0])},
        "loop": {"step": 4},
        "rng": [torch.tensor([1], dtype=torch.uint8)],
    }
    b = {
        "model": {"w": torch.tensor([1.0, 1e-9, 3.0])},
        "loop": {"step": 4},
        "rng": [torch.tensor([1], dtype=torch.uint8)],
    }
    assert first_difference(a, a) is None
    assert first_difference(a, b, "ckpt") == "ckpt.model.w"
    assert first_difference(a, b, "ckpt", rtol=1e-6) is None  # a zero entry: tolerance scales with the tensor
    assert first_difference({"loop": {"step": 4}}, {"loop": {"step": 5}}, "c") == "c.loop.step: 4 vs 5"
    assert first_difference({"x": 1}, {"y": 1}) == " keys ['x', 'y']"
    assert first_difference(torch.zeros(2), torch.zeros(3), "t") == "t shape (2,) vs (3,)"


def test_the_default_stop_is_mid_epoch_and_the_cause_follows_what_differs_first():
    assert verify._mid_epoch(12, 2) == 3  # 6 an epoch: halfway into the first, then across its end
    assert verify._mid_epoch(30, 3) == 15 and verify._mid_epoch(2, 1) == 1 and verify._mid_epoch(1, 1) == 0
    assert verify._cause("model.w", 2, stopped_at=3) == verify.NOT_REPRODUCIBLE  # before any resume
    assert verify._cause("model.w", 5, stopped_at=3) == verify.RESTARTS_FROM_SEED
    assert verify._cause(".loop.sampler.skip_micro_batches: 3 vs 0", None, 3).startswith("the data position")
    assert verify._cause("rng.ranks[0].torch", None, 3).startswith("a random stream was not restored")
    assert verify._trajectory({"train/loss": 1.0, "vitals/samples_per_s": 9.0}) == {"train/loss": 1.0}


def test_under_torchrun_and_through_ddplab_run_it_says_how_to_start_it(tmp_path, monkeypatch):
    cfg = compose_cfg(["mode=verify_resume"], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"is run by train.py .* Fix: python train.py mode=verify_resume"):
        run(cfg)
    (
        monkeypatch.setenv("RANK", "0"),
        monkeypatch.setenv("WORLD_SIZE", "2"),
        monkeypatch.setenv("LOCAL_RANK", "0"),
    )
    with pytest.raises(ConfigError, match=r"starts fresh processes of its own.*not under torchrun or srun"):
        verify.verify_resume(cfg)
