"""The console's helpers and sweep labels, in-process: wrapped lines stay short and lose nothing, a run's
label names the values a sweep varies (the command's sweeps and a sweeper's params), and the sweep table
orders jobs by the objective's direction, failures last, in short lines."""

import json

from ddplab.rundir import label, swept
from ddplab.sweep import summarize, to_console
from ddplab.train.reporting import wrap


def test_console_helpers_keep_lines_short_and_name_what_a_sweep_varies(tmp_path):
    items = [f"val/metric_{i}=0.{i}234" for i in range(12)]
    lines = wrap("epoch 3/10", items)
    assert len(lines) > 1 and max(map(len, lines)) <= 100
    assert " ".join(lines).split() == ["epoch", "3/10", *items]  # nothing lost, nothing reordered
    assert (
        label({"optimizer.lr": "0.0123456789", "model": "mlp", "dataset.root": "/data/x"})
        == "lr=0.01235,model=mlp,root=_data_x"
    )
    assert label({"optimizer.lr": "0.1", "scheduler.lr": "1e-3"}) == "optimizer.lr=0.1,scheduler.lr=0.001"
    # Which overrides a sweep varies: the command's sweeps and a sweeper's sampled params, not fixed values.
    sweep = tmp_path / "sweep"
    job = sweep / "3"
    (job / ".hydra").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: ['optimizer.lr=0.1,0.01', 'num_epochs=2']\n"
    )
    (job / ".hydra" / "overrides.yaml").write_text(
        "- optimizer.lr=0.01\n- num_epochs=2\n- optimizer.momentum=0.8\n"
    )
    (job / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      optimizer.momentum: interval(0.5, 0.99)\n"
    )
    assert swept(job) == {"optimizer.lr": "0.01", "optimizer.momentum": "0.8"}
    (job / ".hydra" / "hydra.yaml").write_text("hydra:\n  mode: RUN\n")
    assert swept(job) == {}  # a single run is no sweep
    # The sweep table: the direction the jobs recorded (a minimised objective), failures last, short lines.
    for j, (status, v) in enumerate([("completed", 0.5), ("failed", None), ("completed", 0.2)]):
        d = tmp_path / "s2" / str(j)
        d.mkdir(parents=True)
        metrics = {"val/mae": v, "val/mae_best": v} if v is not None else {}
        (d / "result.json").write_text(
            json.dumps(
                {
                    "status": status,
                    "metrics": metrics,
                    "error": "x" * 300,
                    "objective": {"name": "val/mae", "minimize": True},
                }
            )
        )
    rows = summarize(tmp_path / "s2", "val/mae")
    assert [r["job"] for r in rows] == [2, 0, 1]
    out = to_console(rows, "val/mae", True)
    assert out[0].endswith("by val/mae (lower is better)") and max(map(len, out)) <= 85
