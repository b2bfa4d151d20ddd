"""task=lm: next-token prediction; loss is the mean negative log-likelihood per token,
and perplexity (exp of it over the whole interval or validation set) is derived from it."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ddplab.task import Task, TaskOutput


class LanguageModelTask(Task):
    """(tokens, next tokens) of shape (B, T) → cross-entropy over every position."""

    derived_names = ("perplexity",)
    counts_tokens = True  # the progress line and vitals/tokens_per_s: samples/s x T

    def __call__(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> TaskOutput:
        x, y = batch
        logits = model(x)
        # Every sample has T tokens, so the sample-weighted mean of this is the token mean.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        return TaskOutput(loss, x.shape[0], {})

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return {"perplexity": math.exp(min(means["loss"], 700.0))} if "loss" in means else {}
