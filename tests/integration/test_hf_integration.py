"""Issue 34's acceptance, in one test: a tiny Hugging Face causal LM trained from Parquet text through a BPE
tokenizer learnt here, at 1 and 2 ranks (the same fp32 run), a rank SIGKILLed and the job resumed bitwise,
logged to a real MLflow server and TensorBoard with the same values, then exported and reloaded with
``from_pretrained`` giving ddplab's logits. Issue 47's, in the second: LoRA on a local pretrained folder at 2
ranks with W&B (offline) and MLflow, a rank SIGKILLed and resumed bitwise, exported --to hf, and transformers'
pipeline on the folder alone writing what ``python -m ddplab generate`` writes from the run dir. Each part is
also tested on its own (test_tokenizer, test_hf, test_hf_data, test_mlflow, test_wandb, test_lora,
test_export, test_lm_out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.compare import assert_same_checkpoint
from helpers.extras import lazy, needs
from helpers.jobs import REPO, assert_ok, compose_cfg, rank_kills_itself, ranks, run_cmd, torchrun

from ddplab.events import read_scalars

needs("transformers", "hf")
datasets = lazy("datasets", "hf")


def parquet_and_bpe(tmp_path: Path) -> list[str]:
    from ddplab.data import tokenizer as tz
    from ddplab.data.tabular import generated_corpus

    said = generated_corpus(sentences=1200, seed=4).strip().split(". ")
    rows = [". ".join(said[i : i + 3]) + "." for i in range(0, len(said), 3)]
    datasets.Dataset.from_dict({"text": rows[:360]}).to_parquet(tmp_path / "train.parquet")
    datasets.Dataset.from_dict({"text": rows[360:]}).to_parquet(tmp_path / "val.parquet")
    tz.train_bpe(rows[:360], 320).save(str(tmp_path / "tokenizer.json"))
    return [
        "dataset=hf",
        f"dataset.path={tmp_path / 'train.parquet'}",
        f"dataset.val_path={tmp_path / 'val.parquet'}",
        f"dataset.tokenizer={tmp_path / 'tokenizer.json'}",
        "dataset.vocab_size=320",
        "dataset.block_size=16",
        f"dataset.cache_dir={tmp_path / 'hf-cache'}",
    ]


# A 2-layer GPT-2 of the Hugging Face library, dropout off (bitwise across world sizes), tracked by MLflow.
HF_LM = [
    *("task=lm", "model=hf", "model.config.n_embd=32", "model.config.n_layer=2", "model.config.n_head=2"),
    *("+model.config.resid_pdrop=0.0", "+model.config.embd_pdrop=0.0", "+model.config.attn_pdrop=0.0"),
    *("optimizer=adamw", "batch_size=12", "num_epochs=2", "checkpoint.every_n_steps=5"),
    "log_every_n_steps=5",
    *("progress=none", "logger=[tensorboard,mlflow]", "+callbacks.soak._target_=soak_toy.SoakCallback"),
]


@pytest.mark.dist
def test_hf_lm_from_parquet_through_a_bpe_at_1_and_2_ranks_killed_resumed_tracked_and_exported(
    tmp_path, mlflow_server
):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from ddplab.checkpoint.export import build, read

    args = [*HF_LM, f"mlflow.tracking_uri={mlflow_server}", *parquet_and_bpe(tmp_path)]
    for n in (1, 2):
        assert_ok(ranks(n, args + [f"hydra.run.dir={tmp_path / str(n)}"], tmp_path, timeout=300))
    one, two = (json.loads((tmp_path / n / "result.json").read_text())["metrics"] for n in ("1", "2"))
    assert one["step"] == two["step"] > 20 and one["val/num_samples"] == two["val/num_samples"]
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)

    killed = tmp_path / "killed"  # rank 1 SIGKILLed at its 13th step (last checkpoint: step 10), then resumed
    crashed = torchrun(
        2,
        args + [f"hydra.run.dir={killed}"],
        tmp_path,
        timeout=300,
        extra_env=rank_kills_itself(tmp_path / "fault", rank=1, k=13),
    )
    assert crashed.returncode != 0 and json.loads((tmp_path / "fault" / "fired").read_text())["step"] == 12
    assert_ok(torchrun(2, args + [f"hydra.run.dir={killed}", "resume=auto"], tmp_path, timeout=300))
    assert_same_checkpoint(tmp_path / "2" / "checkpoints" / "last.pt", killed / "checkpoints" / "last.pt")

    client = MlflowClient(mlflow_server)  # one MLflow run for the killed job and its resume, each step once
    run = client.get_run(json.loads((killed / "mlflow.json").read_text())["run_id"])
    ref = client.get_run(json.loads((tmp_path / "2" / "mlflow.json").read_text())["run_id"])
    tb = read_scalars(killed / "tb")
    for key in ("train/loss", "val/loss", "val/perplexity"):
        mine = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        theirs = sorted((m.step, m.value) for m in client.get_metric_history(ref.info.run_id, key))
        assert mine == theirs, key  # bitwise the uninterrupted run's, no step twice
        assert [(s, np.float32(v)) for s, v in mine] == [(s, np.float32(v)) for s, v in tb[key]], key

    assert_ok(run_cmd([sys.executable, "-m", "ddplab", "export", str(killed), "--to", "hf"], tmp_path))
    theirs = AutoModelForCausalLM.from_pretrained(str(killed / "export"), local_files_only=True).eval()
    ours = build(read(killed / "checkpoints" / "best.pt"), "auto")[0].eval()
    batch = torch.randint(320, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=batch).logits, ours(batch))
    text_out(killed, tmp_path, client, run.info.run_id)


def text_out(run: Path, tmp_path: Path, client, run_id: str) -> None:
    """Issue 47's item 1 on this run: the run kept its tokenizer, the export carries it with ids of its
    vocabulary (the BPE has no special tokens: none, not GPT-2's 50256), transformers' pipeline on the folder
    alone writes the greedy text ``python -m ddplab generate`` writes from the run dir, and MLflow's model/
    is that same folder."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    folder = run / "export"
    prompt = "The captain"  # and 8 new tokens: within the model's 16 positions
    assert AutoTokenizer.from_pretrained(str(folder))(prompt)["input_ids"] == (
        Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(prompt).ids
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 320 and config.get("bos_token_id") is config.get("eos_token_id") is None
    piped = run_cmd(
        [sys.executable, str(REPO / "tests/workers/pipeline_worker.py"), str(folder), prompt, "8"], tmp_path
    )
    assert_ok(piped)
    assert "warn" not in piped.stderr.lower() and "token_id" not in piped.stderr
    said = run_cmd(
        [sys.executable, "-m", "ddplab", "generate", str(run), "--prompt", prompt, "--temperature", "0"]
        + ["--max-new-tokens", "8"],
        tmp_path,
    )
    assert_ok(said)
    assert said.stdout == json.loads(piped.stdout) + "\n"
    artifact = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/config.json", "model/tokenizer.json", "model/model.safetensors"} <= artifact


@pytest.mark.dist
def test_lora_on_a_pretrained_lm_at_2_ranks_with_wandb_and_mlflow_killed_resumed_exported_and_generating(
    tmp_path, mlflow_server
):
    needs("peft", "peft")
    needs("wandb", "wandb")
    from mlflow.tracking import MlflowClient

    from ddplab import build

    data = parquet_and_bpe(tmp_path)
    torch.manual_seed(0)  # the user's local pretrained copy: a GPT-2 over the BPE's 320 ids, save_pretrained
    build.model(compose_cfg([*HF_LM, *data])).hf.save_pretrained(tmp_path / "pretrained")
    args = [
        *HF_LM,
        *data,
        f"mlflow.tracking_uri={mlflow_server}",
        "logger=[tensorboard,mlflow,wandb]",
        f"model.pretrained={tmp_path / 'pretrained'}",
        *("model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=0.01"),
    ]
    offline = {  # no W&B key here: the runs are logged offline, W&B's own folders in tmp_path
        "NETRC": str(tmp_path / "no.netrc"),
        **{
            k: str(tmp_path / "wandb-home") for k in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")
        },
    }
    ref = tmp_path / "2"
    assert_ok(torchrun(2, args + [f"hydra.run.dir={ref}"], tmp_path, timeout=300, extra_env=offline))
    killed = tmp_path / "killed"  # rank 1 SIGKILLed at its 13th step (last checkpoint: step 10), then resumed
    fault = rank_kills_itself(tmp_path / "fault", rank=1, k=13)
    crashed = torchrun(
        2, args + [f"hydra.run.dir={killed}"], tmp_path, timeout=300, extra_env=offline | fault
    )
    assert crashed.returncode != 0 and json.loads((tmp_path / "fault" / "fired").read_text())["step"] == 12
    assert_ok(
        torchrun(
            2, args + [f"hydra.run.dir={killed}", "resume=auto"], tmp_path, timeout=300, extra_env=offline
        )
    )
    assert_same_checkpoint(ref / "checkpoints" / "last.pt", killed / "checkpoints" / "last.pt")
    adapters = torch.load(killed / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert adapters and all(".lora_" in k for k in adapters)  # the checkpoint holds the adapters alone

    assert_wandb_holds_tensorboard(killed)
    client = MlflowClient(mlflow_server)
    mlflow_run = json.loads((killed / "mlflow.json").read_text())["run_id"]
    assert_ok(run_cmd([sys.executable, "-m", "ddplab", "export", str(killed), "--to", "hf"], tmp_path))
    assert not (killed / "export" / "adapter_config.json").exists()  # merged: a plain transformers folder
    text_out(killed, tmp_path, client, mlflow_run)


def assert_wandb_holds_tensorboard(run: Path) -> None:
    """One W&B run for the killed job and its resume (two offline files), each (step, key) once,
    TensorBoard's values at every step."""
    from ddplab import wandb_files as wf

    run_id = json.loads((run / "wandb.json").read_text())["run_id"]
    files = wf.run_files(run, run_id)
    assert len(files) == 2 and all(wf.run_record(f).run_id == run_id for f in files)
    rows: dict[int, dict[str, float]] = {}
    for f in files:
        for step, row in wf.history(f).items():
            assert not set(row) & set(rows.get(step, {})), step
            rows.setdefault(step, {}).update(row)
    tb = read_scalars(run / "tb")
    assert {(s, k) for s, row in rows.items() for k in row} == {
        (s, k) for k, pts in tb.items() for s, _ in pts
    }
    for key in ("train/loss", "val/loss", "val/perplexity"):
        assert [np.float32(rows[s][key]) for s, _ in tb[key]] == [np.float32(v) for _, v in tb[key]], key
