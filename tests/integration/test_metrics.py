"""Cross-rank reduction: sample-weighted means, stragglers, one collective."""

import json

import pytest
from helpers.jobs import REPO, assert_ok, torchrun

pytestmark = pytest.mark.dist


def test_unequal_counts_give_exact_global_mean(tmp_path):
    proc = torchrun(3, [], tmp_path, script=REPO / "tests" / "workers" / "reduce_worker.py", timeout=120)
    assert_ok(proc)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    counts = [3, 7, 11]  # rank r: 3 + 4r samples with loss r + 1
    exact_loss = sum(c * (r + 1) for r, c in enumerate(counts)) / sum(counts)  # 53/21
    mean_of_means = sum(r + 1 for r in range(3)) / 3  # 2.0: what a naive average reports
    assert res["val"]["val/num_samples"] == 21
    assert res["val"]["val/loss"] == pytest.approx(exact_loss, rel=1e-12)
    assert res["val"]["val/loss"] != pytest.approx(mean_of_means)
    assert res["val"]["val/acc"] == pytest.approx(18 / 21, rel=1e-12)  # one wrong per rank
    assert res["train"]["train/loss"] == pytest.approx(exact_loss, rel=1e-12)
    assert res["train"]["train/acc"] == pytest.approx(18 / 21, rel=1e-12)
    # Stragglers: per-rank step times 10, 20, 30 ms.
    assert res["train"]["vitals/step_time_ms_max"] == pytest.approx(30.0)
    assert res["train"]["vitals/step_time_ms_min"] == pytest.approx(10.0)
    assert res["train"]["vitals/step_time_ms"] == pytest.approx(20.0)
    assert res["train"]["vitals/data_time_ms_max"] == pytest.approx(3.0)
    # One collective per reduction, train and eval alike.
    assert res["train_calls"] == 1
    assert res["total_calls"] == 2
    # A task's own metric names need no code here: sums over counts across micro-batches and ranks.
    assert res["train_named"]["train/hits"] == pytest.approx(2 * (0 + 1 + 2) / (2 * 21), rel=1e-12)
    assert res["train_named"]["train/bonus"] == pytest.approx(2 * 2 * (1 + 2 + 3) / 6, rel=1e-12)
    assert res["val_named"]["val/hits"] == pytest.approx(3 / 21, rel=1e-12)
    assert res["val_named"]["val/bonus"] == pytest.approx(2 * (1 + 2 + 3) / 3, rel=1e-12)
    assert "train/acc" not in res["train_named"] and res["named_calls"] == 2


def test_cpu_sync_batchnorm_equals_batchnorm_on_the_global_batch(tmp_path):
    # torch.nn.SyncBatchNorm refuses CPU modules; ddplab's GlobalBatchNorm must
    # match single-process BatchNorm on the concatenated (unequal) shards.
    proc = torchrun(3, [], tmp_path, script=REPO / "tests" / "workers" / "syncbn_worker.py", timeout=120)
    assert_ok(proc)
    res = json.loads(
        next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :]
    )
    assert res.pop("type") == "GlobalBatchNorm"
    for what, diff in res.items():  # float64 throughout: equal to rounding
        assert diff < 1e-12, (what, diff)
