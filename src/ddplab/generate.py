"""What a language model writes: ``python -m ddplab generate <run dir | export dir> --prompt TEXT``.

From a run dir (or checkpoint), the model its checkpoint's config builds, with the weights export would take
(the EMA's where the run kept one: ``--weights``), and the run's tokenizer; from a folder ``export --to hf``
wrote, transformers' model and tokenizer from it (safetensors only: nothing in it runs code). The same
sampling either way, so greedy output (``--temperature 0``) is the same text from both. A prompt longer than
the model's context keeps its last tokens, said once; the continuation slides along that context."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from ddplab.checkpoint import export
from ddplab.errors import InputError


def sample(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    ids: list[int],
    context: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop: int | None = None,
) -> list[int]:
    """``max_new_tokens`` ids after ``ids`` (the model sees at most its last ``context``); greedy where
    ``temperature`` is 0, else sampled from softmax(logits / temperature), over the ``top_k`` likeliest only
    where given. Ends early at ``stop`` (the tokenizer's end of text), which is kept."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            # on the CPU, where the generator is (a GPU model's logits come back for one row)
            logits = logits_of(torch.tensor([out[-context:]]))[0, -1].float().cpu()
            if temperature == 0:
                nxt = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    cut = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < cut, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            out.append(nxt)
            if nxt == stop:
                break
    return out[len(ids) :]


class Writer:
    """A model, its tokenizer and its context, from a run dir or an export folder."""

    def __init__(self, source: Path, weights: str = "auto", trusted: bool = False):
        if (source / "config.json").is_file():
            self._from_export(source)
        elif not source.is_file() and not (source / "checkpoints").is_dir():
            raise InputError(
                f"generate {source}: neither a run dir (no checkpoints/) nor a folder export --to hf wrote "
                "(no config.json). Fix: a task=lm run dir, its checkpoint, or its export folder"
            )
        else:
            self._from_run(source, weights, trusted)

    def _from_run(self, source: Path, weights: str, trusted: bool) -> None:
        from ddplab.data import tokenizer as tz

        path = export.checkpoint_of(source, "auto")
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        ck = export.read(path)
        model, self.weights, cfg = export.build(ck, weights, trusted)
        if not str(cfg.task.get("_target_", "")).endswith(".LanguageModelTask"):
            raise InputError(
                f"generate {source}: the run's task is {cfg.task.get('_target_')}, not task=lm. "
                "Fix: a language model's run dir"
            )
        found = tz.of_run(cfg, run_dir)
        if found is None:
            raise InputError(
                f"generate {source}: the run names no tokenizer (its ids came as ids), so its text cannot be "
                "encoded. Fix: copy the tokenizer.json its ids came from into the run dir"
            )
        self.tok, self.tok_from = found
        self.model = model.eval()
        self.context = int(getattr(model, "block_size", 0)) or _context(model.hf)
        self.logits_of = self.model
        self.stop = _eos(self.tok)

    def _from_export(self, folder: Path) -> None:
        from ddplab.models.hf import transformers_module

        tf = transformers_module()
        if not (folder / "tokenizer.json").is_file():
            raise InputError(
                f"generate {folder}: no tokenizer.json in the folder. Fix: export the run again with "
                "this ddplab (--to hf writes the run's tokenizer)"
            )
        self.model = tf.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, use_safetensors=True
        ).eval()
        from ddplab.data.tokenizer import load

        self.tok, self.tok_from, self.weights = (
            load(folder / "tokenizer.json"),
            "the folder's tokenizer.json",
            "the folder's",
        )
        self.context = _context(self.model)
        self.logits_of = lambda x: self.model(input_ids=x).logits
        self.stop = _eos(self.tok)

    def write(self, prompt: str, **kw: Any) -> tuple[str, bool]:
        ids = self.tok.encode(prompt, add_special_tokens=False).ids
        cut = len(ids) > self.context
        new = sample(self.logits_of, ids, self.context, stop=self.stop, **kw)
        return self.tok.decode(new), cut


def _context(hf: Any) -> int:
    c = hf.config
    return int(getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None))


def _eos(tok: Any) -> int | None:
    from ddplab.checkpoint.hf_export import special_ids

    return special_ids(tok)["eos"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddplab generate", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "source", type=Path, help="a task=lm run dir (or checkpoint), or a folder export --to hf wrote"
    )
    ap.add_argument("--prompt", default="", help="the text to continue (default: none)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--temperature", type=float, default=1.0, help="0: greedy (the likeliest token each time)"
    )
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=1)
    export.add_build_flags(ap)  # a run dir's
    args = ap.parse_args(argv)
    try:
        _check(args)
        writer = Writer(args.source, args.weights, args.trust_config)
        g = torch.Generator().manual_seed(args.seed)
        for i in range(args.num_samples):
            text, cut = writer.write(
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                generator=g,
            )
            if cut and i == 0:
                print(
                    f"generate: the prompt is longer than the model's context of {writer.context} tokens: "
                    f"its last {writer.context} are used",
                    file=sys.stderr,
                )
            print(("" if args.num_samples == 1 else f"--- sample {i + 1}\n") + args.prompt + text)
    except (InputError, FileNotFoundError) as e:
        print(str(e) if str(e).startswith("generate") else f"generate: {e}", file=sys.stderr)
        return 2
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise InputError(f"generate --max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        raise InputError(f"generate --temperature {args.temperature}: must be 0 (greedy) or more")
    if args.top_k is not None and args.top_k < 1:
        raise InputError(f"generate --top-k {args.top_k}: must be at least 1")
    if args.num_samples < 1:
        raise InputError(f"generate --num-samples {args.num_samples}: must be at least 1")
