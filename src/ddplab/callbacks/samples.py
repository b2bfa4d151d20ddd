"""What a language model writes, at each evaluation: ``callbacks=[samples] callbacks.samples.prompt="The"``.

After each evaluation the model continues ``prompt`` (greedy by default; ``temperature`` > 0 samples, from a
generator of its own seeded alike at every evaluation, so the random streams training uses are untouched and
resume stays bitwise), with the run's tokenizer, as ``python -m ddplab generate`` does (the same loop). The
text goes to TensorBoard's Text tab (tag ``samples``) at the evaluation's step, and to MLflow as
``samples/<step, 8 digits>.txt``. Every rank runs the model (an FSDP model's forward is collective); rank 0
writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ddplab.errors import InputError
from ddplab.train.callback import Callback

if TYPE_CHECKING:
    from ddplab.train.state import State


class Samples(Callback):
    def __init__(
        self,
        prompt: str = "",
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
    ):
        self.prompt, self.max_new_tokens, self.temperature = prompt, max_new_tokens, temperature
        self.top_k, self.seed = top_k, seed
        self._tok: Any = None

    def setup(self, state: State) -> None:
        from ddplab.data import tokenizer as tz

        found = tz.of_run(state.cfg, state.run_dir)
        if found is None:
            raise InputError(
                "callbacks.samples: the run names no tokenizer (its ids came as ids), so the prompt cannot "
                "be encoded. Fix: dataset.tokenizer=<the tokenizer.json its ids came from>, or no samples "
                "callback"
            )
        self._tok = found[0]
        module = state.module
        self._context = int(getattr(module, "block_size", 0) or _positions(module))

    def on_eval_end(self, state: State, metrics: dict[str, float]) -> dict[str, float] | None:
        from ddplab.checkpoint.hf_export import special_ids
        from ddplab.generate import sample

        module, device = state.module, state.dist.device
        was_training = module.training
        module.eval()
        try:
            new = sample(
                lambda x: module(x.to(device)),
                self._tok.encode(self.prompt, add_special_tokens=False).ids,
                self._context,
                self.max_new_tokens,
                self.temperature,
                self.top_k,
                torch.Generator().manual_seed(self.seed),
                special_ids(self._tok)["eos"],
            )
        finally:
            module.train(was_training)
        state.writer.text("samples", self.prompt + self._tok.decode(new), step=state.loop.step)
        return None


def _positions(module: torch.nn.Module) -> int:
    config = module.hf.config
    return getattr(config, "n_positions", None) or config.max_position_embeddings
