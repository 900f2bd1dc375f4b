"""The progress window: sums per step, a reduce that training does not wait for, one report per window."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic_ddp.training.loss_window import LossWindow


def fill(window: LossWindow, losses: list[float], rank_samples: int = 4, global_samples: int = 8) -> None:
    for loss in losses:
        window.add(torch.tensor(loss), rank_samples, global_samples)


@pytest.mark.timeout(30)
def test_a_closed_window_reports_its_mean_loss_once_and_a_new_window_starts():
    window = LossWindow(torch.device("cpu"))
    assert window.take_report() is None and window.finish() is None
    fill(window, [4.0, 8.0])  # 12 over 8 samples
    window.close(global_step=2, epoch=0, lr=0.1, distributed=False)
    report = window.take_report()
    assert (report.global_step, report.epoch, report.lr, report.loss) == (2, 0, 0.1, 1.5)
    assert report.samples_per_second > 0
    assert window.take_report() is None  # once
    fill(window, [2.0])
    window.close(global_step=3, epoch=1, lr=0.05, distributed=False)
    assert window.finish().loss == 0.5  # only the new window's steps


@pytest.mark.timeout(30)
def test_an_empty_window_reports_zero_rather_than_dividing_by_zero():
    window = LossWindow(torch.device("cpu"))
    window.close(global_step=1, epoch=0, lr=0.1, distributed=False)
    assert window.finish().loss == 0.0


@pytest.mark.timeout(60)
def test_the_reduce_over_a_real_process_group_is_asynchronous_and_sums_every_rank(one_rank_gloo_group,
                                                                                  monkeypatch):
    calls = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kwargs: calls.append(kwargs) or all_reduce(tensor, **kwargs))
    window = LossWindow(torch.device("cpu"))
    fill(window, [3.0, 3.0, 6.0], rank_samples=2)
    window.close(global_step=3, epoch=0, lr=0.1, distributed=True)
    report = window.finish()  # waits for the reduce in flight
    assert calls == [{"async_op": True}]
    assert report.global_step == 3 and report.loss == pytest.approx(2.0)
