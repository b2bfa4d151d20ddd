"""ddplab.wandb_files reads back a ``.wandb`` file as wandb 0.31's writer lays it out, on files this test
writes itself (its own encoder, from the format spelled out here, not the reader's constants): records that
span blocks, a block's zero-padded tail, a chunk with an empty payload at a block's end. A corrupt crc is an
error naming its offset; a last record cut short is left out. No wandb run is started: it stays under 1 s."""

from __future__ import annotations

import json
import zlib

import pytest

pytest.importorskip("wandb")

from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

from ddplab import wandb_files as wr  # noqa: E402

BLOCK = 32 * 1024


def encode(records: list[pb.Record]) -> tuple[bytes, list[int]]:
    """The file wandb-core would write for ``records``, and the offset of each record's first chunk."""
    out, starts = bytearray(b":W&B\xe1\xbe\x00"), []
    for rec in records:
        rest, first = rec.SerializeToString(), True
        while first or rest:
            room = BLOCK - len(out) % BLOCK
            if room < 7:  # no room for a chunk header: zeros to the block's end
                out += bytes(room)
                continue
            piece, rest = rest[: room - 7], rest[room - 7 :]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            if first:
                starts.append(len(out))
            crc = zlib.crc32(bytes([kind]) + piece)
            out += crc.to_bytes(4, "little") + len(piece).to_bytes(2, "little") + bytes([kind]) + piece
            first = False
    return bytes(out), starts


def sized(size: int) -> pb.Record:
    """A files record serializing to exactly ``size`` bytes: to put the next chunk where a test wants it."""
    for n in range(size, 0, -1):
        rec = pb.Record(files=pb.FilesRecord(files=[pb.FilesItem(path="f" * n)]))
        if rec.ByteSize() == size:
            return rec
    raise AssertionError(size)


def history(step: int) -> pb.Record:
    items = [("_step", step), ("loss", 1 / (step + 1)), ("train/" + "k" * 200, step * 0.5), ("note", "text")]
    rec = pb.Record(history=pb.HistoryRecord(step=pb.HistoryStep(num=step)))
    for key, value in items:
        rec.history.item.add(nested_key=[key], value_json=json.dumps(value))
    return rec


def records() -> list[pb.Record]:
    config = pb.ConfigRecord()
    for key, value in [("lr", "0.1"), ("_wandb", "{}"), ("blob", '"' + "b" * 70_000 + '"')]:
        config.update.add(key=key, value_json=value)  # the blob makes run 3 chunks: FIRST, MIDDLE, LAST
    run = pb.Record(run=pb.RunRecord(run_id="r1", project="p", run_group="g", tags=["t"], config=config))
    recs = [pb.Record(header=pb.HeaderRecord())]
    recs += [sized(BLOCK - len(encode(recs)[0]) - 7 - 3), run]  # leaves 3 bytes: a padded tail before run
    recs.append(sized(BLOCK - len(encode(recs)[0]) % BLOCK - 7 - 7))  # leaves 7: an empty FIRST chunk next
    recs.append(pb.Record(config=pb.ConfigRecord(update=[pb.ConfigItem(key="late", value_json="[1, 2]")])))
    recs += [history(step) for step in range(300)]
    recs.append(
        pb.Record(summary=pb.SummaryRecord(update=[pb.SummaryItem(nested_key=["a", "b"], value_json="2")]))
    )
    return recs


def test_reads_back_what_was_written(tmp_path):
    recs = records()
    data, starts = encode(recs)
    assert starts[2] == BLOCK and data[BLOCK - 3 : BLOCK] == b"\0\0\0" and data[2 * BLOCK + 6] == 3  # MIDDLE
    assert starts[4] == 4 * BLOCK - 7 and data[starts[4] + 4 : starts[4] + 7] == b"\0\0\x02"  # empty FIRST
    (path := tmp_path / "run-r1.wandb").write_bytes(data)

    assert wr.read_records(path) == recs
    assert wr.history(path) == {s: {"loss": 1 / (s + 1), "train/" + "k" * 200: s * 0.5} for s in range(300)}
    assert wr.config(path) == {"lr": 0.1, "blob": "b" * 70_000, "late": [1, 2]}
    assert wr.summary(path) == {"a.b": 2}
    assert (wr.run_record(path).run_id, list(wr.run_record(path).tags)) == ("r1", ["t"])
    assert wr.files(path) == [recs[1].files.files[0].path, recs[3].files.files[0].path]


def test_a_corrupt_crc_is_an_error_naming_its_offset(tmp_path):
    data, starts = encode(records())
    for start in (starts[2], starts[-1]):  # the 3-chunk run record's first chunk, the last record
        bad = bytearray(data)
        bad[start + 9] ^= 0x01  # a payload byte
        (path := tmp_path / "bad.wandb").write_bytes(bad)
        with pytest.raises(ValueError, match=rf"bad\.wandb: offset {start}: chunk crc mismatch"):
            wr.read_records(path)


def test_a_last_record_cut_short_is_left_out(tmp_path):
    recs = records()
    data, starts = encode(recs)
    path = tmp_path / "cut.wandb"
    # inside the last record's header, its payload; between and inside the 3-chunk record's chunks; after an
    # empty FIRST chunk; the file header alone
    cuts = [(starts[-1] + 3, -1), (len(data) - 1, -1), (2 * BLOCK, 2), (2 * BLOCK + 10, 2), (3 * BLOCK, 2)]
    for end, whole in [*cuts, (4 * BLOCK, 4), (7, 0)]:
        path.write_bytes(data[:end])
        assert wr.read_records(path) == recs[:whole], end
