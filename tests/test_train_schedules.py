"""Learning-rate and temperature schedules (heat-up, gradual, learnable alpha, auto-plateau)."""
import math

import pytest
import torch
from torch import nn

from deepmetric.train.config import LrScheduleConfig, TemperatureScheduleConfig, config_from_dict
from deepmetric.train.schedules import LrSchedule, TemperatureSchedule


class FixedAlpha(nn.Module):
    def __init__(self, alpha=16.0):
        super().__init__()
        self.alpha = alpha


def _temp(**kw):
    """A validated temperature config (defaults resolved as in a real config)."""
    # a metric monitor watches validation metrics, so the config needs a validation split
    return config_from_dict({"train": {"epochs": 1}, "data": {"val_classes": 0.2},
                             "schedule": {"temperature": kw}}).schedule.temperature


def test_lr_schedules_closed_forms():
    s = LrSchedule(LrScheduleConfig(name="step", step_size=3, gamma=0.5), total_epochs=10, total_iterations=100)
    assert [s.factor(e, 0) for e in range(7)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    m = LrSchedule(LrScheduleConfig(name="multistep", milestones=[2, 5], gamma=0.1), total_epochs=10, total_iterations=0)
    assert [m.factor(e, 0) for e in (0, 1, 2, 4, 5, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    # two-head paper: polynomial power 1 from lr to 0 over the run (iteration based)
    p = LrSchedule(LrScheduleConfig(name="poly", unit="iteration", power=1.0), total_epochs=1, total_iterations=40)
    assert [p.factor(0, t) for t in (0, 10, 20, 40, 50)] == pytest.approx([1, 0.75, 0.5, 0, 0])
    p2 = LrSchedule(LrScheduleConfig(name="poly", unit="iteration", power=2.0, end_factor=0.1),
                    total_epochs=1, total_iterations=10)
    assert p2.factor(0, 5) == pytest.approx(0.1 + 0.9 * 0.5 ** 2)
    w = LrSchedule(LrScheduleConfig(name="constant", warmup=4), total_epochs=1, total_iterations=10)
    assert [w.factor(0, t) for t in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])


def test_heat_up_fires_once_at_the_epoch():
    loss = FixedAlpha(16.0)
    s = TemperatureSchedule(_temp(name="heat_up", at=3), [loss])
    seen = []
    for epoch in range(6):
        for it in range(4):
            s.step(epoch, epoch * 4 + it)
            seen.append((epoch, loss.alpha, s.lr_factor))
    assert all(a == 16.0 and f == 1.0 for e, a, f in seen if e < 3)
    assert all(a == 4.0 and f == pytest.approx(0.1) for e, a, f in seen if e >= 3)
    assert s.events == 1 and len(s.history) == 1 and s.history[0]["epoch"] == 3


def test_heat_up_iteration_unit_and_custom_factors():
    loss = FixedAlpha(8.0)
    s = TemperatureSchedule(_temp(name="heat_up", unit="iteration", at=10, alpha_factor=0.5, lr_factor=0.2), [loss])
    assert not s.step(0, 9) and loss.alpha == 8.0
    assert s.step(0, 10) and loss.alpha == 4.0 and s.lr_factor == pytest.approx(0.2)
    assert not s.step(0, 11) and loss.alpha == 4.0


def test_gradual_every_n_epochs_until():
    loss = FixedAlpha(16.0)
    s = TemperatureSchedule(_temp(name="gradual", every=10, until=30), [loss])
    for epoch in range(45):
        s.step(epoch, 0)
    # events at epochs 10, 20, 30 only (official code: lr x 0.562, alpha / 1.41 each time)
    assert s.events == 3
    assert loss.alpha == pytest.approx(16.0 / 1.41 ** 3)
    assert s.lr_factor == pytest.approx(0.562 ** 3)


def test_learnable_alpha_heats_the_learned_value():
    from deepmetric.losses import HeatedSoftmaxLoss

    loss = HeatedSoftmaxLoss(num_classes=5, embedding_dim=4, alpha=8.0, learnable_alpha=True)
    # pretend training moved alpha from 8 to 12.5 (paper Table 5: learned alphas grow)
    loss.alpha = 12.5
    s = TemperatureSchedule(_temp(name="heat_up", at=1), [loss])
    s.step(0, 0)
    assert float(loss.alpha) == pytest.approx(12.5)
    s.step(1, 5)
    assert float(loss.alpha) == pytest.approx(12.5 / 4)
    assert any(p.requires_grad and p.numel() == 1 for p in loss.parameters())  # still learnable


def test_schedule_requires_a_loss_with_alpha():
    with pytest.raises(ValueError, match="needs a loss with an 'alpha'"):
        TemperatureSchedule(_temp(name="heat_up", at=1), [nn.Identity()])
    # 'none' accepts anything
    TemperatureSchedule(_temp(), [nn.Identity()])


def test_auto_plateau_triggers_after_patience_and_not_before():
    loss = FixedAlpha(16.0)
    s = TemperatureSchedule(_temp(name="auto_plateau", monitor="train_loss", patience=3, min_delta=0.01), [loss])
    assert s.mode == "min"
    improving = [5.0, 4.0, 3.0, 2.5, 2.2, 2.1]
    assert not any(s.observe(v) for v in improving)      # steady improvement: never
    assert not s.observe(2.095)                           # within min_delta: 1 bad
    assert not s.observe(2.2)                             # 2 bad
    assert loss.alpha == 16.0 and s.events == 0
    assert s.observe(2.15)                                # 3rd bad: heats up
    assert loss.alpha == 4.0 and s.lr_factor == pytest.approx(0.1)
    # max_heatups=1: a second plateau changes nothing
    assert not any(s.observe(3.0) for _ in range(10))
    assert loss.alpha == 4.0 and s.events == 1


def test_auto_plateau_metric_mode_max_and_reset():
    loss = FixedAlpha(16.0)
    s = TemperatureSchedule(_temp(name="auto_plateau", monitor="recall@1", patience=2, max_heatups=2), [loss])
    assert s.mode == "max"
    seq = [0.1, 0.2, 0.2, 0.19]  # two non-improvements after 0.2 -> heat up
    fired = [s.observe(v) for v in seq]
    assert fired == [False, False, False, True]
    # after heating the baseline restarts: a lower value is not "worse than before"
    assert [s.observe(v) for v in (0.15, 0.16, 0.17)] == [False, False, False]
    assert [s.observe(v) for v in (0.17, 0.16)] == [False, True]
    assert loss.alpha == 1.0 and s.events == 2
    assert not s.observe(math.nan)


def test_state_dict_round_trip_does_not_refire():
    loss = FixedAlpha(16.0)
    s = TemperatureSchedule(_temp(name="heat_up", at=2), [loss])
    for e in range(4):
        s.step(e, 0)
    state = s.state_dict()
    # a resumed run: the loss state restores the heated alpha, the schedule its bookkeeping
    loss2 = FixedAlpha(4.0)
    s2 = TemperatureSchedule(_temp(name="heat_up", at=2), [loss2])
    s2.load_state_dict(state)
    s2.step(4, 0)
    assert loss2.alpha == 4.0 and s2.lr_factor == pytest.approx(0.1) and s2.events == 1
    torch.save(state, "/dev/null")  # plain data only
