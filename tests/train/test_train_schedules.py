"""Learning-rate and temperature schedules (heat-up, gradual, learnable alpha, auto-plateau)."""
import math

import pytest
import torch
from torch import nn

from deepmetric.run.config import LrScheduleConfig
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train
from deepmetric.train.schedules import LrSchedule, TemperatureSchedule
from conftest import synthetic_config
from deepmetric.run.rundir import read_log


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


def test_cosine_schedule_closed_form_and_warmup():
    c = LrSchedule(LrScheduleConfig(name="cosine", unit="iteration", end_factor=0.1), total_epochs=1,
                   total_iterations=40)
    # half a cosine: 1 at the start, the mean of 1 and end_factor half-way, end_factor at the end
    assert [c.factor(0, t) for t in (0, 20, 40, 60)] == pytest.approx([1, 0.55, 0.1, 0.1])
    assert c.factor(0, 10) == pytest.approx(0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2)  # cos(pi/4)
    e = LrSchedule(LrScheduleConfig(name="cosine"), total_epochs=4, total_iterations=100)
    assert [e.factor(k, 25 * k) for k in range(4)] == pytest.approx([1, (1 + math.sqrt(0.5)) / 2, 0.5,
                                                                     (1 - math.sqrt(0.5)) / 2])
    w = LrSchedule(LrScheduleConfig(name="cosine", unit="iteration", warmup=4), total_epochs=1, total_iterations=8)
    assert [w.factor(0, t) for t in range(6)] == pytest.approx(
        [(t + 1) / 4 * (1 + math.cos(math.pi * t / 8)) / 2 if t < 4 else (1 + math.cos(math.pi * t / 8)) / 2
         for t in range(6)])
    with pytest.raises(Exception, match=r"schedule\.lr\.end_factor.*\[0, 1\]"):
        config_from_dict({"train": {"epochs": 1}, "schedule": {"lr": {"name": "cosine", "end_factor": 1.5}}})


@pytest.mark.parametrize("unit", ["iteration", "epoch"])
def test_cosine_with_warmup_and_heat_up_in_the_loop(tmp_path, unit):
    """The learning rate of every step: optim.lr x cosine x linear warm-up x the heat-up factor,
    logged per step and set on every parameter group (new layers with their multiplier)."""
    epochs, per_epoch, lr, warmup, end, at = 4, 6, 0.05, 5, 0.2, 2
    raw = synthetic_config(tmp_path, train={"epochs": epochs}, eval={"every": 0, "baselines": False},
                           optim={"lr": lr, "new_layer_lr_mult": 10.0},
                           schedule={"lr": {"name": "cosine", "unit": unit, "end_factor": end, "warmup": warmup},
                                     "temperature": {"name": "heat_up", "at": at}})
    res = train(config_from_dict(raw))
    total = epochs * per_epoch
    assert res.iteration == total

    def expected(i):
        t, n = (i, total) if unit == "iteration" else (i // per_epoch, epochs)
        f = end + (1 - end) * (1 + math.cos(math.pi * t / n)) / 2
        f *= min(1.0, (i + 1) / warmup)
        return lr * f * (0.1 if i // per_epoch >= at else 1.0)

    logged = [r["lr"] for r in read_log(tmp_path / "log.jsonl", type="step")]
    assert logged == pytest.approx([expected(i) for i in range(total)], rel=1e-12)
    groups = torch.load(tmp_path / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    last = expected(total - 1)
    assert sorted(g["lr"] for g in groups) == pytest.approx([last, last * 10])  # backbone; head and loss


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


def test_gradual_without_until_stops_at_the_papers_alpha_4_and_lr_tenth():
    """An 80-epoch run with ``every: 10`` and no ``until`` used to heat 8 times (alpha 16 ->
    1.02, lr x 0.010); it now stops after 4 events, at the paper's alpha 4 and lr / 10."""
    loss = FixedAlpha(16.0)
    s = TemperatureSchedule(_temp(name="gradual", every=10), [loss])
    fired_at = [e for e in range(80) if s.step(e, 0)]
    assert fired_at == [10, 20, 30, 40] and s.events == 4
    assert loss.alpha == pytest.approx(4.0, rel=0.015)            # 16 / 1.41^4 = 4.04
    assert s.lr_factor == pytest.approx(0.1, rel=0.005)           # 0.562^4 = 0.0998
    # other factors: the count whose cumulative alpha factor is closest to 1/4
    loss2 = FixedAlpha(16.0)
    s2 = TemperatureSchedule(_temp(name="gradual", unit="iteration", every=5, alpha_factor=0.5,
                                   lr_factor=0.3), [loss2])
    for it in range(100):
        s2.step(0, it)
    assert s2.events == 2 and loss2.alpha == 4.0 and s2.lr_factor == pytest.approx(0.09)
    # lr-only gradual heating (alpha factor 1): closest to lr / 10
    s3 = TemperatureSchedule(_temp(name="gradual", every=1, alpha_factor=1.0, lr_factor=0.5), [FixedAlpha()])
    for e in range(50):
        s3.step(e, 0)
    assert s3.events == 3  # 0.5^3 = 0.125 is the closest power to 0.1 in log scale
    # an explicit 'until' still wins (more events than the default)
    s4 = TemperatureSchedule(_temp(name="gradual", every=10, until=60), [FixedAlpha()])
    for e in range(80):
        s4.step(e, 0)
    assert s4.events == 6


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
    assert loss.is_alpha_frozen  # paper Appendix E: the heated value stays (see below)


def _fit_steps(loss, feats, labels, opt, sched, epoch, steps):
    """``steps`` SGD steps on free embedding vectors; returns the alphas after each step."""
    alphas = []
    for _ in range(steps):
        sched.step(epoch, 0)
        opt.zero_grad(set_to_none=True)
        loss(feats, labels).backward()
        opt.step()
        alphas.append(loss.alpha)
    return alphas


def _alpha_setup(freeze=True, seed=0):
    from deepmetric.losses import HeatedSoftmaxLoss

    torch.manual_seed(seed)
    loss = HeatedSoftmaxLoss(num_classes=4, embedding_dim=6, alpha=8.0, learnable_alpha=True,
                             freeze_heated_alpha=freeze)
    feats = nn.Parameter(torch.nn.functional.normalize(torch.randn(16, 6), dim=1))
    labels = torch.arange(16) % 4
    opt = torch.optim.SGD([feats, *loss.parameters()], lr=0.5, momentum=0.9, weight_decay=1e-3)
    sched = TemperatureSchedule(_temp(name="heat_up", at=1), [loss])
    return loss, feats, labels, opt, sched


def test_learnable_alpha_frozen_at_the_heated_value_despite_momentum():
    """Heated-up paper Appendix E (Table 5): a learnable alpha is reduced to 1/4 of its final
    value by heating up and then stays there, even with SGD momentum and weight decay."""
    loss, feats, labels, opt, sched = _alpha_setup()
    before = _fit_steps(loss, feats, labels, opt, sched, epoch=0, steps=15)
    learned = before[-1]
    assert abs(learned - 8.0) > 0.5  # alpha trained
    assert opt.state[loss._alpha]["momentum_buffer"].abs() > 0  # momentum would keep moving it
    after = _fit_steps(loss, feats, labels, opt, sched, epoch=1, steps=15)
    assert sched.events == 1 and loss.is_alpha_frozen
    assert after == [pytest.approx(learned / 4, rel=1e-6)] * 15  # frozen at the heated value
    assert not torch.equal(feats.detach(), torch.zeros_like(feats))
    x = torch.nn.functional.normalize(torch.randn(3, 6), dim=1)
    z = x @ torch.nn.functional.normalize(loss.weight.detach(), dim=1).t() + loss.bias.detach()
    torch.testing.assert_close(loss.logits(x).detach(), loss.alpha * z)
    # without freezing, the same run keeps changing alpha after the heat-up (the old behaviour)
    loss2, feats2, labels2, opt2, sched2 = _alpha_setup(freeze=False)
    _fit_steps(loss2, feats2, labels2, opt2, sched2, epoch=0, steps=15)
    after2 = _fit_steps(loss2, feats2, labels2, opt2, sched2, epoch=1, steps=15)
    assert not loss2.is_alpha_frozen and abs(after2[-1] - after2[0]) > 1e-3


def test_frozen_alpha_survives_resume():
    loss, feats, labels, opt, sched = _alpha_setup()
    _fit_steps(loss, feats, labels, opt, sched, epoch=0, steps=10)
    _fit_steps(loss, feats, labels, opt, sched, epoch=1, steps=3)
    heated = loss.alpha
    saved = {"loss": loss.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "feats": feats.detach().clone()}
    assert bool(saved["loss"]["alpha_frozen"])
    # a fresh process: new objects (alpha back at its initial 8, not frozen), then load
    loss, feats, labels, opt, sched = _alpha_setup(seed=1)
    assert loss.alpha == 8.0 and not loss.is_alpha_frozen
    loss.load_state_dict(saved["loss"])
    with torch.no_grad():
        feats.copy_(saved["feats"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    assert loss.is_alpha_frozen and loss.alpha == heated
    after = _fit_steps(loss, feats, labels, opt, sched, epoch=2, steps=10)
    assert after == [heated] * 10 and sched.events == 1
    # a checkpoint written before freezing existed (no freeze buffers) loads as not frozen
    old = {k: v for k, v in saved["loss"].items() if k not in ("alpha_frozen", "_frozen_alpha")}
    fresh, *_ = _alpha_setup()
    fresh.load_state_dict(old)
    assert not fresh.is_alpha_frozen and fresh.alpha == pytest.approx(float(old["_alpha"]))


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


def test_learnable_alpha_frozen_in_the_training_loop_and_after_resume(tmp_path):
    """train(): with learnable alpha and heat_up at epoch 1, every step after the event logs
    the same (heated) alpha, also after stopping at epoch 2 and resuming to epoch 3."""

    from deepmetric.train.loop import train

    def raw(out, epochs):
        return synthetic_config(out, loss=[{"name": "heated_softmax", "options": {"alpha": 8.0, "learnable_alpha": True}}],
                                optim={"lr": 0.1}, schedule={"temperature": {"name": "heat_up", "at": 1}},
                                train={"epochs": epochs}, eval={"every": 0, "metrics": ["recall"]})

    def alphas(out):
        recs = read_log(out)
        return [r["alpha"] for r in recs if r["type"] == "step"]

    train(config_from_dict(raw(tmp_path / "a", 3)))
    a = alphas(tmp_path / "a")
    per_epoch = 6
    assert len(set(a[:per_epoch])) > 1  # alpha learns before the heat-up
    assert len(set(a[per_epoch:])) == 1  # and is frozen after it
    train(config_from_dict(raw(tmp_path / "b", 2)))
    train(config_from_dict(raw(tmp_path / "b", 3)), resume=tmp_path / "b" / "last.pt")
    b = alphas(tmp_path / "b")
    assert len(b) == 3 * per_epoch and set(b[per_epoch:]) == {a[-1]}
