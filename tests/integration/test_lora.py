"""model.lora (issue 47, item 3): LoRA through peft on a local pretrained transformers folder. Only the
adapters train (the pretrained weights stay bitwise as they were), a checkpoint holds the adapters and their
optimizer state alone (its size against a whole model's), a run killed mid-epoch resumes bitwise, mode=eval
reproduces the run's last evaluation, 1, 2 and 3 DDP ranks and 2 FSDP ranks train the same adapters, and both
exports give ddplab's logits: ``--to hf`` (merged: a plain transformers folder) and ``--to peft`` (an adapter
folder ``PeftModel.from_pretrained`` loads)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.compare import assert_same_checkpoint, load_whole
from helpers.extras import needs
from helpers.hf import LM, token_file
from helpers.jobs import assert_ok, compose_cfg, ranks, run_cmd, run_killed_after_step

import ddplab
from ddplab import build

needs("transformers", "hf")
needs("peft", "peft")

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optimizer=adamw", "optimizer.lr=0.01"]


def pretrained(tmp_path: Path) -> list[str]:
    """A tiny GPT-2, built and saved as a user's local pretrained copy is (save_pretrained: safetensors)."""
    folder = tmp_path / "pretrained"
    if not folder.is_dir():
        torch.manual_seed(0)
        build.model(compose_cfg(LM + token_file(tmp_path))).hf.save_pretrained(folder)
    return [f"model.pretrained={folder}"]


def args_of(tmp_path: Path, *more: str) -> list[str]:
    return LM + token_file(tmp_path) + pretrained(tmp_path) + LORA + list(more)


def metrics(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())["metrics"]


@pytest.mark.slow
def test_only_the_adapters_train_and_a_checkpoint_holds_them_alone(tmp_path):
    args = args_of(tmp_path, "num_epochs=1", "limit_train_steps=6")
    ddplab.run(compose_cfg(args, tmp_path / "run"))
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert ck["model"] and all(".lora_A." in k or ".lora_B." in k for k in ck["model"]), list(ck["model"])
    # 2 blocks x c_attn (GPT-2's default target): A and B each
    assert len(ck["model"]) == 4
    assert len(ck["optimizer"]["state"]) == 4  # AdamW's moments for the adapters only
    model = build.model(compose_cfg(args))  # the pretrained weights, then this run's adapters
    model.load_state_dict(ck["model"])
    base = build.model(compose_cfg(LM + token_file(tmp_path) + pretrained(tmp_path)))
    merged = dict(model.hf.get_base_model().named_parameters())
    frozen = {k: v for k, v in merged.items() if "lora_" not in k and "base_layer" not in k}
    assert frozen and all(torch.equal(v, dict(base.hf.named_parameters())[k]) for k, v in frozen.items())
    assert any(
        ck["model"][k].abs().sum() > 0 for k in ck["model"] if "lora_B" in k
    )  # B starts at 0: it moved
    # the size: adapters + their state against a whole fine-tune's checkpoint of the same model
    ddplab.run(
        compose_cfg(LM + token_file(tmp_path) + pretrained(tmp_path) + LORA[2:] + args[-2:], tmp_path / "w")
    )
    lora_bytes = (tmp_path / "run" / "checkpoints" / "last.pt").stat().st_size
    whole_bytes = (tmp_path / "w" / "checkpoints" / "last.pt").stat().st_size
    print(f"checkpoint: LoRA {lora_bytes} bytes, whole model {whole_bytes} bytes")
    assert lora_bytes < whole_bytes / 4


@pytest.mark.slow
def test_a_lora_run_killed_mid_epoch_resumes_bitwise_and_mode_eval_reproduces_it(tmp_path):
    args = args_of(tmp_path, "num_epochs=2", "limit_train_steps=8", "checkpoint.every_n_steps=3")
    ref = ddplab.run(compose_cfg(args, tmp_path / "ref"))
    run_killed_after_step(compose_cfg(args, tmp_path / "run"), 11)  # last checkpoint: step 9, mid-epoch 2
    rest = ddplab.run(compose_cfg(args + ["resume=auto"], tmp_path / "run"))
    assert_same_checkpoint(
        tmp_path / "ref" / "checkpoints" / "last.pt", tmp_path / "run" / "checkpoints" / "last.pt"
    )
    assert rest["val/loss"] == ref["val/loss"] and rest["step"] == ref["step"] == 16
    last = tmp_path / "ref" / "checkpoints" / "last.pt"
    again = ddplab.run(compose_cfg(args + ["mode=eval", f"resume={last}"], tmp_path / "eval"))
    assert again["val/loss"] == ref["val/loss"]


@pytest.mark.dist
def test_world_sizes_1_2_and_3_and_fsdp_train_the_same_adapters(tmp_path):
    args = args_of(tmp_path, "num_epochs=1", "limit_train_steps=8")
    ddplab.run(compose_cfg(args, tmp_path / "1"))
    for n in (2, 3):
        assert_ok(ranks(n, args + [f"hydra.run.dir={tmp_path / str(n)}"], tmp_path, timeout=240))
    assert_ok(
        ranks(2, args + ["distributed=fsdp", f"hydra.run.dir={tmp_path / 'fsdp'}"], tmp_path, timeout=240)
    )
    one = torch.load(tmp_path / "1" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for n, got in (
        (2, torch.load(tmp_path / "2" / "checkpoints" / "last.pt", weights_only=True)["model"]),
        (3, torch.load(tmp_path / "3" / "checkpoints" / "last.pt", weights_only=True)["model"]),
        ("fsdp", load_whole(tmp_path / "fsdp" / "checkpoints" / "last.pt")["model"]),
    ):
        assert metrics(tmp_path / str(n))["val/num_samples"] == metrics(tmp_path / "1")["val/num_samples"]
        assert metrics(tmp_path / str(n))["val/loss"] == pytest.approx(
            metrics(tmp_path / "1")["val/loss"], rel=1e-5
        )
        assert got.keys() == one.keys(), n
        for k in one:  # the same run to float32 reduction order (AdamW amplifies it): test_hf.py's bound
            torch.testing.assert_close(got[k], one[k], rtol=1e-4, atol=1e-5, msg=f"{n}: {k}")


@pytest.mark.slow
def test_both_exports_give_ddplabs_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ddplab.checkpoint.export import build as rebuild
    from ddplab.checkpoint.export import read

    args = args_of(tmp_path, "num_epochs=1", "limit_train_steps=6")
    ddplab.run(compose_cfg(args, tmp_path / "run"))
    ours = rebuild(read(tmp_path / "run" / "checkpoints" / "best.pt"), "auto")[0].eval()
    batch = torch.randint(256, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(batch)
    for fmt in ("hf", "peft"):
        out = tmp_path / f"export-{fmt}"
        proc = run_cmd(
            [sys.executable, "-m", "ddplab", "export", str(tmp_path / "run"), "--to", fmt, "--out", str(out)],
            tmp_path,
        )
        assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
        if fmt == "hf":  # merged: a plain transformers model, no peft needed to load it
            assert not (out / "adapter_config.json").exists() and (out / "config.json").is_file()
            theirs = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
        else:
            assert sorted(p.name for p in out.iterdir() if p.name.startswith("adapter_")) == [
                "adapter_config.json",
                "adapter_model.safetensors",
            ]
            base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pretrained"), local_files_only=True)
            theirs = PeftModel.from_pretrained(base, str(out))
        with torch.no_grad():
            got = theirs.eval()(input_ids=batch).logits
        if fmt == "hf":  # merged: W + BA rounds once where base + adapter rounds Wx and B(Ax) apart
            print(f"merged export: logits differ by {(got - want).abs().max().item():.3g} at most")
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        else:
            assert torch.equal(got, want)  # the same modules, the same weights: bitwise


@pytest.mark.slow
def test_to_peft_without_lora_is_one_line(tmp_path):
    ddplab.run(
        compose_cfg(LM + token_file(tmp_path) + ["num_epochs=1", "limit_train_steps=2"], tmp_path / "run")
    )
    proc = run_cmd(
        [sys.executable, "-m", "ddplab", "export", str(tmp_path / "run"), "--to", "peft"], tmp_path
    )
    assert proc.returncode == 2 and proc.stderr == (
        "export --to peft: the run's model has no LoRA adapters (model.lora.rank=0). Fix: --to hf\n"
    ), proc.stderr


@pytest.mark.dist
def test_three_ranks_one_sigkilled_mid_epoch_resume_into_the_uninterrupted_runs_adapters_bitwise(tmp_path):
    """3 DDP ranks under torchrun (a sum of three gradients has an order, two commute): rank 1 SIGKILLed at
    its 11th step (last checkpoint: step 9, mid-epoch 2), resume=auto ends at the uninterrupted 3-rank run's
    adapters and optimizer state, bitwise."""
    from helpers.jobs import rank_kills_itself, torchrun

    args = args_of(tmp_path, "num_epochs=2", "limit_train_steps=8", "checkpoint.every_n_steps=3")
    args += ["+callbacks.soak._target_=soak_toy.SoakCallback"]
    assert_ok(torchrun(3, args + [f"hydra.run.dir={tmp_path / 'ref'}"], tmp_path, timeout=300))
    killed = tmp_path / "killed"
    fault = rank_kills_itself(tmp_path / "fault", rank=1, k=11)
    crashed = torchrun(3, args + [f"hydra.run.dir={killed}"], tmp_path, timeout=300, extra_env=fault)
    assert crashed.returncode != 0 and json.loads((tmp_path / "fault" / "fired").read_text())["step"] == 10
    assert_ok(torchrun(3, args + [f"hydra.run.dir={killed}", "resume=auto"], tmp_path, timeout=300))
    assert_same_checkpoint(tmp_path / "ref" / "checkpoints" / "last.pt", killed / "checkpoints" / "last.pt")
