"""A run dir or checkpoint from elsewhere runs nothing (issue 45): ``export`` and ``mode=eval`` build only
what ddplab ships, torch.optim's classes or what the command names from the checkpoint's stored config; any
other ``_target_`` is refused in one line before it is imported, unless the user passes the trust switch."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from helpers.jobs import compose_cfg, python_train
from omegaconf import OmegaConf

import ddplab
from ddplab.checkpoint import export
from ddplab.config import ConfigError, trust

TINY = ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=none"]


class _Touch:
    """Unpickled, it runs ``touch <path>``: what a crafted pickle shipped in a run dir does."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sent") / "run"
    ddplab.run(compose_cfg(TINY, run))
    return run / "checkpoints" / "last.pt"


def payloads(tmp: Path) -> dict[str, tuple[dict, Path, str]]:
    """name -> (the model node a sender writes into the checkpoint, the file whose state shows it ran,
    how)."""
    shipped = tmp / "sent.pkl"
    shipped.write_bytes(pickle.dumps(_Touch(tmp / "pickle-ran")))
    victim = tmp / "victim.txt"
    victim.write_text("precious\n")
    return {
        "savetxt": (
            {"_target_": "numpy.savetxt", "fname": str(tmp / "written.txt"), "X": [[1.0]]},
            tmp / "written.txt",
            "exists",
        ),
        "pickle": (
            {"_target_": "numpy.load", "file": str(shipped), "allow_pickle": True},
            tmp / "pickle-ran",
            "exists",
        ),
        "open": ({"_target_": "builtins.open", "file": str(victim), "mode": "w"}, victim, "truncated"),
        # ddplab's own function that writes a file, nested inside a shipped model's arguments
        "nested": (
            {
                "_target_": "ddplab.models.MLP",
                "num_classes": 10,
                "act": {
                    "_target_": "ddplab.data.write_tokens",
                    "tokens": [1],
                    "path": str(tmp / "tokens.bin"),
                    "dtype": "uint16",
                    "vocab_size": 2,
                },
            },
            tmp / "tokens.bin",
            "exists",
        ),
        # another spelling of torch.load, through a shipped module's own imports
        "alias": (
            {"_target_": "ddplab.models.torch.load", "f": str(shipped), "weights_only": False},
            tmp / "pickle-ran",
            "exists",
        ),
    }


def ran(marker: Path, how: str) -> bool:
    return marker.exists() if how == "exists" else marker.read_text() != "precious\n"


def crafted(trained: Path, tmp: Path, model: dict) -> Path:
    ck = torch.load(trained, map_location="cpu", weights_only=True)
    cfg = OmegaConf.create(ck["meta"]["config"])
    cfg.model = model
    ck["meta"]["config"] = OmegaConf.to_yaml(cfg)  # as ddplab stores it
    path = tmp / "sent" / "checkpoints" / "last.pt"
    path.parent.mkdir(parents=True)
    torch.save(ck, path)
    return path


@pytest.mark.parametrize("name", ["savetxt", "pickle", "open", "nested", "alias"])
def test_export_of_a_crafted_checkpoint_runs_nothing_and_says_so_in_one_line(tmp_path, trained, capsys, name):
    model, marker, how = payloads(tmp_path)[name]
    path = crafted(trained, tmp_path, model)
    assert export.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "_target_=" in err and "Fix: " in err and "--trust-config" in err, (
        err
    )
    assert model["_target_"] in err or "write_tokens" in err
    assert not ran(marker, how) and not (path.parent.parent / "export").exists()


@pytest.mark.parametrize("name", ["pickle", "open", "nested"])
def test_mode_eval_of_a_crafted_checkpoint_runs_nothing(tmp_path, trained, name):
    model, marker, how = payloads(tmp_path)[name]
    path = crafted(trained, tmp_path, model)
    with pytest.raises(
        ConfigError,
        match=r"mode=eval resume=.*stored config names model.*Fix: .*"
        r"trust_stored_config=true",
    ):
        ddplab.run(compose_cfg(["mode=eval", f"resume={path}", "progress=none"], tmp_path / "eval"))
    assert not ran(marker, how)


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_mode_eval_refusal_under_train_py_is_one_line_exit_2(tmp_path, trained):
    model, marker, how = payloads(tmp_path)["savetxt"]
    path = crafted(trained, tmp_path, model)
    proc = python_train(
        ["mode=eval", f"resume={path}", f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path, timeout=120
    )
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "numpy.savetxt" in ln]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not ran(marker, how)


def test_the_trust_switch_builds_what_it_names_so_the_payloads_are_live(tmp_path, trained):
    """With --trust-config the same payload runs (the file is truncated): the refusal above is what stops
    it."""
    model, marker, how = payloads(tmp_path)["open"]
    path = crafted(trained, tmp_path, model)
    assert export.main([str(path), "--trust-config"]) != 0  # a file object is no model: refused after it ran
    assert ran(marker, how)


def test_shipped_targets_torch_optim_and_the_commands_own_pass():
    stored = {
        "model": {"_target_": "ddplab.models.resnet.resnet18"},  # conf/'s resnet18, another spelling
        "optimizer": {"_target_": "torch.optim.AdamW"},
        "scheduler": {"_target_": "ddplab.optim.cosine"},
        "callbacks": {
            "ema": {"_target_": "ddplab.callbacks.ema.EMA"},
            "study": {"_target_": "ddplab.study.report.ReportToStudy"},
        },
    }
    assert trust.untrusted(stored) == []
    mine = {"model": {"_target_": "toy.FaultyMLP"}}
    assert trust.untrusted(mine) == [("model", "toy.FaultyMLP")]
    assert trust.untrusted(mine, own=compose_cfg(["model._target_=toy.FaultyMLP"])) == []
    assert trust.untrusted({"m": {"_target_": "torch.optim.sgd.torch.load"}}) == [
        ("m", "torch.optim.sgd.torch.load")
    ]


def test_an_own_run_with_its_own_model_exports_with_the_switch(tmp_path):
    """A user's model class (tests/toy.py's) is refused from the stored config alone, and exported with it."""
    run = tmp_path / "run"
    ddplab.run(compose_cfg(TINY + ["model._target_=toy.FaultyMLP"], run))
    assert export.main([str(run)]) == 2
    assert export.main([str(run), "--trust-config", "--to", "state_dict"]) == 0
    assert (run / "export" / "model.pt").is_file()


# ------------------------------------------------------------------ an export owns its folder
def test_an_export_into_an_earlier_exports_folder_replaces_it_whole(tmp_path, trained):
    """safetensors, then state_dict into the same folder: before, model.safetensors stayed beside model.pt
    (and a from_pretrained folder kept weights the new config did not describe)."""
    out = tmp_path / "out"
    assert export.main([str(trained), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.yaml", "model.safetensors"]
    assert export.main([str(trained), "--out", str(out), "--to", "state_dict"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.yaml", "model.pt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # nothing left aside


@pytest.mark.parametrize("what", ["foreign", "file"])
def test_an_export_into_a_folder_it_does_not_own_or_onto_a_file_is_one_line(tmp_path, trained, capsys, what):
    out = tmp_path / "out"
    if what == "file":
        out.write_text("mine\n")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
    assert export.main([str(trained), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"export --out {out}: ") and "Fix: " in err, err
    assert ("notes.txt" in err) == (what == "foreign")
    assert (out / "notes.txt" if what == "foreign" else out).read_text() == "mine\n"
