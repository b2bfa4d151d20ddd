"""An experiment preset composes without its data: experiment=cifar10_resnet18 is ResNet-18 on CIFAR-10 with
EMA and val_ema/acc as the objective (the presets run: tests/integration/test_eval_presets_provenance.py)."""

from __future__ import annotations

from helpers.jobs import compose_cfg


def test_cifar10_preset_composes_for_when_the_files_exist():
    cfg = compose_cfg(["experiment=cifar10_resnet18"])
    assert cfg.model._target_.endswith("resnet18") and cfg.dataset._target_.endswith("cifar10")
    assert cfg.objective == "val_ema/acc" and "ema" in cfg.callbacks
