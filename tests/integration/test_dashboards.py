"""What a person sees of real runs: TensorBoard's first screens (read with TensorBoard's own loaders and
HParams plugin), sweep run names, the console's lines and the end-of-run and end-of-sweep summaries; a resumed
run's event files win over the crashed run's, and a full disk is one line."""

import csv
import json
import re
from pathlib import Path

import pytest
from helpers.jobs import assert_ok, python_train

from ddplab.events import events_in, read_hparams, read_scalars

STAMP = re.compile(r"^\d\d:\d\d:\d\d ")  # ddplab's console lines start with the time


def ddplab_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if STAMP.match(line)]


def tb_groups(tags: list[str]) -> list[str]:
    """The Time Series dashboard's groups, in its order: tags sorted, grouped by their first part
    (TensorBoard expands the first two on a fresh page)."""
    return list(dict.fromkeys(t.split("/", 1)[0] for t in sorted(tags)))


def custom_scalars_layout(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(str(events_in(run)), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    return layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])


def hparams_experiment(logdir: Path):
    """What the HParams tab asks for: the experiment TensorBoard's plugin builds from all runs."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    tb = base_plugin.TBContext(
        logdir=str(logdir),
        multiplexer=mux,
        data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)),
    )
    request = api_pb2.GetExperimentRequest()
    exp = get_experiment.Handler(context.RequestContext(), backend_context.Context(tb), "", request).run()
    return sorted(mux.Runs()), exp


@pytest.mark.slow
def test_a_run_opens_on_train_and_val_with_charts_typed_hparams_and_a_short_console(tmp_path):
    proc = python_train(["num_epochs=3", "model=mlp", "progress=log", "log_every_n_steps=10"], tmp_path)
    assert_ok(proc)
    (run,) = [p for p in (tmp_path / "outputs").glob("*/*")]
    s = read_scalars(run)
    # Scalars / Time Series: the groups people came for come first (the two TensorBoard opens).
    assert tb_groups(list(s)) == ["train", "val", "vitals"]
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "vitals/lr", "vitals/epoch"} <= set(s)
    # The best so far is a curve beside the objective, not a lone dot: a running max at each evaluation.
    acc, best = [v for _, v in s["val/acc"]], s["val/acc_best"]
    assert [st for st, _ in best] == [st for st, _ in s["val/acc"]] == [22, 44, 66]
    assert [v for _, v in best] == pytest.approx([max(acc[: i + 1]) for i in range(3)])
    # Custom Scalars: train vs val on one chart, open; the vitals after it, folded; no empty chart.
    layout = custom_scalars_layout(run)
    first, second = layout.category
    assert (first.title, first.closed, second.title, second.closed) == (
        "is it learning?",
        False,
        "vitals",
        True,
    )
    charts = {c.title: list(c.multiline.tag) for c in first.chart}
    assert charts["loss: train vs val"] == ["train/loss$", "val/loss$"]
    assert charts["acc: train vs val"] == ["train/acc$", "val/acc$", "val/acc_best$"]
    for c in [*first.chart, *second.chart]:
        for pattern in c.multiline.tag:
            assert any(re.match(pattern, t) for t in s), (c.title, pattern)
    # HParams: real types (torch's own writer logged amp as 0.0).
    hp = read_hparams(run)
    assert (
        hp["amp"] is False and hp["batch_size"] == 64.0 and hp["model"] == "mlp" and hp["dataset"] == "digits"
    )
    # Console: short lines, and the summary says what result.json says.
    lines = ddplab_lines(proc.stdout)
    assert len(lines) > 10 and max(map(len, proc.stdout.splitlines())) <= 120
    res = json.loads((run / "result.json").read_text())["metrics"]
    rel = run.relative_to(tmp_path)
    text = "\n".join(lines)
    assert f"best val/acc={res['val/acc_best']:.4g} at epoch " in text
    assert re.search(rf"final: val/loss={res['val/loss']:.4g}  val/acc={res['val/acc']:.4g}$", text, re.M)
    assert f"done: 3/3 epochs, 66 steps, {res['time_s']:.1f} s this run" in text
    assert [ln[9:] for ln in lines[-3:]] == [
        f"checkpoints: {rel / 'checkpoints'}",
        f"events: {rel / 'tb'}",
        f"open: tensorboard --logdir {rel}",
    ]


@pytest.mark.dist
def test_a_parallel_sweep_names_runs_by_swept_values_and_ends_with_a_summary(tmp_path):
    proc = python_train(
        [
            "-m",
            "optimizer.lr=0.1,0.01,-1",
            "model=mlp",
            "num_epochs=1",
            "progress=log",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
        ],
        tmp_path,
    )
    assert_ok(proc)
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    runs, exp = hparams_experiment(sweep)
    assert runs == ["0/lr=0.1", "1/lr=0.01"]  # TensorBoard's run names; job 2 failed before logging
    kinds = {h.name: h for h in exp.hparam_infos}
    assert exp.hparam_infos[0].name == "optimizer.lr" and exp.hparam_infos[0].differs  # swept: first, shown
    assert [h.name for h in exp.hparam_infos if h.differs] == ["optimizer.lr"]
    from tensorboard.plugins.hparams import api_pb2

    types = {n: api_pb2.DataType.Name(kinds[n].type) for n in ("optimizer.lr", "amp", "model", "batch_size")}
    assert types == {
        "optimizer.lr": "DATA_TYPE_FLOAT64",
        "amp": "DATA_TYPE_BOOL",
        "model": "DATA_TYPE_STRING",
        "batch_size": "DATA_TYPE_FLOAT64",
    }
    metrics = [m.name.tag for m in exp.metric_infos]
    assert {"val/acc", "val/acc_best"} <= set(metrics[:5])  # the first five are ticked in the HParams tab
    # Console: every line of a job carries its tag; the two jobs ran side by side.
    lines = ddplab_lines(proc.stdout)
    ours = lines + proc.stdout[proc.stdout.index("sweep: 3 jobs") :].splitlines()  # Hydra's own lines aside
    # An error stays on one line, whole, to be searched for; everything else fits 120 columns.
    assert max(len(ln) for ln in ours if " ERROR: " not in ln) <= 120
    for job in (0, 1):
        mine = [ln for ln in lines if f" [job {job}] " in ln]
        assert any("run dir: " in ln for ln in mine) and any("best val/acc=" in ln for ln in mine)
    assert all(re.match(r"^\S+ \[job \d\] ", ln) for ln in lines)
    assert "[job 2] ERROR: job failed, the sweep goes on: ConfigError: optimizer.lr=-1.0" in proc.stdout
    # End of sweep: a table sorted by the objective (failures last) on the console and in the sweep dir.
    results = {j: json.loads((sweep / str(j) / "result.json").read_text()) for j in range(3)}
    acc = {j: results[j]["metrics"]["val/acc"] for j in (0, 1)}
    order = sorted(acc, key=acc.get, reverse=True) + [2]
    table = proc.stdout[
        proc.stdout.index("sweep: 3 jobs, 2 completed, 1 not; by val/acc (higher is better)") :
    ]
    rows = [ln.split("] ", 1)[1].split() for ln in table.splitlines()[2:5]]
    assert [int(r[0]) for r in rows] == order and rows[2][1] == "failed"
    assert rows[0][2] == f"{acc[order[0]]:.4g}" and rows[0][4] == ("lr=0.1" if order[0] == 0 else "lr=0.01")
    with open(sweep / "summary.csv") as f:
        written = list(csv.DictReader(f))
    assert [int(r["job"]) for r in written] == order
    assert float(written[0]["objective"]) == pytest.approx(acc[order[0]], rel=1e-5)
    assert written[2]["status"] == "failed" and "must be > 0" in written[2]["error"]
    assert (sweep / "summary.md").read_text().startswith("| job | status | swept | val/acc |")


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_rerun_within_the_same_second_shows_its_own_steps_not_the_crashed_runs(tmp_path):
    """TensorBoard reads event files in name order; within one second the name orders by pid and a
    counter as text. A resumed run's file must still come after the crashed run's, or the crashed
    run's steps win (seen when in-process resumes ran in the same second)."""
    import os
    import socket
    import time

    from torch.utils.tensorboard import SummaryWriter

    from ddplab.writers import TensorBoardWriter

    crashed = SummaryWriter(log_dir=str(tmp_path))
    crashed.add_scalar("train/loss", 1.0, 5)
    crashed.close()
    # The crashed run's file, named as another process's of this second would be ("9" > "1..").
    (old,) = tmp_path.glob("events.out.tfevents.*")
    os.rename(
        old, tmp_path / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.99999999.9"
    )
    resumed = TensorBoardWriter(str(tmp_path))
    resumed.purge_after(0)  # a run that starts fresh where an attempt left events: drops every step of it
    resumed.scalars({"train/loss": 2.0}, 5)
    resumed.close()
    assert read_scalars(tmp_path)["train/loss"] == [(5, 2.0)]


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_purge_after_the_event_file_opened_still_drops_the_steps_after_the_checkpoint(tmp_path):
    """A callback wrote a scalar in its setup (the file opened before the resume said where to purge from):
    purge_after closes it, and the next write opens a file that drops the crashed attempt's later steps."""
    from torch.utils.tensorboard import SummaryWriter

    from ddplab.writers import TensorBoardWriter

    crashed = SummaryWriter(log_dir=str(tmp_path))
    for step in range(1, 6):
        crashed.add_scalar("train/loss", float(step), step)
    crashed.close()
    resumed = TensorBoardWriter(str(tmp_path))
    resumed.scalars({"setup/note": 1.0}, 0)
    resumed.purge_after(2)  # resumed from the checkpoint at step 2
    resumed.scalars({"train/loss": 30.0}, 3)
    resumed.close()
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_events_on_a_full_disk_are_one_line_naming_the_dir_and_space_without_the_threads_traceback(
    tmp_path, capfd
):
    """TensorBoard's writer thread met the full disk and printed its own traceback ("Exception in thread
    Thread-1: ... OSError: [Errno 28]"); the main thread then failed with a bare OSError at its next write."""
    from helpers.disk import fill
    from helpers.jobs import tmpfs

    from ddplab.errors import ResourceError
    from ddplab.writers import TensorBoardWriter

    with tmpfs(tmp_path / "disk", "size=200k") as disk:
        w = TensorBoardWriter(str(disk / "tb"))
        w.scalars({"train/loss": 1.0}, 1)
        fill(disk / "filler")  # the rest of the disk
        with pytest.raises(ResourceError) as e:
            # the writer thread writes on its own time: its failure shows at a later call
            for step in range(2, 200):
                w.scalars({"train/loss": float(step)}, step)
            w.close()
    assert str(e.value).startswith(
        f"could not write TensorBoard events to {disk / 'tb'}: OSError: [Errno 28] No space"
    )
    assert "MiB free on its file system). Fix: free space" in str(e.value)
    assert "Traceback" not in capfd.readouterr().err
