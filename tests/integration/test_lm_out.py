"""From a trained language model to text (issue 47, items 1 and 2): ``export --to hf`` of model=gpt (TinyGPT
as transformers' GPT-2, weight for weight) with the run's byte-level tokenizer, which ``from_pretrained`` and
``pipeline("text-generation")`` use as is, with no warning; ``python -m ddplab generate``, whose greedy text
from the run dir is the pipeline's from the folder; a prompt longer than the context; a TinyGPT whose head
has a bias says in one line why it has no transformers export. model=hf with a BPE: test_hf_integration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.compare import tb_texts
from helpers.extras import needs
from helpers.jobs import REPO, assert_ok, compose_cfg, run_cmd

import ddplab
from ddplab.checkpoint.export import build, read

needs("transformers", "hf")

# bytes as tokens, a context of 32: a prompt of 42 bytes is longer than it; transformers' pipeline takes at
# most 32 positions (PROMPT and NEW within them)
BYTES_LM = [
    *("task=lm", "model=gpt", "dataset=text", "dataset.block_size=32", "model.n_embd=32", "model.n_head=2"),
    *("num_epochs=1", "limit_train_steps=30", "progress=none"),
]
PROMPT, NEW = "The captain", 20


def ddplab_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddplab", *args]


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("gpt") / "run"
    ddplab.run(compose_cfg(BYTES_LM, run))
    return run


@pytest.mark.slow
def test_a_tinygpt_exports_as_gpt2_which_pipeline_uses_as_is_writing_what_generate_writes(byte_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = run_cmd(ddplab_cmd("export", str(byte_run), "--to", "hf"), tmp_path)
    assert_ok(proc)
    assert "with a byte-level tokenizer" in proc.stdout and proc.stderr == ""  # quiet: no progress bar
    folder = byte_run / "export"
    assert {p.name for p in folder.iterdir()} == {
        *("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"),
        *("tokenizer_config.json", "config.yaml", "README.md"),
    }
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 256 and config["n_positions"] == 32
    # bytes have no special tokens: no id at all, never GPT-2's 50256 outside a vocabulary of 256
    assert [config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None] * 3
    assert [generation.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None] * 3
    card = (folder / "README.md").read_text()
    assert "from_pretrained(folder)" in card and "`checkpoints/best.pt`" in card
    assert str(byte_run.parent) not in card and sys.executable not in card  # no path of this machine

    theirs = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    ours = build(read(byte_run / "checkpoints" / "best.pt"), "auto")[0].eval()
    batch = torch.randint(256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=batch).logits, ours(batch))  # weight for weight: bitwise
    assert AutoTokenizer.from_pretrained(str(folder))(PROMPT)["input_ids"] == list(PROMPT.encode())

    piped = run_cmd(
        [sys.executable, str(REPO / "tests/workers/pipeline_worker.py"), str(folder), PROMPT, str(NEW)],
        tmp_path,
    )
    assert_ok(piped)
    assert "warn" not in piped.stderr.lower() and "token_id" not in piped.stderr  # no other file, no warning
    text = json.loads(piped.stdout)
    assert text.startswith(PROMPT) and len(text.encode()) == len(PROMPT) + NEW
    greedy = ("--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW))
    for source in (byte_run, folder):  # the run dir through ddplab, the folder through transformers
        said = run_cmd(ddplab_cmd("generate", str(source), *greedy), tmp_path)
        assert_ok(said)
        assert said.stdout == text + "\n" and said.stderr == ""


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_keeps_its_last_tokens_said_once(byte_run, tmp_path):
    long = "It was the best of times, it was the worst"  # 42 bytes, a context of 32
    cmd = ddplab_cmd("generate", str(byte_run), "--prompt", long, "--max-new-tokens", "30")
    cmd += ["--num-samples", "2", "--seed", "3"]
    said = run_cmd(cmd, tmp_path)
    assert_ok(said)
    assert said.stderr == (
        "generate: the prompt is longer than the model's context of 32 tokens: its last 32 are used\n"
    )
    samples = said.stdout.split("--- sample ")[1:]
    assert [s.split("\n", 1)[0] for s in samples] == ["1", "2"]
    assert all(
        len(s.split("\n", 1)[1].rstrip("\n").encode("utf-8", "surrogateescape")) >= len(long) for s in samples
    )
    again = run_cmd(cmd, tmp_path)
    assert again.stdout == said.stdout  # --seed: the same samples


@pytest.mark.slow
def test_a_tinygpt_whose_head_has_a_bias_says_why_it_has_no_transformers_export(tmp_path):
    run = tmp_path / "run"
    ddplab.run(
        compose_cfg([*BYTES_LM[:-2], "limit_train_steps=1", "progress=none", "model.head_bias=true"], run)
    )
    proc = run_cmd(ddplab_cmd("export", str(run), "--to", "hf"), tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "export --to hf: this TinyGPT's head has a bias, which GPT-2's lm_head has not (a run of "
        "model.head_bias=true). Fix: --to safetensors, or train with model.head_bias=false\n"
    )
    auto = run_cmd(ddplab_cmd("export", str(run), "--to", "auto"), tmp_path)
    assert_ok(auto)
    assert (run / "export" / "model.safetensors").is_file() and not (run / "export" / "config.json").exists()


@pytest.mark.slow
def test_samples_at_each_evaluation_are_generates_text_and_leave_training_bitwise(tmp_path):
    """callbacks=[samples]: after each evaluation the model's continuation of the prompt in TensorBoard's Text
    tab at its step; the last one is what generate writes from last.pt; greedy or sampled, the run (with
    dropout) trains bitwise as the run without it."""
    from helpers.compare import assert_same_checkpoint

    args = [*BYTES_LM[:-3], "num_epochs=2", "limit_train_steps=6", "progress=none", "model.dropout=0.1"]
    sampled = [
        "callbacks=[samples]",
        f"callbacks.samples.prompt={PROMPT}",
        "callbacks.samples.max_new_tokens=12",
    ]
    ddplab.run(compose_cfg(args, tmp_path / "plain"))
    ddplab.run(compose_cfg(args + sampled, tmp_path / "greedy"))
    ddplab.run(compose_cfg(args + sampled + ["callbacks.samples.temperature=1.0"], tmp_path / "sampled"))
    for run in ("greedy", "sampled"):
        assert_same_checkpoint(
            tmp_path / "plain" / "checkpoints" / "last.pt", tmp_path / run / "checkpoints" / "last.pt"
        )
    said = tb_texts(tmp_path / "greedy" / "tb", "samples")
    assert sorted(said) == [6, 12] and all(t.startswith(PROMPT) for t in said.values())
    last = tmp_path / "greedy" / "checkpoints" / "last.pt"
    greedy = ("--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12")
    proc = run_cmd(ddplab_cmd("generate", str(last), *greedy), tmp_path)
    assert_ok(proc)
    assert proc.stdout == said[12] + "\n"
