"""Schemas of the model group (conf/model): one dataclass an option's yaml picks, its defaults here, once
(ddplab.config.groups lists them by option)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ddplab.config.errors import require


def _check_dropout(c: Any, key: str) -> None:
    for name in ("dropout", "attention_dropout"):
        if name in c:
            require(
                0.0 <= c[name] < 1.0,
                f"{key}.{name}",
                c[name],
                "a dropout probability must be in [0, 1)",
                f"pass {key}.{name}=0.1 (0 turns it off)",
            )


@dataclass
class ModelConfig:
    """Keys every model option has; `weights` is ddplab's (see build.model), the rest go to the factory."""

    _target_: str = MISSING
    # null: the dataset's own count (dataset=imagefolder: its class folders)
    num_classes: Optional[int] = MISSING
    in_channels: int = 1  # image channels (the dataset's, by interpolation)
    weights: Optional[str] = None  # local state_dict file (torchvision format), loaded before the wrap


@dataclass
class ResNetConfig(ModelConfig):
    _target_: str = "ddplab.models.resnet18"
    in_channels: int = 3
    # 3x3 stride-1 stem and no max-pool: keeps 8x8..32x32 images from being
    # pooled away to 1x1 before layer2. Only conv1's kernel shape changes, so
    # state_dict keys stay torchvision's.
    small_input: bool = False
    # Each residual block's last BatchNorm starts at zero: every block starts as the identity (helps large
    # batches).
    zero_init_residual: bool = False


@dataclass
class VAEConfig:
    """A small fully connected VAE over flattened images (task=vae)."""

    _target_: str = "ddplab.models.VAE"
    in_channels: int = 1  # image channels
    image_size: int = 8  # input width and height (flattened)
    hidden: int = 128  # width of the encoder's and decoder's hidden layer
    latent: int = 8  # size of the latent code
    weights: Optional[str] = None  # local state_dict file, loaded before the wrap


@dataclass
class LoraConfig:
    """model.lora (the peft extra): low-rank adapters trained on model.pretrained's frozen weights."""

    rank: int = 0  # the adapters' rank r; 0: no LoRA, the whole model trains
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input (drawn per rank: world sizes then differ by it alone)
    # the layers adapted, by name or name suffix (c_attn, q_proj, ...); null: peft's default for the model
    target_modules: Optional[list[str]] = None


@dataclass
class HFModelConfig:
    """Any Hugging Face transformers model (the hf extra), from a local config or a local pretrained dir."""

    _target_: str = "ddplab.models.hf.HFModel"
    kind: str = "causal_lm"  # causal_lm (task=lm) | sequence_classification (task=classification)
    config: Any = field(default_factory=dict)  # AutoConfig.for_model(model_type, **rest): conf/model/hf.yaml
    pretrained: Optional[str] = None  # a local directory save_pretrained wrote; config is then ignored
    num_labels: Optional[int] = None  # sequence_classification: the classes
    weights: Optional[str] = None  # local state_dict file, loaded before the wrap
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA fine-tuning of model.pretrained (peft)

    @staticmethod
    def check(c: Any, key: str) -> None:
        _check_lora(c, key)
        require(
            c.kind in ("causal_lm", "sequence_classification"),
            f"{key}.kind",
            c.kind,
            "not a kind of model ddplab trains",
            f"pass {key}.kind=causal_lm or sequence_classification",
        )
        require(
            c.pretrained is not None or bool(c.config),
            f"{key}.config",
            "{}",
            "no model to build",
            f"pass {key}.config.model_type=gpt2 (and its keys), or {key}.pretrained=<a local directory>",
        )


def _check_lora(c: Any, key: str) -> None:
    lora = c.lora
    require(
        lora.rank >= 0, f"{key}.lora.rank", lora.rank, "must be >= 0 (0: no LoRA)", f"pass {key}.lora.rank=8"
    )
    require(
        0 <= lora.dropout < 1,
        f"{key}.lora.dropout",
        lora.dropout,
        "must be in [0, 1)",
        f"pass {key}.lora.dropout=0",
    )
    require(
        lora.rank == 0 or c.pretrained is not None,
        f"{key}.lora.rank",
        lora.rank,
        f"LoRA adapts a pretrained model's frozen weights, and {key}.pretrained is null",
        f"pass {key}.pretrained=<a local save_pretrained folder>, or {key}.lora.rank=0",
    )
    require(
        lora.rank == 0 or c.weights is None,
        f"{key}.weights",
        c.weights,
        "LoRA's base weights are model.pretrained's",
        f"pass {key}.weights=null",
    )


@dataclass
class GPTConfig:
    """A small causal transformer over bytes (task=lm), nanoGPT-style."""

    _target_: str = "ddplab.models.TinyGPT"
    vocab_size: int = 256  # token ids (the dataset's, by interpolation)
    block_size: int = 64  # the longest context, in tokens
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads (divide n_embd)
    n_embd: int = 64  # embedding width
    dropout: float = 0.0  # on attention, residual and embedding outputs
    # false: GPT-2's layout (export --to hf maps it onto transformers); true: a bias on the output layer, as
    # in checkpoints from before this key (conf/model/gpt.yaml sets false)
    head_bias: bool = True
    weights: Optional[str] = None  # local state_dict file, loaded before the wrap

    @staticmethod
    def check(c: Any, key: str) -> None:
        require(
            c.n_embd % c.n_head == 0,
            f"{key}.n_embd",
            c.n_embd,
            f"must be a multiple of {key}.n_head={c.n_head}",
            f"pass {key}.n_embd={c.n_head * max(1, c.n_embd // c.n_head)}",
        )
        _check_dropout(c, key)


@dataclass
class ConvNetConfig(ModelConfig):
    """The BatchNorm + dropout convnet of the Keras multi-GPU guide, in torch."""

    _target_: str = "ddplab.models.ConvNet"
    channels: list[int] = field(default_factory=lambda: [12, 24, 32])  # output channels of each conv block
    hidden: int = 256  # width of the dense layer
    dropout: float = 0.5  # before the dense and the last layer
    check = staticmethod(_check_dropout)


@dataclass
class MLPConfig(ModelConfig):
    """A plain MLP over flattened images (the fastest model on CPU)."""

    _target_: str = "ddplab.models.MLP"
    hidden: list[int] = field(default_factory=lambda: [256, 256])  # widths of the hidden layers
    dropout: float = 0.1  # after each hidden layer
    image_size: int = 8  # with in_channels: the input width, in_channels * image_size**2

    check = staticmethod(_check_dropout)


@dataclass
class KerasConvNetConfig(ModelConfig):
    """The Keras multi-GPU guide's convnet in Keras 3 (torch backend); needs `pip install keras`."""

    _target_: str = "ddplab.models.keras_convnet.keras_convnet"
    image_size: int = 8  # input width and height
    dropout: float = 0.5  # the Keras guide's dropout
    check = staticmethod(_check_dropout)


@dataclass
class ViTConfig(ModelConfig):
    """torchvision's VisionTransformer layout; small by default (CPU-sized)."""

    _target_: str = "ddplab.models.VisionTransformer"
    in_channels: int = 3
    image_size: int = 32  # input width and height
    patch_size: int = 4  # must divide image_size
    num_layers: int = 4  # encoder blocks
    num_heads: int = 4  # attention heads (divide hidden_dim)
    hidden_dim: int = 128  # token width
    mlp_dim: int = 256  # width of each block's MLP
    dropout: float = 0.0  # on the MLP and embedding outputs
    attention_dropout: float = 0.0  # on the attention weights
    check = staticmethod(_check_dropout)
