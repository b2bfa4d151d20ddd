"""The trust check and export's folder, in-process (issue 45): ddplab's targets, torch.optim's and the
command's own pass ``trust.untrusted``; ``--trust-config`` builds what it names, so the crafted payloads are
live; an export replaces its own earlier folder whole and refuses another's folder, or a file, in one line."""

from __future__ import annotations

import pytest
from helpers.jobs import compose_cfg
from helpers.trust import crafted, payloads, ran

from ddplab.checkpoint import export
from ddplab.config import trust


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
