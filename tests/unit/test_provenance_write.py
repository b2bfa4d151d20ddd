"""provenance.json is written whole or not at all: a reader that sees the file reads all of it."""

import json
import threading

from ddplab import provenance


def test_a_reader_never_sees_provenance_json_half_written(tmp_path):
    """The tests (and anyone watching) wait for provenance.json, then read the ranks in it: one read the file
    between its creation and its content (CI-like load, test_async_checkpoints_ranks' SIGKILL case)."""
    prov = {"code": {"commit": "x"}, "world": {"ranks": [{"rank": r, "pid": r} for r in range(200)]}}
    seen, done = [], threading.Event()

    def read():
        path = tmp_path / "provenance.json"
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                seen.append(len(text))

    t = threading.Thread(target=read)
    t.start()
    for _ in range(300):
        provenance.write(tmp_path, {**prov, "code": dict(prov["code"])})
    done.set()
    t.join()
    assert seen == []
