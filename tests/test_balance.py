import itertools
import random

import pytest

from hetforge.cluster.assign import DriftMonitor
from hetforge.cluster.balance import (
    BalanceError,
    RankInfo,
    TimeModel,
    balanced_plan,
    equal_plan,
    fixed_plan,
    solve_counts,
)
from hetforge.config import ConfigError, build_config


def _model(per_sample: float, overhead: float = 0.002, max_micro: int = 8) -> TimeModel:
    return TimeModel([(b, overhead + per_sample * b) for b in (1, 2, 4, 8) if b <= max_micro], max_micro)


def _infos(*models):
    return [RankInfo(i, "h", f"d{i}", None, m) for i, m in enumerate(models)]


@pytest.mark.parametrize("seed", range(5))
def test_solver_matches_brute_force(seed):
    rng = random.Random(seed)
    models = [_model(rng.uniform(0.001, 0.01), rng.uniform(0, 0.005), rng.choice([2, 4, 8])) for _ in range(3)]
    B = rng.randint(5, 20)
    counts = solve_counts(models, B)
    assert sum(counts) == B
    best = min(max(m.cost(n) for m, n in zip(models, c))
               for c in itertools.product(range(B + 1), repeat=3) if sum(c) == B)
    got = max(m.cost(n) for m, n in zip(models, counts))
    assert got == pytest.approx(best, rel=1e-9)


def test_balanced_split_follows_speed_and_beats_equal():
    fast, slow = _model(0.004, 0.0), _model(0.008, 0.0)
    plan = balanced_plan(_infos(fast, slow), 24)
    assert [s.samples for s in plan.shares] == [16, 8]  # 2:1 speed -> 2:1 share
    equal = equal_plan(_infos(fast, slow), 24)
    assert plan.predicted_step_s / equal.predicted_step_s == pytest.approx(2 / 3, rel=1e-6)


def test_micro_batches_respect_memory_and_sum_to_share():
    small = _model(0.004, max_micro=2)
    plan = balanced_plan(_infos(_model(0.004), small), 20)
    for s in plan.shares:
        assert sum(s.micro_batches) == s.samples and max(s.micro_batches) <= s.max_micro


def test_positions_cover_the_global_batch_exactly_once():
    plan = balanced_plan(_infos(_model(0.003), _model(0.007), _model(0.011, max_micro=2)), 29)
    for consumed in (0, 29, 290):
        seen = [p for r in range(3) for start, n in plan.micro_positions(r, consumed) for p in range(start, start + n)]
        assert seen == list(range(consumed, consumed + 29))  # same order as one process


def test_fixed_plan_checks_batch_and_memory():
    infos = _infos(_model(0.004), _model(0.004, max_micro=2))
    plan = fixed_plan(infos, 8, [(3, 3), (5, 2)])
    assert [s.micro_batches for s in plan.shares] == [[3], [2, 2, 1]]
    with pytest.raises(BalanceError, match="sum to 7 samples but the global batch is 8"):
        fixed_plan(infos, 8, [(3, 3), (4, 2)])
    with pytest.raises(BalanceError, match="micro-batch 4 exceeds .* at most 2"):
        fixed_plan(infos, 8, [(4, 4), (4, 4)])


def test_drift_monitor_rebalances_after_window():
    plan = balanced_plan(_infos(_model(0.004, 0.0), _model(0.004, 0.0)), 16)
    assert [s.samples for s in plan.shares] == [8, 8]
    mon = DriftMonitor(plan, threshold=0.25, window=3, warmup_steps=0)
    on_plan = [s.predicted_s for s in plan.shares]
    assert all(mon.observe(on_plan) is None for _ in range(10))  # no drift, no change
    throttled = [on_plan[0], on_plan[1] * 3]
    assert mon.observe(throttled) is None and mon.observe(throttled) is None
    new = mon.observe(throttled)
    assert new is not None and new.global_batch == 16
    assert [s.samples for s in new.shares] == [12, 4]  # rank 1 now 3x slower


def test_global_batch_tokens_must_divide_into_samples():
    with pytest.raises(ConfigError, match=r"global_batch_tokens must be a multiple of train.seq_len.*4000.*128"):
        build_config({"train": {"global_batch_tokens": 4000, "seq_len": 128}})
    assert build_config({"train": {"global_batch_tokens": 4096, "seq_len": 128}}).train.global_batch_size == 32


def test_fixed_balance_needs_assignments():
    with pytest.raises(ConfigError, match="cluster.balance=fixed needs cluster.assignments"):
        build_config({"cluster": {"balance": "fixed"}})


def test_a_simulated_slow_device_is_slowed_in_its_whole_compute(monkeypatch):
    """The sleep after a forward stands for (k - 1) x (forward + backward), the backward taken as
    the last one measured relative to its forward: under FSDP the backward costs far more than twice
    the forward on a small model, and the device k times slower is slower at all of it."""
    from hetforge.cluster.spec import Slowdown
    from hetforge.config import DeviceSpec

    slept = []
    monkeypatch.setattr("hetforge.cluster.spec.time.sleep", slept.append)
    slow = Slowdown(DeviceSpec(type="cpu", slowdown=2.0, slowdown_from_step=3))
    slow.after_forward(0.1, step=0)
    assert slept == []  # not yet: from step 3
    slow.after_forward(0.1, step=3)
    assert slept[-1] == pytest.approx(0.3)  # no backward measured yet: 2 x the forward
    slow.after_backward(0.4)
    slow.after_forward(0.1, step=4)
    assert slept[-1] == pytest.approx(0.5)  # (2 - 1) x (0.1 + 4 x 0.1)
    assert not Slowdown(None).active


def test_under_fsdp_a_slow_device_is_slowed_where_each_module_runs(monkeypatch):
    """Each module sleeps (k - 1) x its own forward right after it and (k - 1) x its own backward
    once its input's gradient is made: in the forward in module order, in the backward in reverse,
    each between the collectives that hold the ranks together. Timed on a fake clock."""
    import torch

    from hetforge.cluster.spec import Slowdown
    from hetforge.config import DeviceSpec

    ticks, slept, events = iter(range(1000)), [], []
    monkeypatch.setattr(Slowdown, "clock", staticmethod(lambda: float(next(ticks))))
    monkeypatch.setattr("hetforge.cluster.spec.time.sleep", slept.append)

    class Scale(torch.nn.Module):
        def __init__(self, name, k):
            super().__init__()
            self.name, self.w = name, torch.nn.Parameter(torch.tensor(float(k)))

        def forward(self, x):
            next(ticks), next(ticks)  # this module's compute: two ticks of the clock
            events.append(f"F{self.name}")
            return x * self.w

    mods = [Scale("a", 2), Scale("b", 3)]
    step = {"now": 0}
    slow = Slowdown(DeviceSpec(type="cpu", slowdown=3.0, slowdown_from_step=1))
    slow.install_per_module(mods, lambda: step["now"])
    x = torch.ones(2, requires_grad=True)
    mods[1](mods[0](x)).sum().backward()
    assert slept == []  # step 0: before slowdown_from_step
    step["now"] = 1
    x.grad = None
    out = mods[1](mods[0](x))
    assert events == ["Fa", "Fb", "Fa", "Fb"]
    assert slept == [2 * 3.0, 2 * 3.0]  # (3 - 1) x (2 ticks of compute + the clock reads between)
    out.sum().backward()
    assert len(slept) == 4 and all(t > 0 for t in slept[2:])  # each module's backward, b then a
    assert x.grad.tolist() == [6.0, 6.0]  # the marks are the identity
    assert Slowdown(None).install_per_module(mods, lambda: 0) == []
