"""One bitwise comparison, for checkpoints and anything nested in them (the tests' and the soak's), and what a
run leaves read back: its checkpoints, their weights, its result.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ddplab.checkpoint.compare import first_difference


def same(a: Any, b: Any, where: str = "") -> str | None:
    """Where two values differ (tensors: dtype and every bit), or None: ddplab's own comparison."""
    return first_difference(a, b, where)


def load(path: Path, converted: bool = False) -> dict[str, Any]:
    """A checkpoint, read as ddplab reads one (``weights_only``: tensors and plain data, nothing that runs
    code); ``converted``: a file torch's DCP converter wrote for this test (its entries are not all plain)."""
    return torch.load(path, map_location="cpu", weights_only=not converted)


def last_weights(run: Path) -> dict[str, torch.Tensor]:
    """The model entry of a run's last checkpoint."""
    return load(run / "checkpoints" / "last.pt")["model"]


def result(run: Path) -> dict[str, Any]:
    """A run's result.json."""
    return json.loads((run / "result.json").read_text())


def load_whole(path: Path) -> dict[str, Any]:
    """A checkpoint with every entry in it: an FSDP one's ``sharded`` entry replaced by the ``model`` and
    ``optimizer`` its shards hold (read back whole, in one process), so it compares like a DDP one."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = load(path)
    if "sharded" in ck:
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(Path(path).parent / ck.pop("sharded")["sidecar"]), Path(tmp) / "whole.pt")
            ck.update(load(Path(tmp) / "whole.pt", converted=True))
    return ck


def assert_same_checkpoint(
    a: dict[str, Any] | Path,
    b: dict[str, Any] | Path,
    entries: tuple[str, ...] = ("model", "optimizer", "scheduler", "loop"),
) -> None:
    """Checkpoints ``a`` and ``b`` (dicts or paths) hold bit-identical ``entries``."""
    a, b = (load(x) if isinstance(x, Path) else x for x in (a, b))
    for key in entries:
        diff = same(a[key], b[key], key)
        assert diff is None, f"checkpoints differ at {diff}"


def max_rel_weight_diff(a: dict, b: dict) -> float:
    return max(
        ((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in b if b[k].is_floating_point()
    )


def tb_texts(events: Path, tag: str) -> dict[int, str]:
    """{step: text} of a TensorBoard text tag, as its Text tab shows them (ddplab indents each line by 4)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(events), size_guidance={"tensors": 0}).Reload()
    return {
        e.step: e.tensor_proto.string_val[0].decode()[4:].replace("\n    ", "\n")
        for e in ea.Tensors(f"{tag}/text_summary")
    }
