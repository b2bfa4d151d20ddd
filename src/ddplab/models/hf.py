"""Any Hugging Face ``transformers`` model as a ddplab model (``model=hf``; the ``hf`` extra): built from a
local config (``AutoConfig.for_model`` + ``from_config``) or a local pretrained directory (``from_pretrained``
with ``local_files_only``: config.json + safetensors) — nothing is downloaded. It maps token ids to logits, as
ddplab's tasks expect: (B, T, vocab) for ``task=lm``, (B, classes) for ``task=classification``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ddplab.errors import InputError

KINDS = ("causal_lm", "sequence_classification")


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise InputError(
            "model=hf needs Hugging Face transformers, which is not installed. Fix: pip install 'ddplab[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()  # its hub and init notices are not the run's to print
    transformers.utils.logging.disable_progress_bar()  # nor its loading and saving bars (rank logs, export)
    return transformers


class HFModel(nn.Module):
    """``self.hf``: the transformers model itself (``save_pretrained``, its own blocks); ``forward``:
    logits."""

    def __init__(
        self,
        kind: str = "causal_lm",
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        num_labels: int | None = None,
        lora: dict[str, Any] | None = None,
    ):
        super().__init__()
        tf = transformers_module()
        auto = {
            "causal_lm": tf.AutoModelForCausalLM,
            "sequence_classification": tf.AutoModelForSequenceClassification,
        }
        extra = {"num_labels": num_labels} if kind == "sequence_classification" and num_labels else {}
        if pretrained:
            path = Path(pretrained).expanduser()
            if not (path / "config.json").is_file():
                raise InputError(
                    f"model.pretrained={pretrained}: no config.json there. Fix: a local directory that "
                    "save_pretrained wrote (nothing is downloaded), or model.pretrained=null"
                )
            self.hf = auto[kind].from_pretrained(str(path), local_files_only=True, **extra)
        else:
            spec = dict(config or {})
            model_type = spec.pop("model_type", None)
            try:
                self.hf = auto[kind].from_config(tf.AutoConfig.for_model(model_type, **spec, **extra))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"model.config.model_type={model_type}: transformers cannot build it "
                    f"({str(e).splitlines()[0][:160]}). Fix: a model_type transformers knows "
                    "(gpt2, llama, bert, ...) and its config's keys"
                ) from None
        self.kind = kind
        self.trained_only: Any = None  # LoRA: what a checkpoint holds (ddplab.models.lora)
        if lora and int(lora.get("rank", 0)) > 0:
            from ddplab.models.lora import TrainedOnly, with_lora

            self.hf = with_lora(self.hf, kind, lora)
            self.trained_only = TrainedOnly(self)

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """LoRA: without the frozen pretrained weights (model.pretrained holds them)."""
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        return sd if self.trained_only is None else self.trained_only.drop_frozen(sd, prefix)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if self.trained_only is None:
            return super().load_state_dict(state_dict, strict, assign)
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        if strict:
            self.trained_only.check_loaded(result.missing_keys, result.unexpected_keys)
        return result

    def forward(self, x: Tensor) -> Tensor:
        return self.hf(input_ids=x).logits

    def fsdp_units(self) -> list[nn.Module]:
        """The model's own decoder blocks (its ``_no_split_modules`` classes), one FSDP unit each."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        return [m for m in self.hf.modules() if type(m).__name__ in names]
