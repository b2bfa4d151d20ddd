"""``python -m ddplab export`` (issue 34, item 5): the model out of a run — its weights (the EMA's where the
run kept one), the config that builds it, a model card — loaded back outside ddplab and scoring what the run
said. An FSDP checkpoint's export (the whole model its shards hold): tests/integration/test_hf.py's FSDP
run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.compare import same
from helpers.jobs import assert_ok, compose_cfg, run_cmd
from hydra.utils import instantiate
from omegaconf import OmegaConf

import ddplab
from ddplab.data import digits

BASE = ["model=mlp", "progress=none", "num_epochs=1", "limit_train_steps=6"]


def export(args: list[str], cwd: Path):
    return run_cmd([sys.executable, "-m", "ddplab", "export", *args], cwd)


def accuracy(model: torch.nn.Module) -> float:
    """The exported model's accuracy on the digits' validation split, counted here (not by ddplab)."""
    val = digits().val
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([int(val[i][1]) for i in range(len(val))])
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).sum().item() / len(y)


@pytest.mark.slow
def test_an_ema_run_exports_its_ema_weights_which_load_outside_ddplab_and_score_its_val_ema(tmp_path):
    from safetensors.torch import load_model

    run = tmp_path / "run"
    out = ddplab.run(compose_cfg(BASE + ["callbacks=[ema]", "callbacks.ema.decay=0.5"], run))
    proc = export([str(run)], tmp_path)
    assert_ok(proc)
    assert proc.stdout.strip() == (
        f"export: {run / 'export'}: the EMA of the weights (callbacks.ema: decay 0.5, "
        "6 updates; --weights raw for the trained weights)"
    )
    model = instantiate(OmegaConf.load(run / "export" / "config.yaml").model)  # no ddplab code past this line
    load_model(model, str(run / "export" / "model.safetensors"))
    ck = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    floats = [p.detach() for p in model.parameters() if p.is_floating_point()]
    assert same(floats, ck["callbacks.ema"]["shadow"]) is None  # bitwise the EMA the run kept
    # not the raw weights
    assert same(model.state_dict()["net.1.weight"], ck["model"]["net.1.weight"]) is not None
    assert accuracy(model) == pytest.approx(out["val_ema/acc"], abs=1e-9)  # 359 samples: counts, exactly
    card = (run / "export" / "README.md").read_text()
    assert "- weights: the EMA of the weights (callbacks.ema" in card and "| val/acc |" in card
    assert "step 6, epoch 1, world size 1" in card and "`ddplab.data.digits`" in card

    assert_ok(
        export(
            [
                str(run / "checkpoints" / "last.pt"),
                "--to",
                "state_dict",
                "--weights",
                "raw",
                "--out",
                str(tmp_path / "raw"),
            ],
            tmp_path,
        )
    )
    raw = torch.load(tmp_path / "raw" / "model.pt", weights_only=True)
    assert same(raw, ck["model"]) is None  # the trained weights, every buffer too
    model.load_state_dict(raw)
    assert accuracy(model) == pytest.approx(out["val/acc"], abs=1e-9)


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["nowhere"],
            "export nowhere: no best.pt or last.pt in nowhere/checkpoints. Fix: a run dir that saved",
        ),
        (
            ["run", "--to", "onnx"],
            "export --to onnx: not a format ddplab writes. Fix: --to one of safetensors, state_dict, "
            "hf, peft, auto",
        ),
        (
            ["run", "--to", "hf"],
            "export --to hf: the run's model is ddplab.models.mlp.MLP, which has no transformers counterpart "
            "(model=hf and model=gpt do). Fix: --to safetensors",
        ),
        (
            ["run", "--weights", "ema"],
            "export --weights ema: the run kept no EMA (callbacks=[ema]). Fix: --weights raw",
        ),
        (["run/result.json"], "export run/result.json: not a ddplab checkpoint ("),
    ],
)
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_what_cannot_be_exported_is_one_line_exit_2(tmp_path, args, said):
    if args[0].startswith("run"):
        ddplab.run(compose_cfg(BASE, tmp_path / "run"))
    proc = export(args, tmp_path)
    assert (
        proc.returncode == 2 and proc.stderr.startswith(said) and len(proc.stderr.strip().splitlines()) == 1
    ), proc.stderr[-1500:]


def test_an_unknown_command_is_one_line(tmp_path):
    proc = run_cmd([sys.executable, "-m", "ddplab", "serve"], tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        "python -m ddplab: 'serve' is not a command. Fix: python -m ddplab "
        "export|generate|sync ... (train with python train.py)\n"
    )
