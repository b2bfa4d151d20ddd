"""Command-line plumbing that must happen before Hydra parses ``sys.argv``."""

from __future__ import annotations

import atexit
import shutil
import tempfile

from ddplab.distributed import consume_legacy_local_rank, env_rank

_RANK_LOCAL_KEYS = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.output_subdir=")


def prepare_argv(argv: list[str]) -> list[str]:
    """Fix up argv for the launcher this process runs under.

    * ``torch.distributed.launch`` appends ``--local-rank=N``; Hydra would
      reject it, so it moves to LOCAL_RANK.
    * Under torchrun every rank runs ``@hydra.main``, and each would create its
      own timestamped output dir (two, if the ranks straddle a second). Ranks
      other than 0 get a throwaway dir instead, removed at exit, and no
      ``.hydra/`` copy; ``ddplab.run`` hands them rank 0's dir.
    """
    argv = consume_legacy_local_rank(list(argv))
    rank = env_rank()
    if rank == 0:
        return argv
    scratch = tempfile.mkdtemp(prefix=f"ddplab-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    argv = [a for a in argv if not a.startswith(_RANK_LOCAL_KEYS)]
    return argv + [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]
