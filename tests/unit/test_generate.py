"""``ddplab.generate``'s sampling, on a model made of a table (issue 47, item 2): greedy is the likeliest id
each time, top-k of 1 is greedy at any temperature, a seed gives the same samples, the model sees at most its
context (the prompt's last ids), the tokenizer's end of text stops it; bad arguments are one line each."""

from __future__ import annotations

import pytest
import torch

from ddplab import generate
from ddplab.generate import sample

VOCAB = 7
SEEN: list[int] = []


def table(x: torch.Tensor) -> torch.Tensor:
    """Logits that favour (last id + 1) mod VOCAB, then the ids after it: greedily it writes 1, 2, 3, ..."""
    SEEN.append(x.shape[1])
    last = x[0, -1]
    logits = -torch.arange(VOCAB, dtype=torch.float32).roll(int(last) + 1)
    return logits.expand(1, x.shape[1], VOCAB)


def test_greedy_is_the_likeliest_id_each_time_and_top_k_of_one_is_greedy():
    assert sample(table, [0], context=4, max_new_tokens=9, temperature=0) == [1, 2, 3, 4, 5, 6, 0, 1, 2]
    g = torch.Generator().manual_seed(0)
    assert sample(table, [0], 4, 9, temperature=5.0, top_k=1, generator=g) == [1, 2, 3, 4, 5, 6, 0, 1, 2]


def test_a_seed_gives_the_same_samples_and_another_seed_others():
    def draw(seed: int) -> list[int]:
        return sample(table, [0], 4, 40, temperature=3.0, generator=torch.Generator().manual_seed(seed))

    assert draw(1) == draw(1) and draw(1) != draw(2)
    assert set(draw(1)) - set(range(VOCAB)) == set() and len(set(draw(1))) > 2  # sampled, not greedy


def test_the_model_sees_at_most_its_context_and_the_end_of_text_stops_it():
    SEEN.clear()
    out = sample(table, list(range(6)) * 3, context=5, max_new_tokens=8, temperature=0)
    assert SEEN == [5] * 8 and out == [6, 0, 1, 2, 3, 4, 5, 6]
    assert sample(table, [0], 5, 20, temperature=0, stop=3) == [1, 2, 3]  # kept, then no more


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--temperature", "-1"], "generate --temperature -1.0: must be 0 (greedy) or more"),
        (["--top-k", "0"], "generate --top-k 0: must be at least 1"),
        (["--max-new-tokens", "0"], "generate --max-new-tokens 0: must be at least 1"),
        (["--num-samples", "0"], "generate --num-samples 0: must be at least 1"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(args, said, capsys, tmp_path):
    assert generate.main([str(tmp_path), *args]) == 2
    assert capsys.readouterr().err == said + "\n"


def test_a_folder_that_is_neither_a_run_nor_an_export_is_one_line(capsys, tmp_path):
    assert generate.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"generate {tmp_path}: neither a run dir (no checkpoints/) nor a folder export --to hf wrote (no "
        "config.json). Fix: a task=lm run dir, its checkpoint, or its export folder\n"
    )
