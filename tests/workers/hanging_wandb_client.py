"""A W&B client process (ddplab.tracking_wandb_proc's protocol) that starts, then hangs at its first log call
for good, ignoring SIGTERM as the real one does: a wandb-core stuck mid-run."""

from __future__ import annotations

import pickle
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = sys.stdout.buffer
while True:
    call, args = pickle.load(sys.stdin.buffer)
    if call == "log":
        while True:
            time.sleep(60)
    pickle.dump(("ok", ("offline", "") if call == "start" else None), out)
    out.flush()
