"""Every config error is one line, once, under every launcher, with result.json and exit 2 (issue 22, item 8);
files met while searching for resume=auto, and images that cannot be decoded, are named."""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from pathlib import Path

import pytest
from helpers.jobs import assert_ok, job_dirs, job_env, python_train, torchrun
from helpers.lines import ddplab_lines

# each runs train.py (under torchrun, self-launch or alone) to read its one line
pytestmark = pytest.mark.slow

SMALL = ["model=mlp", "num_epochs=1", "progress=none"]


def assert_one_config_error(proc, tmp_path: Path, key: str) -> None:
    lines = [ln for ln in ddplab_lines(proc.stdout + proc.stderr) if " ranks: " not in ln]
    assert len(lines) == 1 and "config error: " in lines[0] and key in lines[0] and "Fix: " in lines[0], (
        "\n".join(lines[-30:])
    )
    result = json.loads((job_dirs(tmp_path)[0] / "result.json").read_text())
    assert (
        result["status"] == "failed"
        and result["error"].startswith("config error: ")
        and key in result["error"]
    )


@pytest.mark.parametrize(
    "override,key",
    [
        (["distributed.backend=nccl"], "distributed.backend=nccl"),  # before the process group forms
        (
            ["dataset.num_classes=5"],
            "dataset.num_classes=5",
        ),  # while building the job (the dataset refuses it)
        (
            ["callbacks=[ema]", "callbacks.ema.decay=2"],
            "callbacks.ema.decay=2.0",
        ),  # a typed callback: validate
        (["+callbacks.foo._target_=nope.Foo"], "callbacks.foo._target_='nope.Foo'"),
        (["task=lm"], "model.num_classes"),  # an interpolation that cannot resolve
    ],
)
def test_under_torchrun(tmp_path, override, key):
    proc = torchrun(2, [*SMALL, *override], tmp_path, timeout=120)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr  # every rank exited 2; torchrun says 1
    assert_one_config_error(proc, tmp_path, key)


def test_in_one_process_nccl_is_refused_not_ignored(tmp_path):
    proc = python_train([*SMALL, "distributed.backend=nccl"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert_one_config_error(proc, tmp_path, "distributed.backend=nccl")


def test_self_launched_ranks_report_a_build_time_error_once(tmp_path):
    # The dataset refuses the value while the ranks build the job (typed values are refused before any rank).
    proc = python_train(
        [*SMALL, "distributed.nproc_per_node=2", "dataset.num_classes=5"], tmp_path, timeout=120
    )
    assert proc.returncode == 2
    lines = [
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if "self-launch:" not in ln and " ranks: " not in ln
    ]
    assert len(lines) == 1 and "config error: dataset.num_classes=5" in lines[0], "\n".join(lines[-30:])
    assert json.loads((job_dirs(tmp_path)[0] / "result.json").read_text())["error"].startswith(
        "config error: dataset.num_classes=5"
    )


def test_resume_auto_skips_a_malformed_earlier_run_naming_the_file(tmp_path):
    bad = tmp_path / "outputs" / "2020-01-01" / "00-00-00"
    (bad / ".hydra").mkdir(parents=True)
    (bad / ".hydra" / "overrides.yaml").write_text("- model=mlp\n  - : [unclosed\n")
    (bad / "checkpoints").mkdir()
    (bad / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    same = tmp_path / "outputs" / "2020-01-01" / "00-00-01"  # same overrides, a checkpoint that is not one
    (same / ".hydra").mkdir(parents=True)
    (same / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in SMALL))
    (same / "checkpoints").mkdir()
    (same / "checkpoints" / "last.pt").write_bytes(b"\x00garbage")
    proc = python_train([*SMALL, "resume=auto"], tmp_path, timeout=120)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert f"resume=auto: skipping {bad / '.hydra' / 'overrides.yaml'}, which cannot be read" in out
    assert (
        f"resume=auto: skipping {same / 'checkpoints' / 'last.pt'}, which cannot be read as a checkpoint"
        in out
    )
    assert "Traceback" not in out


def _png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose header claims width x height pixels (Pillow checks the size when it opens it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def test_an_image_over_pillows_limit_or_broken_names_the_file(tmp_path):
    from ddplab.data.files import ImageFileError, ImageFolder

    (tmp_path / "cat").mkdir()
    _png_header_only(tmp_path / "cat" / "bomb.png", 20000, 20000)  # 4e8 pixels: over twice Pillow's limit
    (tmp_path / "cat" / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    ds = ImageFolder(tmp_path, ["cat"], 8, 3, "imagenet")
    with pytest.raises(
        ImageFileError, match=rf"^{tmp_path / 'cat' / 'bomb.png'}: .*decompression bomb.*Fix: "
    ):
        ds[0]
    with pytest.raises(ImageFileError, match=rf"^{tmp_path / 'cat' / 'cut.jpg'}: cannot be decoded .*Fix: "):
        ds[1]
    assert sys.modules["PIL.Image"].MAX_IMAGE_PIXELS == 89478485  # the default limit, untouched


@pytest.mark.parametrize("launcher", ["python", pytest.param("torchrun", marks=pytest.mark.dist)])
def test_a_token_file_its_config_does_not_describe_is_one_config_error_not_hydras(tmp_path, launcher):
    """Refused by the dataset factory inside Hydra's instantiate: the factory's own line, once, exit 2."""
    import numpy as np

    from ddplab.data.tokens import write_tokens

    f = write_tokens(np.arange(2000) % 256, tmp_path / "t.bin", "uint16", vocab_size=256)
    args = [
        "task=lm",
        "dataset=tokens",
        f"dataset.path={f}",
        "dataset.dtype=uint32",
        "model.n_embd=32",
        "model.n_layer=1",
        "model.n_head=2",
        "progress=none",
    ]
    proc = (
        torchrun(2, args, tmp_path, timeout=120)
        if launcher == "torchrun"
        else python_train(args, tmp_path, 120)
    )
    assert proc.returncode == (1 if launcher == "torchrun" else 2)
    if launcher == "torchrun":
        assert "exitcode  : 2" in proc.stderr  # every rank exited 2; torchrun says 1
    assert_one_config_error(
        proc,
        tmp_path,
        f"{f} was written as uint16 (t.bin.json), but dataset.dtype=uint32. Fix: dataset.dtype=uint16",
    )
    out = "\n".join(ddplab_lines(proc.stdout + proc.stderr))
    assert (
        out.count("was written as uint16") == 1
        and "Traceback" not in out
        and "InstantiationException" not in out
    )


@pytest.mark.dist
def test_a_checkpoint_of_another_strategy_is_one_config_error_under_every_launcher(tmp_path):
    """An FSDP run's checkpoint resumed with distributed=ddp (torchrun) or in one process, and a DDP run's
    resumed with distributed=fsdp: the sentence was right, but as a RuntimeError traceback with exit 1."""
    args = [*SMALL, "limit_train_steps=3"]
    assert_ok(torchrun(2, [*args, "distributed=fsdp", "run_dir=fsdp"], tmp_path, timeout=180))
    assert_ok(python_train([*args, "run_dir=full"], tmp_path, timeout=120))
    sharded, full = (tmp_path / d / "checkpoints" / "last.pt" for d in ("fsdp", "full"))
    cases = {
        "ddp": (torchrun, [f"resume={sharded}"], "was saved with distributed=fsdp"),
        "one": (None, [f"resume={sharded}"], "was saved with distributed=fsdp"),
        "to_fsdp": (torchrun, ["distributed=fsdp", f"resume={full}"], "was saved without distributed=fsdp"),
    }
    for name, (launcher, extra, says) in cases.items():
        cwd = tmp_path / name
        cwd.mkdir()
        proc = (
            torchrun(2, [*args, *extra], cwd, timeout=180)
            if launcher
            else python_train([*args, *extra], cwd, timeout=120)
        )
        assert proc.returncode == 2 or (launcher and "exitcode  : 2" in proc.stderr), proc.stderr[-3000:]
        assert_one_config_error(proc, cwd, extra[-1])
        out = "\n".join(ddplab_lines(proc.stdout + proc.stderr))
        assert "Traceback" not in out and says in out, out[-3000:]


@pytest.mark.dist
def test_mlflow_missing_where_the_ranks_run_is_one_config_error_under_torchrun(tmp_path):
    """logger=[...,mlflow] where MLflow is not installed: only rank 0 opens the MLflow run, so only rank 0
    found it missing, after the process group formed; its peer then blamed a killed rank. Refused before it
    now."""
    hide = tmp_path / "no_mlflow"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['mlflow'] = None  # as if not installed\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(hide), job_env()["PYTHONPATH"]])}
    proc = torchrun(2, [*SMALL, "logger=[tensorboard,mlflow]"], tmp_path, timeout=120, extra_env=env)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # every rank exited 2
    assert_one_config_error(
        proc, tmp_path, "logger=['tensorboard', 'mlflow']: needs MLflow, which is not installed"
    )
