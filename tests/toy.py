"""Models and datasets that misbehave on purpose, named by `_target_` in tests.

The test launchers put this folder on PYTHONPATH, so `model._target_=toy.X`
works in every rank. Test code may read RANK; ddplab's own code never does
outside ddplab.runtime.env.

They live in three modules, by what they provide; this one re-exports every name, so `toy.X` (a `_target_`,
`import toy`, `from toy import X`) keeps working, and its module-level records (RECORDED, STALLS, _FAULTED)
are the very lists the toys append to:

* ``toy_models``    — models and a task: UnusedParamMLP, FaultyMLP, SlowMLP, AbortAtExitMLP, BadTask;
* ``toy_data``      — datasets and streams: slow_synthetic, ragged_digits, noisy_digits, torch_noisy_digits,
  DigitStream, StatefulDigitStream, UnevenDigitStream, digit_stream, ValStream, RankDependentStream,
  rank_dependent_stream;
* ``toy_callbacks`` — a user's callbacks: Recorder, TrainingOnlyRecorder, SignalJobAtLastSave,
  KillLauncherAtFitEnd, FillsDiskAtFitEnd, StallRecorder, SlowDisk, DiskHeldForTwoSteps, LoadsEachSave (and
  saves_seen), FailsOnRank, DiesMidWrite, InfGradAtStep, OptimizerStateOnLoad,
  NotesTheFreeze, CountsPageFaults;
* and here: NotesConfigTypes.
"""

import json

from toy_callbacks import (  # noqa: F401
    HELD,
    LOADED,
    RECORDED,
    STALLS,
    UNSET_AT_SETUP,
    CountsPageFaults,
    DiesMidWrite,
    DiskHeldForTwoSteps,
    FailsOnRank,
    FillsDiskAtFitEnd,
    InfGradAtStep,
    KillLauncherAtFitEnd,
    LoadsEachSave,
    NotesTheFreeze,
    OptimizerStateOnLoad,
    Recorder,
    SignalJobAtLastSave,
    SlowDisk,
    StallRecorder,
    TrainingOnlyRecorder,
    _DyingFile,
    saves_seen,
)
from toy_data import (  # noqa: F401
    DigitStream,
    RankDependentStream,
    StatefulDigitStream,
    UnevenDigitStream,
    ValStream,
    _Noisy,
    _Slow,
    _TorchNoisy,
    digit_stream,
    noisy_digits,
    ragged_digits,
    rank_dependent_stream,
    slow_synthetic,
    torch_noisy_digits,
)
from toy_models import _FAULTED, AbortAtExitMLP, BadTask, FaultyMLP, SlowMLP, UnusedParamMLP, _rank  # noqa: F401


class NotesConfigTypes:
    """Writes the schema types this rank's config arrived with: ``<run dir>/types-<rank>.json``."""

    def setup(self, state):
        from omegaconf import OmegaConf

        kinds = {
            k: OmegaConf.get_type(state.cfg[k]).__name__ for k in ("perf", "checkpoint", "model", "optimizer")
        }
        kinds["(root)"] = OmegaConf.get_type(state.cfg).__name__
        (state.run_dir / f"types-{state.dist.rank}.json").write_text(json.dumps(kinds))
