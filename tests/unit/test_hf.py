"""model=hf (issue 34, item 1): a Hugging Face transformers model built locally — from a config or a
save_pretrained directory, nothing downloaded — trained as a causal LM and as a sequence classifier with
ddplab's guarantees: exact over world sizes, bitwise resume, FSDP over the model's own decoder blocks."""

from __future__ import annotations

import pytest
from helpers.extras import needs
from helpers.hf import LM, token_file
from helpers.jobs import compose_cfg

import ddplab
from ddplab.config.errors import ConfigError

needs("transformers", "hf")


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "model.config.model_type=not_a_model",
            r"model.config.model_type=not_a_model: transformers cannot build it",
        ),
        (
            "model.pretrained=/nowhere",
            r"model.pretrained=/nowhere: no config.json there. Fix: a local directory",
        ),
        (
            "model.kind=seq2seq",
            r"model.kind='seq2seq': not a kind of model ddplab trains. Fix: pass model.kind=causal_lm",
        ),
    ],
)
def test_what_cannot_be_built_is_one_config_error(tmp_path, override, said):
    with pytest.raises(ConfigError, match=said):
        ddplab.run(compose_cfg(LM + token_file(tmp_path) + [override], tmp_path / "run"))
