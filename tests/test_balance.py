import contextlib
import itertools
import random

import pytest

from hetforge.cluster.balance import DriftMonitor
from hetforge.cluster.balance import (
    BalanceError,
    RankInfo,
    TimeModel,
    balanced_plan,
    collective_seconds,
    equal_counts,
    equal_plan,
    fit_link,
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


# A CPU rank's probe as recorded in a 2-rank FSDP run of the tiny preset (seconds per micro-step):
# two micro-batches of 4 timed a little faster than one of 8, and the probe sees no collectives.
RECORDED = [(1, 0.02777), (2, 0.04755), (4, 0.08209), (8, 0.17330)]


def test_collectives_per_micro_batch_make_fsdp_take_fewer_larger_micro_batches():
    bare = TimeModel(RECORDED, 8)
    assert bare.split(8)[0] == [4, 4]
    # the same run's measured FSDP collectives: 9 a micro-batch, 14.7 ms together
    priced = TimeModel(RECORDED, 8, per_micro_s=0.0147)
    parts, t = priced.split(8)
    assert parts == [8] and t == pytest.approx(0.17330 + 0.0147)
    assert priced.split_in(8, 2)[1] == pytest.approx(2 * 0.08209 + 2 * 0.0147)
    # an equal split under FSDP: every rank the same count, now one micro-batch each
    infos = _infos(TimeModel(RECORDED, 8, per_micro_s=0.0147), TimeModel([(1, 0.0293), (2, 0.0557), (4, 0.0957),
                                                                         (8, 0.1710)], 8, per_micro_s=0.0147))
    plan = equal_counts(equal_plan(infos, 16), infos)
    assert [s.micro_batches for s in plan.shares] == [[8], [8]]
    # balanced with equal counts: the count k is priced with its collectives too
    assert all(len(s.micro_batches) == 1 for s in balanced_plan(infos, 16, equal_counts=True).shares)
    # where memory allows only 4, two micro-batches stay, each with its collectives in the prediction
    small = TimeModel(RECORDED[:3], 4, per_micro_s=0.0147)
    assert small.split(8) == ([4, 4], pytest.approx(2 * 0.08209 + 2 * 0.0147))
    fixed = fixed_plan(_infos(small, small), 16, [(8, 4), (8, 4)])
    assert fixed.shares[0].predicted_s == pytest.approx(2 * 0.08209 + 2 * 0.0147)


def test_the_link_is_fitted_from_two_timed_all_gathers():
    # 2 ranks: a ring all-gather sends one part per rank; 16 MiB more took 16 ms more
    latency, bw = fit_link({4096: 0.0004, 4096 + (16 << 20): 0.0164}, world=2)
    assert latency == pytest.approx(0.0004) and bw == pytest.approx((16 << 20) / 0.016)
    # 4 ranks send three parts each for the same time: three times the bandwidth
    assert fit_link({4096: 0.0004, 4096 + (16 << 20): 0.0164}, world=4)[1] == pytest.approx(3 * bw)
    # a larger buffer timed no slower: the link is too fast to see, only the latency counts
    assert fit_link({4096: 0.001, 8192: 0.0009}, world=2) == (0.001, float("inf"))
    assert collective_seconds(9, 10 << 20, 0.0004, float("inf")) == pytest.approx(0.0036)
    assert collective_seconds(9, 1e9, 0.0004, 1e9) == pytest.approx(1.0036)
    with pytest.raises(BalanceError, match="two sizes"):
        fit_link({4096: 0.001}, world=2)


def test_equal_counts_takes_the_count_whose_slowest_rank_is_fastest():
    # rank 0 pays 50 ms per micro-step whatever its size: one micro-batch of 48 is its best;
    # rank 1 runs single samples cheaply: 48 micro-batches of 1 are its best
    sizes = (1, 2, 4, 8, 16, 32, 48)
    fixed_cost = TimeModel([(b, 0.05 + 0.01 * b) for b in sizes], 48, per_micro_s=0.001)
    singles = TimeModel([(1, 0.005)] + [(b, 0.012 * b) for b in sizes[1:]], 48, per_micro_s=0.001)
    infos = _infos(fixed_cost, singles)
    alone = equal_plan(infos, 96)
    assert [s.grad_accum for s in alone.shares] == [1, 48]
    # forcing the larger count on both would cost rank 0 48 x 61 ms; one micro-batch each is best
    plan = equal_counts(alone, infos)
    assert [s.micro_batches for s in plan.shares] == [[48], [48]]
    assert max(s.predicted_s for s in plan.shares) == pytest.approx(0.576 + 0.001)
    # a rank without samples still runs the same count (dummy micro-batches)
    zero = equal_counts(fixed_plan(infos, 96, [(96, 48), (0, 1)]), infos)
    assert [len(s.micro_batches) for s in zero.shares] == [2, 2] and zero.shares[1].micro_batches == [0, 0]


def test_under_fsdp_a_slow_device_is_slow_at_the_loss_too(monkeypatch):
    """The loss is a module (`TokenLoss`) so a slow rank sleeps after its forward and after its
    backward, as after each unit's; its gradient is unchanged by the marks."""
    import torch

    from hetforge.cluster.spec import Slowdown
    from hetforge.config import DeviceSpec
    from hetforge.train.loop import TokenLoss

    slept = []
    monkeypatch.setattr("hetforge.cluster.spec.time.sleep", slept.append)
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.tensor([[0, 1, 2], [3, 4, 0]])
    TokenLoss()(logits, targets).backward()
    expected = logits.grad.clone()
    logits.grad = None
    loss_fn = TokenLoss()
    Slowdown(DeviceSpec(type="cpu", slowdown=2.0)).install_per_module([loss_fn], lambda: 0)
    loss = loss_fn(logits, targets)
    assert len(slept) == 1  # after the loss's forward
    loss.backward()
    assert len(slept) == 2  # after its backward, once the logits' gradient is made
    assert torch.equal(logits.grad, expected)


# Two CPU ranks' probes as recorded in a 2-rank FSDP run of the tiny preset at seq 256, the second
# simulated 2x slower (`bench/sharded_scale.py`, hetero part): seconds per micro-step. Per sample,
# both are fastest at a micro-batch of 8 or less and slower from 32 up (cache).
FAST = [(1, 0.0280), (2, 0.0551), (4, 0.1240), (8, 0.2531), (16, 0.5161), (32, 1.1948), (64, 4.0807), (96, 5.3584)]
SLOW = [(1, 0.0518), (2, 0.1233), (4, 0.2283), (8, 0.5015), (16, 1.2518), (32, 2.8121), (64, 5.4099), (96, 11.3794)]


def test_accumulating_unsharded_frees_the_counts_and_wins_only_when_priced_faster():
    from hetforge.cluster.balance import choose_accumulation

    def plans(per_micro_s, per_step_s):
        infos = _infos(TimeModel(FAST, 96, per_micro_s=per_micro_s), TimeModel(SLOW, 96, per_micro_s=per_micro_s))
        sharded = equal_counts(balanced_plan(infos, 96, equal_counts=True), infos)
        whole = _infos(TimeModel(FAST, 96, per_step_s=per_step_s), TimeModel(SLOW, 96, per_step_s=per_step_s))
        return sharded, balanced_plan(whole, 96)

    # the run's own link: 12 ms of collectives a micro-batch sharded, 20 ms once a step unsharded
    sharded, unsharded = plans(0.012, 0.020)
    assert len({s.grad_accum for s in sharded.shares}) == 1  # sharded: one count for both ranks
    assert unsharded.shares[0].grad_accum != unsharded.shares[1].grad_accum
    # each rank at the sizes it computes fastest, the collectives paid once
    assert unsharded.predicted_step_s < sharded.predicted_step_s
    assert all(s.predicted_s == pytest.approx(TimeModel(p, 96).cost(s.samples) + 0.020)
               for s, p in zip(unsharded.shares, (FAST, SLOW)))
    plan, why = choose_accumulation(sharded, unsharded, "auto")
    assert plan is unsharded and plan.accumulation == "unsharded" and "unsharded" in why
    assert plan.to_dict()["accumulation"] == "unsharded"
    # a step's collectives so dear that paying them once costs more than the counts save: sharded
    sharded, unsharded = plans(0.012, 1.0)
    plan, why = choose_accumulation(sharded, unsharded, "auto")
    assert plan is sharded and plan.accumulation == "sharded" and "every micro-batch" in why
    # what is configured is taken; where full weights and gradients do not fit, only sharded
    assert choose_accumulation(sharded, unsharded, "unsharded")[0] is unsharded
    assert choose_accumulation(*plans(0.012, 0.02)[:1], None, "auto")[0].accumulation == "sharded"
    with pytest.raises(BalanceError, match="cannot hold the full weights"):
        choose_accumulation(sharded, None, "unsharded")


def test_the_micro_batch_that_fits_beside_full_weights_and_gradients():
    from hetforge.cluster.probe import WORKSPACE_MARGIN, micro_batches_within

    act = 10 << 20
    # 1 GiB, 600 MiB held: (1024 - 600) MiB / (1.2 x 10 MiB) = 35 samples
    assert micro_batches_within(1 << 30, 600 << 20, act, 96) == int((424 << 20) // (WORKSPACE_MARGIN * act)) == 35
    assert micro_batches_within(1 << 30, 600 << 20, act, 16) == 16  # the probe's own limit stands
    assert micro_batches_within(1 << 30, 1020 << 20, act, 96) == 0  # not one sample: sharded only
    assert micro_batches_within(None, 1e15, act, 96) == 96  # unknown memory bounds nothing


def test_the_probe_times_a_short_step_more_often():
    from hetforge.cluster.probe import PROBE_MAX_FACTOR, PROBE_MIN_S, timed_enough

    assert not timed_enough([1.0], 2)  # never fewer than asked
    assert timed_enough([1.0, 1.0], 2)  # long steps: as asked
    short = [0.01] * 2
    assert not timed_enough(short, 2)  # 20 ms in all: time on
    while not timed_enough(short, 2):
        short.append(0.01)
    assert len(short) == PROBE_MAX_FACTOR * 2  # capped
    medium = [0.1] * 2
    while not timed_enough(medium, 2):
        medium.append(0.1)
    assert sum(medium) >= PROBE_MIN_S and len(medium) == 3



def test_the_probe_times_its_sizes_in_interleaved_rounds():
    """One step of each size a round (a warm-up round first), so that a slow spell of the machine
    lands on every size; a size stops when it has enough, and every size has `steps` at least."""
    import torch
    from torch import nn

    from hetforge.cluster.probe import time_steps
    from hetforge.cluster.spec import Slowdown

    seen = []

    class Recorder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 16)

        def forward(self, x):
            seen.append(x.shape[0])
            return self.emb(x)

    times = time_steps(Recorder(), [1, 2, 4], 8, 16, torch.device("cpu"), contextlib.nullcontext, Slowdown(None),
                       steps=3)
    assert set(times) == {1, 2, 4} and all(t > 0 for t in times.values())
    assert seen[:12] == [1, 2, 4] * 4  # warm-up round, then three timed rounds side by side
    assert all(seen.count(b) >= 4 for b in (1, 2, 4))
