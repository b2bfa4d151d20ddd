"""The log step's reduction: the sums over ranks do not depend on the order of the ranks."""

from __future__ import annotations

import itertools
import math

import torch

import ddplab.train.metrics as metrics
from ddplab.runtime.group import Dist
from ddplab.task import TaskOutput
from ddplab.train.metrics import TrainMetrics


def rank(loss: float, size: int) -> TrainMetrics:
    """One rank's metrics after one step of one micro-batch."""
    m = TrainMetrics(Dist(), ("acc",))
    m.add_micro(TaskOutput(torch.tensor(loss), size, {"acc": (torch.tensor(float(size)), size)}))
    m.add_step(step_time=0.01, data_time=0.001)
    return m


def row(loss: float, size: int, monkeypatch) -> list[float]:
    """The row that rank sends at its log step."""
    sent = []
    monkeypatch.setattr(metrics, "all_ranks_values", lambda local, dist: sent.append(local) or [local])
    rank(loss, size).reduce()
    return sent[0]


def test_the_loss_over_three_ranks_is_the_same_in_every_order_of_their_rows(monkeypatch):
    """Rank 1's one sample is lost next to ranks 0 and 2's 2**30 each (float64 rounds 1e8 * 2**30 + 1) unless
    the sum is exact: (a + 1) - a is 0 and (a - a) + 1 is 1. A sum of two commutes; of three it need not."""
    rows = [row(1e8, 2**30, monkeypatch), row(1.0, 1, monkeypatch), row(-1e8, 2**30, monkeypatch)]
    seen = set()
    for order in itertools.permutations(rows):
        monkeypatch.setattr(metrics, "all_ranks_values", lambda local, dist, order=order: list(order))
        out, stop = rank(0.0, 1).reduce()  # its own row is one of the three
        seen.add(out["train/loss"])
        assert out["train/acc"] == 1.0 and stop is False
    assert seen == {1.0 / (2**31 + 1)}


def test_a_metric_sum_of_inf_and_minus_inf_is_nan_at_the_log_step_not_a_crash():
    """The exact sums (math.fsum) raise on inf + -inf, where float addition gives nan: an fp16 metric that
    overflowed both ways (the loss finite) is logged as nan, as it was before they were exact."""
    m = TrainMetrics(Dist(), ("acc",))
    for s in (math.inf, -math.inf):
        m.add_micro(TaskOutput(torch.tensor(1.0), 4, {"acc": (torch.tensor(s), 4)}))
        m.add_step(step_time=0.01, data_time=0.001)
    out, _ = m.reduce()
    assert math.isnan(out["train/acc"]) and out["train/loss"] == 1.0


def test_a_count_given_as_a_number_is_that_number_whatever_its_row_held_in_an_earlier_interval():
    m = TrainMetrics(Dist(), ("hits",))
    m.add_micro(TaskOutput(torch.tensor(1.0), 4, {"hits": (torch.tensor(3.0), torch.tensor(4.0))}))
    m.add_step(step_time=0.01, data_time=0.001)
    assert m.reduce()[0]["train/hits"] == 3.0 / 4
    m.add_micro(TaskOutput(torch.tensor(1.0), 4, {"hits": (torch.tensor(2.0), 8)}))  # the same row, reused
    m.add_step(step_time=0.01, data_time=0.001)
    assert m.reduce()[0]["train/hits"] == 2.0 / 8


def test_the_validation_loss_over_three_ranks_is_the_same_in_every_order_of_their_rows(monkeypatch):
    """The evaluation's sums (SumMeter) as the training log step's: exactly rounded over ranks."""
    from ddplab.train.metrics import SumMeter

    def sums(loss: float, size: int) -> torch.Tensor:
        meter = SumMeter(torch.device("cpu"), ("acc",))
        meter.update(TaskOutput(torch.tensor(loss), size, {"acc": (torch.tensor(float(size)), size)}))
        return meter.sums.clone()

    rows = [sums(1e8, 2**30), sums(1.0, 1), sums(-1e8, 2**30)]
    seen = set()
    for order in itertools.permutations(rows):
        monkeypatch.setattr(metrics, "all_ranks_rows", lambda local, dist, order=order: torch.stack(order))
        seen.add(SumMeter(torch.device("cpu"), ("acc",)).reduce(Dist())["val/loss"])
    assert seen == {1.0 / (2**31 + 1)}
