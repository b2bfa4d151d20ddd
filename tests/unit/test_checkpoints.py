"""Checkpoint parts in-process: the restart memo lives in this user's private dir and never follows a symlink;
any object with state_dict/load_state_dict joins the checkpoint in one register() line, and one that refuses
the checkpoint on resume leaves every component unloaded."""

import os

import pytest
import torch

# A rank SIGKILLed under torchrun --max-restarts, restarted and resumed bitwise with each step logged once: at
# 3 ranks in tests/integration/test_resume_world_sizes.py (its 2-rank twin here checked nothing that one does
# not).


def test_restart_memo_lives_in_a_private_dir_and_never_follows_a_symlink(tmp_path, monkeypatch):
    """The temp dir is everyone's: the memo's directory must be this user's alone, or nothing is written."""
    import stat
    import tempfile

    from ddplab.runtime import env

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # plain torchrun's (predictable) run id
    private = tmp_path / f"ddplab-{os.getuid()}"
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    private.symlink_to(elsewhere)  # planted by someone else before the job started
    with pytest.raises(RuntimeError, match="is not a private directory of this user"):
        env.run_dir_memo()
    private.unlink()
    private.mkdir(mode=0o777)
    os.chmod(private, 0o777)  # open to others
    with pytest.raises(RuntimeError, match="is not a private directory"):
        env.run_dir_memo()
    private.rmdir()
    memo = env.run_dir_memo()  # created 0700 now
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and memo.parent == private
    (tmp_path / "target").write_text("precious")
    memo.symlink_to(tmp_path / "target")  # a symlink at the memo's name is replaced, not written through
    env.write_memo(memo, "/runs/a")
    assert (tmp_path / "target").read_text() == "precious" and env.read_memo(memo) == "/runs/a"
    assert stat.S_IMODE(memo.stat().st_mode) == 0o600 and not memo.is_symlink()


def test_a_component_joins_the_checkpoint_in_one_line_and_a_misfit_loads_nothing(tmp_path):
    from omegaconf import OmegaConf

    from ddplab.checkpoint import CheckpointManager
    from ddplab.config.schema import CheckpointConfig
    from ddplab.runtime.group import Dist

    class Counter:  # any object with state_dict/load_state_dict
        def __init__(self, n):
            self.n = n

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    class Picky(Counter):
        def check(self, ck, path):
            raise RuntimeError(f"resume: {path} does not suit Picky")

    policy = OmegaConf.structured(CheckpointConfig)  # every_n_steps 0, keep_last 2, save_best: the defaults

    def manager(ema, counter):
        m = CheckpointManager(tmp_path / "checkpoints", policy, Dist(), {"config": "x"})
        m.register("ema", ema)  # a module is Stateful as it is
        m.register("counter", counter)
        return m

    torch.manual_seed(0)
    saved_ema = torch.nn.Linear(3, 2)
    manager(saved_ema, Counter(7)).save(step=12, is_best=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best.pt",
        "last.pt",
        "save_seconds.json",
        "step-00000012.pt",
    ]
    ema, counter = torch.nn.Linear(3, 2), Counter(0)
    assert manager(ema, counter).resume("auto", tmp_path).name == "last.pt"
    assert counter.n == 7 and torch.equal(ema.weight, saved_ema.weight)

    fresh_ema, picky = torch.nn.Linear(3, 2), Picky(0)
    before = fresh_ema.weight.clone()
    with pytest.raises(RuntimeError, match="does not suit Picky"):
        manager(fresh_ema, picky).resume("auto", tmp_path)
    assert torch.equal(fresh_ema.weight, before) and picky.n == 0  # checked before anything was loaded
    with pytest.raises(ValueError, match="registered twice"):
        manager(ema, counter).register("ema", ema)
