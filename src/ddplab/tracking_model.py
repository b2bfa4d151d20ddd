"""MLflow's ``model/`` artifact of a run that ended well: what ``python -m ddplab export <run dir>`` writes
(the best checkpoint's weights, EMA's where the run had EMA), config and model card: a folder transformers
loads as is where the model has a transformers counterpart, else safetensors where installed. Made and sent
on the MLflow writer's thread (ddplab.tracking)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("ddplab.tracking")  # the writer's: its lines are the MLflow writer's

# what the artifact is, by the file that tells it (transformers' config.json first: its weights are
# model.safetensors too)
_KINDS = (("hf", "config.json"), ("safetensors", "model.safetensors"), ("state_dict", "model.pt"))


def log_model(client: Any, run_id: str, run_dir: Path) -> str | None:
    """Export ``run_dir``'s model into the MLflow run as ``model/``; the ``ddplab.model`` tag's text, None
    where there is no artifact (checkpoints off, or the export failed: said)."""
    from ddplab.checkpoint import export
    from ddplab.errors import InputError

    with tempfile.TemporaryDirectory(prefix="ddplab-mlflow-") as tmp:
        try:
            out, said = export.export(run_dir, "auto", Path(tmp) / "model", trusted=True)  # the run's own
        # no checkpoint to export (checkpoints off): a run without a model artifact
        except InputError as e:
            log.info("mlflow: no model artifact: %s", e)
            return None
        except Exception as e:  # the run's own record is whole; only the artifact is missing
            log.warning(
                "mlflow: no model artifact: exporting %s failed (%s: %s). Fix: python -m ddplab export "
                "%s, then mlflow artifacts log-artifacts",
                run_dir,
                type(e).__name__,
                str(e).strip().splitlines()[0][:300] if str(e).strip() else "",
                run_dir,
            )
            return None
        client.log_artifacts(run_id, str(out), "model")
        fmt = next(f for f, name in _KINDS if (out / name).is_file())
    return f"model/ ({fmt}): {said}"
