import math

import pytest
import torch

from hetforge.config import TrainConfig
from hetforge.train.optim import Lamb, lr_at


def test_schedule_warmup_peak_and_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)  # cosine midpoint between peak and floor
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_lamb_step_matches_the_formula():
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    g = torch.randn(5, 3)
    w0 = w.detach().clone()
    opt = Lamb([w], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    w.grad = g.clone()
    opt.step()
    m, v = 0.1 * g / (1 - 0.9), 0.01 * g * g / (1 - 0.99)
    update = m / (v.sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    torch.testing.assert_close(w.detach(), expected)


def test_lamb_zero_weight_uses_unit_trust():
    b = torch.zeros(4, requires_grad=True)
    opt = Lamb([b], lr=0.5)
    b.grad = torch.ones(4)
    opt.step()
    assert torch.all(b.detach() < 0) and math.isfinite(float(b.detach().norm()))
