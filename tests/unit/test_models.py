"""A model.weights file that is no torch state_dict is one ValueError naming the key, the path and the fix
(ddplab.models.load_weights, in-process)."""

from __future__ import annotations

import pytest

from ddplab.models import load_weights, resnet18


def test_weights_file_that_is_no_state_dict_is_a_clear_error(tmp_path):

    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(
        ValueError,
        match=r"model.weights=.*notes.txt: not a readable torch state_dict file .*"
        r"Fix: the path of a saved state_dict",
    ):
        load_weights(resnet18(num_classes=10), text)
