"""Model zoo: torchvision-format weights from a local file, the ViT, user factories."""

from __future__ import annotations

import pytest
from helpers.jobs import compose_cfg

import ddplab
from ddplab.models import load_weights, resnet18


def test_any_installed_factory_via_target(tmp_path):
    """A user's own factory (here tests/toy.py; torchvision's or timm's work the same way)."""
    out = ddplab.run(
        compose_cfg(
            [
                "model=mlp",
                "model._target_=toy.UnusedParamMLP",
                "num_epochs=1",
                "progress=none",
                "distributed.find_unused_parameters=true",
            ],
            run_dir=tmp_path,
        )
    )
    assert out["val/num_samples"] == 359


def test_weights_file_that_is_no_state_dict_is_a_clear_error(tmp_path):

    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(
        ValueError,
        match=r"model.weights=.*notes.txt: not a readable torch state_dict file .*"
        r"Fix: the path of a saved state_dict",
    ):
        load_weights(resnet18(num_classes=10), text)
