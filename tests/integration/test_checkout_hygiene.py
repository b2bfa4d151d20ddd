"""What the documented commands write into a checkout stays out of git: runs (outputs/, multirun/), the token
files of docs/data-at-scale.md's `--out data/`, MLflow's store and artifacts from docs/mlflow.md's
`mlflow server` command, checkpoints and TensorBoard files anywhere. Asked of git itself (its own reading of
.gitignore)."""

from __future__ import annotations

import subprocess

from helpers.jobs import REPO

WRITTEN = [
    "outputs/2026-11-30/12-00-00/train.log",
    "multirun/2026-11-30/12-00-00/0/result.json",
    "data/train.bin",
    "data/tokenizer.json",
    "mlflow.db",
    "mlartifacts/1/abc/artifacts/model/model.safetensors",
    "mlruns/0/meta.yaml",
    "somewhere/checkpoints/last.pt",
    "somewhere/tb/events.out.tfevents.1.host",
]


def test_what_the_documented_commands_write_is_ignored_and_the_project_is_not():
    def ignored(path: str) -> bool:
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        assert proc.returncode in (0, 1), proc  # 128: git could not answer
        return proc.returncode == 0

    assert [p for p in WRITTEN if not ignored(p)] == []
    kept = [
        "src/ddplab/data/tokens.py",
        "conf/dataset/tokens.yaml",
        "docs/data-at-scale.md",
        "outputs/.gitignore",
    ]
    assert [p for p in kept if ignored(p)] == []
