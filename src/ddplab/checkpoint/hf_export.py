"""``--to hf``: a folder transformers uses as is. The model as a transformers one (model=hf's own; model=gpt's
TinyGPT mapped onto GPT-2's layout), the run's tokenizer beside it, and special-token ids that are the
vocabulary's: ``from_pretrained`` and ``pipeline("text-generation", model=<folder>)`` need no other file."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from torch import nn

from ddplab.errors import InputError

# The tokens a tokenizer may name its ends with, as the families transformers ships name them.
_ENDS = {
    "eos": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"),
    "bos": ("<|endoftext|>", "<s>", "<bos>", "<|begin_of_text|>", "[CLS]"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
}


def maps(model: nn.Module) -> bool:
    """Whether ``model`` has a transformers counterpart (what ``--to auto`` exports as hf)."""
    from ddplab.models.gpt import TinyGPT

    return hasattr(model, "hf") or isinstance(model, TinyGPT) and model.head[1].bias is None


def transformers_model(model: nn.Module) -> Any:
    """The transformers model ``model`` is or maps onto; one line where there is none."""
    if hasattr(model, "hf"):  # LoRA (a peft model): its adapters merged into the weights, a plain model
        return model.hf.merge_and_unload() if hasattr(model.hf, "merge_and_unload") else model.hf
    from ddplab.models.gpt import TinyGPT

    if isinstance(model, TinyGPT):
        return gpt2_of(model)
    raise InputError(
        f"export --to hf: the run's model is {type(model).__module__}.{type(model).__name__}, which has no "
        "transformers counterpart (model=hf and model=gpt do). Fix: --to safetensors"
    )


def gpt2_of(model: nn.Module) -> Any:
    """TinyGPT as transformers' GPT2LMHeadModel, weight for weight: its blocks are GPT-2's (pre-norm, fused
    qkv, exact GELU: activation_function=gelu), its head untied. GPT-2's lm_head has no bias: a TinyGPT
    trained with one (model.head_bias=true, ddplab's checkpoints before the key) cannot map."""
    from ddplab.models.hf import transformers_module

    tf = transformers_module()
    head = model.head[1]
    if head.bias is not None:
        raise InputError(
            "export --to hf: this TinyGPT's head has a bias, which GPT-2's lm_head has not (a run of "
            "model.head_bias=true). Fix: --to safetensors, or train with model.head_bias=false"
        )
    first = model.blocks[0]
    config = tf.GPT2Config(
        vocab_size=model.tok.num_embeddings,
        n_positions=model.block_size,
        n_embd=model.tok.embedding_dim,
        n_layer=len(model.blocks),
        n_head=first.heads,
        activation_function="gelu",
        resid_pdrop=first.dropout,
        embd_pdrop=0.0,
        attn_pdrop=first.dropout,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    gpt2 = tf.GPT2LMHeadModel(config)
    state = {
        "transformer.wte.weight": model.tok.weight,
        "transformer.wpe.weight": model.pos.weight,
        "transformer.ln_f.weight": model.head[0].weight,
        "transformer.ln_f.bias": model.head[0].bias,
        "lm_head.weight": head.weight,
    }
    for i, b in enumerate(model.blocks):
        # GPT-2's Conv1D keeps (in, out): the transpose of nn.Linear's weight
        for n, norm in {"ln_1": b.ln1, "ln_2": b.ln2}.items():
            state |= {f"transformer.h.{i}.{n}.weight": norm.weight, f"transformer.h.{i}.{n}.bias": norm.bias}
        convs = {"attn.c_attn": b.qkv, "attn.c_proj": b.proj, "mlp.c_fc": b.mlp[0], "mlp.c_proj": b.mlp[2]}
        for n, lin in convs.items():
            state[f"transformer.h.{i}.{n}.weight"] = lin.weight.t()
            state[f"transformer.h.{i}.{n}.bias"] = lin.bias
    missing, unexpected = gpt2.load_state_dict(
        {k: v.detach().contiguous().clone() for k, v in state.items()}, strict=False
    )
    # GPT-2 keeps a causal-mask buffer in some versions: nothing else may be left out
    left = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if left or unexpected:
        raise InputError(f"export --to hf: TinyGPT does not map onto GPT-2 here ({left or unexpected}).")
    return gpt2.eval()


def save_adapters(model: nn.Module, tok: Any | None, out: Path, context: int) -> list[str]:
    """``--to peft``: a LoRA run's adapters as the folder ``PeftModel.from_pretrained(base, folder)`` loads
    (adapter_config.json, adapter_model.safetensors), the run's tokenizer beside them; the files written."""
    peft_model = getattr(model, "hf", None)
    if not hasattr(peft_model, "merge_and_unload"):
        raise InputError(
            "export --to peft: the run's model has no LoRA adapters (model.lora.rank=0). Fix: --to hf"
        )
    with _quiet():
        peft_model.save_pretrained(str(out))
        if tok is not None:
            _fast(tok, special_ids(tok), context).save_pretrained(str(out))
    return sorted(p.name for p in out.iterdir())


def special_ids(tok: Any) -> dict[str, int | None]:
    """bos/eos/pad/unk ids of the tokenizer's special tokens, where it has them; None where not (never an id
    outside the vocabulary, as GPT-2's 50256 would be)."""
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    out: dict[str, int | None] = {}
    for role, names in _ENDS.items():
        name = next((n for n in names if n in special), None)
        out[role] = None if name is None else tok.token_to_id(name)
    return out


def save(hf: Any, tok: Any | None, out: Path, context: int) -> list[str]:
    """``hf`` and ``tok`` saved into ``out`` for ``from_pretrained``; the files written. Special-token ids
    come from the tokenizer (none without one), in config.json and generation_config.json alike."""
    ids = special_ids(tok) if tok is not None else dict.fromkeys(_ENDS)
    vocab = hf.config.vocab_size
    for role in ("bos", "eos", "pad"):
        value = ids[role] if ids[role] is not None and ids[role] < vocab else None
        setattr(hf.config, f"{role}_token_id", value)
        if getattr(hf, "generation_config", None) is not None:
            setattr(hf.generation_config, f"{role}_token_id", value)
    with _quiet():
        hf.save_pretrained(str(out))
        if tok is not None:
            _fast(tok, ids, context).save_pretrained(str(out))
    return sorted(p.name for p in out.iterdir())


def _fast(tok: Any, ids: dict[str, int | None], context: int) -> Any:
    from ddplab.models.hf import transformers_module

    tf = transformers_module()
    named = {f"{role}_token": tok.id_to_token(i) for role, i in ids.items() if i is not None}
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=context, **named)


@contextlib.contextmanager
def _quiet():
    """What transformers and the Hub print while saving (a shard's progress bar, with transformers_module's
    switch off, and notices) is not the export's to print."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def context_of(hf: Any) -> int:
    """The longest sequence the model takes (its position embeddings)."""
    c = hf.config
    return int(getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None) or 1 << 30)
