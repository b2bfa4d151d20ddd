"""StallWatch on given step times, with a dict for torch's store: a step is stalled relative to this rank's
own recent steps (never the first step, never a run whose every step is slow; evaluation and checkpoints are
no steps), and when it speaks it names the ranks that are not at the collective it waits in, from where each
rank published itself; without a store it only asks."""

from __future__ import annotations

import json

from ddplab.runtime.watch import StallWatch


def steps(watch: StallWatch, times: list[float]) -> None:
    for i, t in enumerate(times):
        watch.mark(i + 1, t)


class Store:
    """The few calls of torch's rendezvous store the watch makes, on a dict."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, key):
        return self.kv[key]


def test_the_first_step_sets_no_yardstick():
    w = StallWatch(0, 1, 30.0)  # one process: no watcher thread; verdict() is what the thread would say
    steps(w, [0.0])
    assert w.verdict(120.0) is None  # compile, warm-up: a long first step says nothing
    steps(w, [0.0, 120.0])
    assert w.usual() is None and w.verdict(240.0) is None  # step 1's 120 s is not a yardstick either


def test_every_step_equally_slow_stays_quiet():
    """16 s steps on every rank (bf16 emulated on a CPU without it): nobody waits for anybody."""
    w = StallWatch(0, 1, 300.0)
    steps(w, [0.0, 16.0, 32.0, 48.0])
    assert w.usual() == 16.0
    assert w.verdict(48.0 + 20.0) is None


def test_a_stalled_step_names_the_rank_that_is_elsewhere():
    store = Store()
    w = StallWatch(0, 3, 30.0, store)
    w._done.set()  # the test drives verdict() itself
    steps(w, [0.0, 0.01, 0.02, 0.03, 0.04])  # step 5 starts at 0.04; usual step 10 ms
    w.phase = "backward"  # where DDP's gradient all-reduce blocks
    store.set("ddplab/stall/1", json.dumps({"step": 5, "phase": "data loading", "ran": 6.0}))
    store.set("ddplab/stall/2", json.dumps({"step": 5, "phase": "backward", "ran": 6.0}))  # waits like rank 0
    assert w.verdict(0.04 + 0.5) is None  # 500 ms: long for a 10 ms step, but under NOTICE_S
    msg = w.verdict(0.04 + 6.0)
    assert msg is not None
    assert msg.startswith("rank 0/3: step 5 has run 6s (its recent steps took 0.01s), now in its backward")
    assert "not at that collective: rank 1 (in its data loading of step 5 for 6s)" in msg
    assert "rank 2" not in msg
    # published
    assert json.loads(store.get("ddplab/stall/0")) == {"step": 5, "phase": "backward", "ran": 6.0}


def test_a_silent_rank_is_named_and_without_a_store_it_only_asks():
    store = Store()
    w = StallWatch(1, 2, 30.0, store)
    w._done.set()
    steps(w, [0.0, 0.01, 0.02])
    w.phase = "backward"
    assert "not at that collective: rank 0 (no word: dead" in w.verdict(8.0)
    bare = StallWatch(1, 2, 30.0)
    bare._done.set()
    steps(bare, [0.0, 0.01, 0.02])
    bare.phase = "backward"
    assert bare.verdict(8.0).endswith(
        "waiting for another rank in a collective? (the job fails after "
        "distributed.timeout_s=30.0, naming the rank(s) that never arrived)"
    )


def test_evaluation_and_checkpoints_are_not_steps():
    w = StallWatch(0, 1, 30.0)
    steps(w, [0.0, 0.01, 0.02])
    w.pause()
    assert w.verdict(60.0) is None  # a 60 s evaluation
    w.mark(3, 60.0)  # training again: the pause's length is not a step
    assert w.usual() == 0.01
