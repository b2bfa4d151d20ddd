"""model.lora's refusals (issue 47, item 3), in-process: a rank below 0, a dropout of 1, LoRA without
model.pretrained (nothing frozen to adapt) or beside model.weights, and peft not installed are each one line;
a target peft cannot place names the key and the fix; --to peft of a run without LoRA says to use --to hf."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.extras import needs
from helpers.hf import LM, token_file
from helpers.jobs import compose_cfg

import ddplab
from ddplab import build
from ddplab.config.errors import ConfigError

needs("transformers", "hf")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny GPT-2 saved as a local pretrained copy, once for the module."""
    where = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    build.model(compose_cfg(LM + token_file(where))).hf.save_pretrained(where / "pretrained")
    return LM + token_file(where) + [f"model.pretrained={where / 'pretrained'}"]


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "model.lora.rank=-1",
            r"^model.lora.rank=-1: must be >= 0 \(0: no LoRA\). Fix: pass model.lora.rank=8$",
        ),
        ("model.lora.dropout=1", r"^model.lora.dropout=1.0: must be in \[0, 1\)"),
        ("model.weights=/x.pt", r"^model.weights='/x.pt': LoRA's base weights are model.pretrained's"),
    ],
)
def test_lora_config_errors_are_one_line(tmp_path, pretrained, override, said):
    with pytest.raises(ConfigError, match=said):
        ddplab.run(compose_cfg(pretrained + ["model.lora.rank=4", override], tmp_path / "run"))


def test_lora_without_a_pretrained_model_is_one_line(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^model.lora.rank=4: LoRA adapts a pretrained model's frozen weights, and model.pretrained is "
        r"null. Fix: pass model.pretrained=<a local save_pretrained folder>, or model.lora.rank=0$",
    ):
        ddplab.run(compose_cfg(LM + token_file(tmp_path) + ["model.lora.rank=4"], tmp_path / "run"))


def test_without_the_extra_lora_is_one_line(tmp_path, pretrained, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(
        ConfigError,
        match=r"^model.lora needs peft, which is not installed. Fix: pip install 'ddplab\[peft\]', or "
        r"model.lora.rank=0$",
    ):
        build.model(compose_cfg(pretrained + ["model.lora.rank=4"]))


def test_a_target_peft_cannot_place_names_the_key(pretrained):
    needs("peft", "peft")
    with pytest.raises(
        ValueError, match=r"^model.lora.target_modules=\['q_proj'\]: peft cannot place adapters"
    ):
        build.model(compose_cfg(pretrained + ["model.lora.rank=4", "model.lora.target_modules=[q_proj]"]))


def test_only_adapters_train_and_the_state_dict_holds_them_alone(pretrained):
    needs("peft", "peft")
    model = build.model(compose_cfg(pretrained + ["model.lora.rank=4"]))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    assert sorted(model.state_dict()) == sorted(trained)
    with pytest.raises(RuntimeError, match=r"^LoRA state_dict does not fit the model: missing \["):
        model.load_state_dict({})
