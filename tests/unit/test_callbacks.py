"""Callbacks and the features built on them (EMA, early stopping, profiler), the eval entry,
experiment/debug presets and provenance."""

from __future__ import annotations

from helpers.jobs import compose_cfg

import ddplab


def test_fast_dev_run_evaluates_two_batches_of_a_larger_validation_set(tmp_path):
    """The presets' validation sets fit in 2 batches of 256; 2000 samples do not: exactly 2 batches run."""
    out = ddplab.run(
        compose_cfg(
            [
                "model=mlp",
                "dataset=synthetic",
                "dataset.num_val=2000",
                "dataset.image_size=8",
                "debug=fast_dev_run",
                "progress=none",
            ],
            tmp_path / "r",
        )
    )
    assert out["step"] == 2 and out["val/num_samples"] == 2 * 256


def test_cifar10_preset_composes_for_when_the_files_exist():
    cfg = compose_cfg(["experiment=cifar10_resnet18"])
    assert cfg.model._target_.endswith("resnet18") and cfg.dataset._target_.endswith("cifar10")
    assert cfg.objective == "val_ema/acc" and "ema" in cfg.callbacks
