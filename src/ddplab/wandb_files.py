"""What a W&B run wrote, read back from its ``[offline-]run-*/run-<id>.wandb`` files (W&B writes them online
too): the last step a resumed run's W&B run holds (ddplab.tracking_wandb), and what the tests compare with
TensorBoard. wandb 0.31 ships no Python reader for them any more (the writer is wandb-core, in Go). The
format, as checked against files wandb 0.31.0 wrote:

* a 7-byte file header: ``b":W&B"``, the uint16 0xBEE1 little endian, a version byte (0). It counts as part
  of the first 32 KiB block: block boundaries are at multiples of 32 KiB from the start of the file;
* then LevelDB-log chunks: crc (4 bytes LE), payload length (2 bytes LE), type (1 byte: FULL=1, FIRST=2,
  MIDDLE=3, LAST=4), payload. A chunk never crosses a block boundary; a block's last bytes, too few (< 7) for
  a chunk header, are zeros. The crc is plain zlib CRC-32 (IEEE) of the type byte then the payload, not
  masked (wandb-core's CRCAlgoIEEE, not LevelDB's masked CRC-32C);
* a record is a FULL chunk, or FIRST + MIDDLE* + LAST joined: one serialized ``wandb_internal_pb2.Record``.

A resume (``wandb.init(id=..., resume="allow")``) writes a new directory and file: see :func:`run_files`.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK = struct.Struct("<IHB")  # crc, payload length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class _Truncated(Exception):
    """The file ends inside a record, as a writer killed mid-write leaves it: the records before are whole."""


def _chunks(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(offset, type, payload) of each chunk after the file header, its crc checked."""
    off = len(HEADER)
    while off < len(data):
        room = BLOCK - off % BLOCK
        if room < CHUNK.size:
            # No room for a chunk header: the writer zero-filled the block's tail, went on in the next one.
            if data[off : off + room].strip(b"\0"):
                raise ValueError(f"offset {off}: non-zero bytes in a block's tail padding")
            off += room
            continue
        if off + CHUNK.size > len(data):
            raise _Truncated
        crc, length, kind = CHUNK.unpack_from(data, off)
        end = off + CHUNK.size + length
        # Checked before the end of the file: a length past its block is corrupt, wherever the file ends.
        if length > room - CHUNK.size:
            raise ValueError(f"offset {off}: a chunk of {length} bytes overruns its 32 KiB block")
        if end > len(data):
            raise _Truncated
        payload = data[off + CHUNK.size : end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"offset {off}: chunk crc mismatch (type {kind}, {length} bytes)")
        yield off, kind, payload
        off = end


def _payloads(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset of its first chunk, bytes) of each record: FULL alone, or FIRST + MIDDLE* + LAST joined."""
    parts: list[bytes] = []  # the chunks of the record begun, until its LAST one
    start = 0
    for off, kind, payload in _chunks(data):
        if kind not in (FULL, FIRST, MIDDLE, LAST):
            raise ValueError(f"offset {off}: unknown chunk type {kind}")
        if bool(parts) == (kind in (FULL, FIRST)):
            where = f"inside the record at offset {start}" if parts else "outside a record"
            raise ValueError(f"offset {off}: chunk type {kind} {where}")
        if kind in (FULL, FIRST):
            start = off
        parts.append(payload)
        if kind in (FULL, LAST):
            yield start, b"".join(parts)
            parts = []
    if parts:
        raise _Truncated  # the file ends between a record's chunks


def read_records(path: str | Path) -> list[pb.Record]:
    """Every record of a ``.wandb`` file, in order. ValueError (naming the file and offset) where it is not
    one or is corrupt; a last record cut short (a killed writer) is left out, and so is not an error."""
    data = Path(path).read_bytes()
    if len(data) < len(HEADER) and HEADER.startswith(data):
        return []  # killed before its header was whole: no records yet
    if data[:7] != HEADER:  # another store version may frame records otherwise: refused, not misread
        raise ValueError(f"{path}: not a wandb run file of store version 0 (header {data[:7]!r})")
    records = []
    try:
        for off, payload in _payloads(data):
            try:
                records.append(pb.Record.FromString(payload))
            except DecodeError as e:
                raise ValueError(f"offset {off}: not a Record ({e})") from e
    except _Truncated:
        pass
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return records


def _name(item: pb.HistoryItem | pb.SummaryItem | pb.ConfigItem) -> str:
    # wandb-core writes a logged key as nested_key ({"a": {"b": 1}} as ["a", "b"]), some of its own as key;
    # "." joins a path, as wandb's UI shows it.
    return ".".join(item.nested_key) or item.key


def _value(item: pb.HistoryItem | pb.SummaryItem | pb.ConfigItem) -> Any:
    """value_json decoded (NaN, Infinity included); a history item with only the typed form
    (x_history_value_encoding) has its value read from that."""
    kind = item.WhichOneof("value") if isinstance(item, pb.HistoryItem) and not item.value_json else None
    if kind in (None, "json"):
        return json.loads(item.json if kind else item.value_json)
    return None if kind == "none" else getattr(item, kind)


def _of(path: str | Path, kind: str) -> Iterator[Any]:
    """The ``kind`` part (history, summary, run, ...) of each record of that kind, in order."""
    return (getattr(r, kind) for r in read_records(path) if r.WhichOneof("record_type") == kind)


def _apply(out: dict[str, Any], part: pb.SummaryRecord | pb.ConfigRecord) -> dict[str, Any]:
    """``out`` with ``part``'s updates and removals made; a removed key takes the keys under it along."""
    for item in part.update:
        out[_name(item)] = _value(item)
    for item in part.remove:
        gone = _name(item)
        out = {k: v for k, v in out.items() if k != gone and not k.startswith(gone + ".")}
    return out


def history(path: str | Path) -> dict[int, dict[str, float]]:
    """step -> {key: value} of what was logged, as floats. Left out: wandb's own keys (any starting with "_":
    "_step", "_runtime", "_timestamp") and what is not a number (strings, media, tables, None, bools). Records
    of one step (a step logged again) merge, the later winning."""
    rows: dict[int, dict[str, float]] = {}
    for rec in _of(path, "history"):
        row = rows.setdefault(rec.step.num, {})
        for item in rec.item:
            key, value = _name(item), _value(item)
            if not key.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = float(value)
    return rows


def summary(path: str | Path) -> dict[str, Any]:
    """The run's summary as its records leave it: key -> decoded value, wandb's own "_" keys included
    ("_step" is the last step logged)."""
    out: dict[str, Any] = {}
    for rec in _of(path, "summary"):
        out = _apply(out, rec)
    return out


def config(path: str | Path) -> dict[str, Any]:
    """The run's config: what ``wandb.init(config=...)`` gave (in the run record) with every later
    ``config.update`` (config records) applied; wandb's own "_wandb" entry (its telemetry) left out."""
    out: dict[str, Any] = {}
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        # a run record carries the whole config (re-sent when the name or tags change): applied as an update
        if kind in ("run", "config"):
            out = _apply(out, rec.run.config if kind == "run" else rec.config)
    return {k: v for k, v in out.items() if k != "_wandb" and not k.startswith("_wandb.")}


def files(path: str | Path) -> list[str]:
    """The paths of the files the run saved (requirements.txt, ``wandb.save``'s), first seen first."""
    return list(dict.fromkeys(f.path for rec in _of(path, "files") for f in rec.files))


def run_record(path: str | Path) -> pb.RunRecord:
    """The file's first run record, as ``wandb.init`` made it: run_id, project, run_group, tags, config,
    resume (True in a resumed run's file). A later one (a new name or tags) is in :func:`read_records`."""
    for run in _of(path, "run"):
        return run
    raise ValueError(f"{path}: no run record")


def run_files(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of run ``run_id`` under ``wandb_dir`` (``wandb.init``'s ``dir=``, or the ``wandb``
    folder in it), oldest first: the run's, then each resume's. Each is
    ``[offline-]run-<YYYYMMDD_HHMMSS>-<run_id>[-<n>]/run-<run_id>.wandb`` (offline-: written offline), a start
    in the same second as an earlier one taking the suffix -1, -2, ..."""
    pattern = f"*run-*-{run_id}*/run-{run_id}.wandb"
    found = [*Path(wandb_dir).glob(pattern), *Path(wandb_dir, "wandb").glob(pattern)]

    def written(file: Path) -> tuple[str, int]:
        when, _, rest = file.parent.name.removeprefix("offline-").removeprefix("run-").partition("-")
        return when, int(rest.removeprefix(run_id).removeprefix("-") or 0)

    return sorted(found, key=written)


def last_row(wandb_dir: str | Path, run_id: str) -> tuple[int, set[str]]:
    """The last step the run's files hold (-1: none) and the keys logged at it, over every attempt's file:
    what a resume need not send again. A file that cannot be read counts as holding nothing (its steps are
    sent again; W&B keeps the first)."""
    step, keys = -1, set()
    for file in run_files(wandb_dir, run_id):
        try:
            rows = history(file)
        except (OSError, ValueError):
            continue
        if rows and max(rows) >= step:
            keys = set(rows[max(rows)]) | (keys if max(rows) == step else set())
            step = max(rows)
    return step, keys
