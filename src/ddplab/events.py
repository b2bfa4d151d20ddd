"""Read a run's TensorBoard events back (for scripts, sweep summaries and tests) with TensorBoard's
own reader, so what they see is what the dashboard shows."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


def events_in(path: str | Path) -> Path:
    """The folder holding the event files of ``path``: itself, or its one subfolder that has some
    (a run dir's ``tb/``, a sweep job's ``lr=0.1,model=mlp/``)."""
    path = Path(path)
    found = sorted({f.parent for f in path.rglob("events.out.tfevents*")})
    if path in found or not found:
        return path
    if len(found) > 1:
        raise ValueError(
            f"{path} holds the events of {len(found)} runs ({', '.join(str(f) for f in found)}): "
            "pass one of them"
        )
    return found[0]


def _accumulator(path: str | Path, **guidance: int) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Its reader logs each file it moves past (INFO), and a resumed run's purge of the steps it rewrote as
    # "Detected out of order event.step ... Purging" (WARNING): what the dashboard shows too, expected here.
    logging.getLogger("tensorboard").setLevel(logging.ERROR)

    acc = EventAccumulator(str(events_in(path)), size_guidance=guidance)
    acc.Reload()
    return acc


def read_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of a run (its run dir or its events folder)."""
    acc = _accumulator(path, scalars=0)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_hparams(path: str | Path) -> dict[str, Any]:
    """A run's HParams session as TensorBoard's plugin reads it: ``{name: value}``, typed as
    TensorBoard stores them (bool, float, str); empty if it logged none."""
    from tensorboard.plugins.hparams import metadata

    acc = _accumulator(path, scalars=1)
    try:
        content = acc.PluginTagToContent(metadata.PLUGIN_NAME).get(metadata.SESSION_START_INFO_TAG)
    except KeyError:  # no HParams at all in this run
        return {}
    if content is None:
        return {}
    info = metadata.parse_session_start_info_plugin_data(content)
    kinds = ("bool_value", "number_value", "string_value")
    return {
        name: getattr(v, v.WhichOneof("kind"))
        for name, v in info.hparams.items()
        if v.WhichOneof("kind") in kinds
    }


def missing_steps(
    path: str | Path, sent: dict[str, int], upto: int | None = None
) -> list[tuple[int, dict[str, float]]]:
    """(step, {tag: value}) of the scalars in the events under ``path`` that a tracker lacks: past the last
    step ``sent`` holds for each tag, up to ``upto`` (None: all), in step order. What a tracker that was
    unreachable gets later (ddplab.tracking's backfill)."""
    if not events_in(path).exists():
        return []
    by_step: dict[int, dict[str, float]] = {}
    for tag, points in read_scalars(path).items():
        for step, value in points:
            if step > sent.get(tag, -1) and (upto is None or step <= upto):
                by_step.setdefault(step, {})[tag] = value
    return sorted(by_step.items())
