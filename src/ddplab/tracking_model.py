"""A tracker's model artifact of a run that ended well: what ``python -m ddplab export <run dir>`` writes (the
best checkpoint's weights, EMA's where the run had EMA), config and model card: a folder transformers loads
as is where the model has a transformers counterpart, else safetensors where installed. Made and sent on the
tracker's thread: MLflow's ``model/`` (ddplab.tracking), W&B's ``model-<run id>`` artifact
(ddplab.tracking_wandb)."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("ddplab.tracking")  # the trackers' logger: its lines are theirs

# what the artifact is, by the file that tells it (transformers' config.json first: its weights are
# model.safetensors too)
_KINDS = (("hf", "config.json"), ("safetensors", "model.safetensors"), ("state_dict", "model.pt"))


@contextlib.contextmanager
def exported(run_dir: Path, tracker: str) -> Iterator[tuple[Path, str] | None]:
    """``run_dir``'s model exported into a temporary folder: (the folder, the tag's text), or None where there
    is no model to send (checkpoints off, or the export failed: said, naming ``tracker``)."""
    from ddplab.checkpoint import export
    from ddplab.errors import InputError

    with tempfile.TemporaryDirectory(prefix=f"ddplab-{tracker}-") as tmp:
        try:
            out, said = export.export(run_dir, "auto", Path(tmp) / "model", trusted=True)  # the run's own
        # no checkpoint to export (checkpoints off): a run without a model artifact
        except InputError as e:
            log.info("%s: no model artifact: %s", tracker, e)
            yield None
            return
        except Exception as e:  # the run's own record is whole; only the artifact is missing
            log.warning(
                "%s: no model artifact: exporting %s failed (%s: %s). Fix: python -m ddplab export %s, then "
                "send the folder with %s's own tools",
                tracker,
                run_dir,
                type(e).__name__,
                str(e).strip().splitlines()[0][:300] if str(e).strip() else "",
                run_dir,
                tracker,
            )
            yield None
            return
        fmt = next(f for f, name in _KINDS if (out / name).is_file())
        yield out, f"model/ ({fmt}): {said}"


def log_model(client: Any, run_id: str, run_dir: Path) -> str | None:
    """Export ``run_dir``'s model into the MLflow run as ``model/``; the ``ddplab.model`` tag's text, None
    where there is no artifact."""
    with exported(run_dir, "mlflow") as made:
        if made is None:
            return None
        client.log_artifacts(run_id, str(made[0]), "model")
        return made[1]
