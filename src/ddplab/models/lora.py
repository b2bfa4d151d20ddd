"""LoRA on a transformers model (``model.lora.rank > 0``; the ``peft`` extra): peft's low-rank adapters on
``model.pretrained``'s weights, which stay frozen. Only the adapters train, and a checkpoint holds only what
trains (the adapters, a classifier head peft keeps trainable) and its optimizer state: the frozen weights are
``model.pretrained``'s, read again from that folder wherever the run is resumed, evaluated or exported."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ddplab.errors import InputError

_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def peft_module() -> Any:
    try:
        import peft
    except ImportError:
        raise InputError(
            "model.lora needs peft, which is not installed. Fix: pip install 'ddplab[peft]', or "
            "model.lora.rank=0"
        ) from None
    return peft


def with_lora(model: nn.Module, kind: str, lora: dict[str, Any]) -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters of ``lora`` (rank, alpha, dropout, target_modules): a
    PeftModel whose trainable parameters are the adapters alone."""
    peft = peft_module()
    targets = lora.get("target_modules")
    config = peft.LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=float(lora.get("alpha", 16.0)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=list(targets) if targets else None,
        # GPT-2's layers are transformers' Conv1D, weights stored (in, out): peft must know (it warns else)
        fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()),
        task_type=getattr(peft.TaskType, _TASKS[kind]),
    )
    try:
        with warnings.catch_warnings():
            # peft 0.21 asks transformers 5 a deprecated question while wrapping: their notice, not the run's
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as e:  # no module of that name, or a model_type peft has no default targets for
        raise ValueError(
            f"model.lora.target_modules={targets}: peft cannot place adapters "
            f"({str(e).splitlines()[0][:200]}). Fix: the names of the model's linear layers (e.g. c_attn for "
            "gpt2, q_proj,v_proj for llama)"
        ) from None


class TrainedOnly:
    """What a checkpoint holds of a LoRA model: the state_dict's entries of what trains (and the buffers),
    without the frozen pretrained weights; loading checks that exactly those came."""

    def __init__(self, module: nn.Module):
        self.frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def drop_frozen(self, sd: dict[str, Any], prefix: str) -> dict[str, Any]:
        for key in [k for k in sd if k.startswith(prefix) and k[len(prefix) :] in self.frozen]:
            del sd[key]
        return sd

    def check_loaded(self, missing: list[str], unexpected: list[str]) -> None:
        """After ``load_state_dict(strict=False)``: an error naming what did not fit, as strict loading
        does."""
        missing = [k for k in missing if k not in self.frozen]
        if missing or unexpected:
            raise RuntimeError(
                "LoRA state_dict does not fit the model: "
                f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
            )
