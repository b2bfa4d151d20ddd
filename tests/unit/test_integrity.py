"""The earlier-run search and a log file on a full disk, in-process: resume=auto takes the newest run with the
same config digest, under its own root alone; train.log on a full disk is given up in one line, not a
traceback for every record."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from ddplab.checkpoint import files


# ------------------------------------------------------------------ the earlier-run search
def _fake_run(d: Path, overrides: list[str], config: str, mtime: float) -> Path:
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    ck = d / "checkpoints" / "last.pt"
    ck.parent.mkdir()
    torch.save({"meta": {"config": config}}, ck)

    os.utime(ck, (mtime, mtime))
    return ck


def test_resume_auto_search_matches_the_config_digest_and_stays_in_its_own_root(tmp_path):
    from ddplab.config import drift

    cfg = "model:\n  name: a\noptimizer:\n  lr: 0.1\nresume: auto\n"
    other = "model:\n  name: a\noptimizer:\n  lr: 0.2\nresume: auto\n"
    ov = ["model=mlp"]
    mine = tmp_path / "outputs" / "2026-01-02" / "10-00-00"
    (mine / ".hydra").mkdir(parents=True)
    (mine / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(ov + ["resume=auto"]))
    # Newest first: a sweep job in multirun/ (another root), then a run whose config differs, then the match.
    _fake_run(tmp_path / "multirun" / "2026-01-02" / "09-00-00" / "0", ov, cfg, 300)
    _fake_run(tmp_path / "outputs" / "2026-01-01" / "09-00-00", ov, other, 200)
    match = _fake_run(tmp_path / "outputs" / "2026-01-01" / "08-00-00", ov, cfg, 100)
    assert files.find_resume_path("auto", mine, True, drift.trajectory_digest(cfg)) == match
    assert files.find_resume_path("auto", mine, True, drift.trajectory_digest("model:\n  name: b\n")) is None
    # Harmless keys (where it runs, how long this invocation lasts) do not change the digest.
    assert drift.trajectory_digest(cfg) == drift.trajectory_digest(
        cfg.replace("resume: auto", "resume: null") + "stop_after_epochs: 1\n"
    )


def test_a_log_file_on_a_full_disk_is_given_up_in_one_line(capfd):
    """The run dir's disk filled mid-run (the soak's seed 1126, trial 1592107938): the checkpoint's one line
    was followed by logging's "--- Logging error ---" and a traceback for every record train.log could not
    take, each chained to the error being reported (80 lines). The file is now given up once, in one line."""
    import logging

    from ddplab.runtime.console import quiet_log_files

    full = logging.FileHandler("/dev/full")  # every write: ENOSPC
    logging.getLogger().addHandler(full)
    try:
        quiet_log_files()
        try:
            raise OSError(28, "No space left on device")
        except OSError:  # records logged while an error is being handled, as the Session's is
            for i in range(3):
                logging.getLogger("ddplab").error("line %d", i)
    finally:
        logging.getLogger().removeHandler(full)
        full.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err, err
    assert (
        err.count(
            "ddplab: stopped writing /dev/full: [Errno 28] No space left on device (the console keeps "
            "the log)"
        )
        == 1
    ), err
