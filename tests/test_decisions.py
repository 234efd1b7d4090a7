"""Decisions for cards that are not here and on a recorded CPU profile, held to invariants rather
than to the numbers of one pricing: every plan fits its card, is the one the simulator prices, is no
slower than any baseline that fits on the same profile, and the balance follows the cards. Profiles
of cards come from shapes and datasheets (`memory.analytic`), the CPU's from tests/fixtures/
(recorded once by tests/fixtures/record.py), so nothing here measures: the same on any CPU, thread
count and load.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from hetforge.cluster.balance import RankInfo, TimeModel, balanced_plan, equal_plan
from hetforge.cluster.probe import largest_fitting, planned_points
from hetforge.config import MemoryConfig
from hetforge.core.hardware import lookup, run_precision, sdpa_backend
from hetforge.memory.analytic import analytic_profile, usable_bytes
from hetforge.memory.device_plan import plan_profile
from hetforge.memory.milp import PlanError, baselines
from hetforge.memory.plan import ModelProfile, Plan, simulate
from hetforge.model.accounting import static_bytes
from hetforge.model.gpt_neox import GPTNeoXConfig
from hetforge.model.presets import PRESETS

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHAPE = PRESETS["350m"]
CARDS = ("V100", "T4", "A100-40GB", "P100")
CLUSTER = ("A100-40GB", "V100", "V100", "T4", "P100")  # one rank each
SEQ = 2048
MICRO = (1, 2, 4, 8)
MEMORY = MemoryConfig(budget="auto", time_limit_s=120.0)


@lru_cache(maxsize=None)
def card_plan(card: str, micro: int, precision: str | None = None, budget: float | None = None):
    """The plan (or the PlanError) for the 350M at seq 2048 on `card`."""
    info = lookup(card)
    prof = analytic_profile(SHAPE, micro, SEQ, info, precision=precision)
    try:
        return plan_profile(prof, SHAPE, MEMORY, micro, usable_bytes(info) if budget is None else budget)
    except PlanError as err:
        return err


def assert_sound(dp, budget: float) -> None:
    """Fits, is what the simulator says of it, and no fitting baseline of its menu is faster in its
    prices. (sqrt(n)'s segments are outside the menu, and priced on the blocks' forward time alone,
    where the menu's recomputation carries the checkpoints' measured cost.)"""
    assert dp.prediction.peak_bytes <= budget
    assert simulate(dp.profile, dp.plan).peak_bytes == dp.prediction.peak_bytes  # re-checked, not trusted
    assert dp.prediction.time_s >= dp.keep_all.time_s * (1 - 1e-12)  # a plan never beats keeping all
    for name, other in baselines(dp.profile, budget, MEMORY.granularity, MEMORY.time_limit_s).items():
        if other is not None and name != "sqrt(n)":
            assert dp.prediction.time_s <= simulate(dp.profile, other).time_s * (1 + 1e-3), name


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS)
def test_plans_fit_their_card_and_a_bigger_micro_batch_never_needs_less(card):
    budget = usable_bytes(lookup(card))
    fitted = [b for b in MICRO if not isinstance(card_plan(card, b), Exception)]
    assert fitted == list(MICRO[:len(fitted)]) and fitted  # what fits is a prefix: memory grows with the micro-batch
    for b in fitted:
        dp = card_plan(card, b)
        if not dp.optimizer_offload:
            assert_sound(dp, budget)
    for b in MICRO[len(fitted):]:
        assert "smallest feasible budget" in str(card_plan(card, b)) or "weights" in str(card_plan(card, b))


def test_a_card_short_of_memory_plans_and_a_roomy_one_keeps_all():
    a100, t4 = card_plan("A100-40GB", 1), card_plan("T4", 4)
    assert set(a100.plan.options) == {"keep"}  # 40 GB hold everything at micro-batch 1
    assert t4.keep_all.peak_bytes > usable_bytes(lookup("T4")) and set(t4.plan.options) != {"keep"}
    assert t4.prediction.time_s >= t4.keep_all.time_s  # (copies overlapped with compute cost nothing)


def test_offload_only_where_nothing_fits_otherwise():
    got = card_plan("T4", 1, None, 6 * 2**30)
    assert sum(static_bytes(SHAPE).values()) > 6 * 2**30  # weights + gradients + Adam alone: 6.5 GB
    assert got.optimizer_offload and got.prediction.peak_bytes <= 6 * 2**30 and got.offload_s > 0
    assert not card_plan("T4", 1).optimizer_offload  # 16 GB: the optimizer stays on the card


def cluster_balance(global_batch: int = 64):
    """Every rank of CLUSTER in the run's one precision: its time model is the planned step time at
    each micro-batch that fits, priced as the run's plan prices it (keep-all x predicted slowdown)."""
    precision, _ = run_precision([lookup(c).caps() for c in CLUSTER])
    infos = []
    for rank, card in enumerate(CLUSTER):
        plans = {b: card_plan(card, b, precision) for b in MICRO}
        sizes = [b for b in MICRO if not isinstance(plans[b], Exception)]
        keep_all = {b: plans[b].keep_all.time_s for b in sizes}
        slowdown = {b: plans[b].prediction.time_s / plans[b].keep_all.time_s for b in sizes}
        infos.append(RankInfo(rank, "node", card, lookup(card).memory_gb,
                              TimeModel(planned_points(keep_all, slowdown), max(sizes))))
    return precision, balanced_plan(infos, global_batch), equal_plan(infos, global_batch)


@pytest.mark.slow
def test_mixed_cluster_balance_follows_the_cards():
    precision, balanced, equal = cluster_balance()
    assert precision == "fp16"  # V100, T4 and P100 have no bf16
    a100, v100, v100b, t4, p100 = (s.samples for s in balanced.shares)
    assert a100 > v100 >= v100b > t4 > p100  # faster cards carry more
    assert abs(v100 - v100b) <= 1 and a100 + v100 + v100b + t4 + p100 == 64
    assert balanced.predicted_step_s < equal.predicted_step_s
    assert all(sum(s.micro_batches) == s.samples for s in balanced.shares)


def test_a_memory_limited_rank_is_priced_by_its_planned_slowdown():
    """The same measured keep-all time, one rank that needs a recomputing plan (slowdown > 1) gets a
    smaller share, by the predicted slowdown alone."""
    keep_all = {1: 0.10, 2: 0.19, 4: 0.37}
    free = TimeModel(planned_points(keep_all, {}), 4)
    short = TimeModel(planned_points(keep_all, {1: 1.2, 2: 1.25, 4: 1.3}), 4)
    plan = balanced_plan([RankInfo(0, "h", "big", None, free), RankInfo(1, "h", "small", None, short)], 16)
    assert [s.samples for s in plan.shares] == [9, 7]
    same = balanced_plan([RankInfo(0, "h", "big", None, free), RankInfo(1, "h", "big", None, free)], 16)
    assert [s.samples for s in same.shares] == [8, 8]
    assert largest_fitting(lambda b: b <= 5, 16, bisect=True) == largest_fitting(lambda b: b <= 5, 16, bisect=False) == 5


def test_attention_kernel_per_card():
    kernels = {card: (sdpa_backend(lookup(card), run_precision([lookup(card).caps()])[0], SHAPE.head_dim),
                      sdpa_backend(lookup(card), run_precision([lookup(card).caps()])[0], PRESETS["forge-s"].head_dim))
               for card in CARDS}
    assert kernels == {"V100": ("mem-efficient", "math"), "T4": ("mem-efficient", "math"),
                       "A100-40GB": ("flash", "math"), "P100": ("mem-efficient", "math")}


def cpu_profile() -> tuple[GPTNeoXConfig, ModelProfile]:
    raw = json.loads((FIXTURES / "cpu_tiny_fp32.json").read_text())
    shape = GPTNeoXConfig(**raw["shape"])
    prof = ModelProfile.from_dict(raw["profile"])
    prof.blocks = prof.blocks * shape.n_layers
    return shape, prof


@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.35])
def test_cpu_profile_plans_fit_and_beat_the_baselines(fraction):
    shape, prof = cpu_profile()
    keep = simulate(prof, Plan(["keep"] * shape.n_layers))
    budget = prof.static_bytes + prof.shared_bytes + fraction * keep.activation_peak
    dp = plan_profile(prof, shape, MemoryConfig(time_limit_s=120.0), 4, budget)
    assert_sound(dp, budget)
    assert (set(dp.plan.options) == {"keep"}) == (fraction == 1.0)


def test_profiles_record_the_machine_they_were_measured_on():
    _, prof = cpu_profile()
    assert prof.meta["machine"].startswith("cpu-") and "threads=" in prof.meta["machine"]
    card = analytic_profile(SHAPE, 1, SEQ, lookup("V100"))
    assert card.meta["analytic"] and card.meta["card"] == "V100" and card.meta["precision"] == "fp16"
