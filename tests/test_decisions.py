"""Decisions on recorded inputs: memory plans, optimizer offload, batch balance, precision and the
attention kernel for cards that are not here, derived from the profiles in tests/fixtures/ (recorded
once by tests/fixtures/record.py) and compared exactly with what was decided when they were
recorded. Nothing here measures, so the result is the same on any CPU, thread count and load.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from hetforge.cluster.balance import RankInfo, TimeModel, balanced_plan, equal_plan
from hetforge.cluster.probe import largest_fitting, planned_points
from hetforge.config import MemoryConfig
from hetforge.core.hardware import lookup, run_precision, sdpa_backend
from hetforge.memory.analytic import profile_from_proxies, usable_bytes
from hetforge.memory.device_plan import plan_profile
from hetforge.memory.milp import PlanError
from hetforge.memory.plan import ModelProfile, Plan, simulate
from hetforge.model.accounting import static_bytes
from hetforge.model.gpt_neox import GPTNeoXConfig
from hetforge.model.presets import PRESETS

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CARDS = ("V100", "T4", "A100-40GB", "P100")
CLUSTER = ("A100-40GB", "V100", "V100", "T4", "P100")  # one rank each
SEQ = 2048
MICRO = (1, 2, 4, 8)
MEMORY = MemoryConfig(budget="auto", time_limit_s=120.0)


@lru_cache(maxsize=None)
def proxies() -> tuple[GPTNeoXConfig, ModelProfile, ModelProfile]:
    raw = json.loads((FIXTURES / "proxies_350m_bf16.json").read_text())
    return GPTNeoXConfig(**raw["shape"]), ModelProfile.from_dict(raw["lo"]), ModelProfile.from_dict(raw["hi"])


@lru_cache(maxsize=None)
def card_plan(card: str, micro: int, precision: str | None = None, budget: float | None = None):
    """The plan (or the PlanError) for the 350M at seq 2048 on `card`, from the recorded proxies."""
    shape, lo, hi = proxies()
    info = lookup(card)
    prof = profile_from_proxies(shape, micro, SEQ, info, lo, hi, precision=precision)
    try:
        return plan_profile(prof, shape, MEMORY, micro, usable_bytes(info) if budget is None else budget)
    except PlanError as err:
        return err


def describe(dp) -> dict:
    if isinstance(dp, Exception):
        return {"error": str(dp)}
    return {"options": dp.plan.options, "segments": dp.plan.segments, "optimizer_offload": dp.optimizer_offload,
            "peak_bytes": dp.prediction.peak_bytes, "step_s": dp.prediction.time_s, "keep_all_s": dp.keep_all.time_s}


def cluster_balance(global_batch: int = 64):
    """Every rank of CLUSTER in the run's one precision: its time model is the planned step time at
    each micro-batch that fits, as the probe prices it (keep-all time x predicted slowdown)."""
    precision, _ = run_precision([lookup(c).caps() for c in CLUSTER])
    infos = []
    for rank, card in enumerate(CLUSTER):
        plans = {b: card_plan(card, b, precision) for b in MICRO}
        sizes = [b for b in MICRO if not isinstance(plans[b], Exception)]
        limit = max(sizes)
        keep_all = {b: plans[b].keep_all.time_s for b in sizes}
        slowdown = {b: plans[b].prediction.time_s / plans[b].keep_all.time_s for b in sizes}
        infos.append(RankInfo(rank, "node", card, lookup(card).memory_gb, TimeModel(planned_points(keep_all, slowdown), limit)))
    return precision, balanced_plan(infos, global_batch), equal_plan(infos, global_batch)


def cpu_profile() -> tuple[GPTNeoXConfig, ModelProfile]:
    raw = json.loads((FIXTURES / "cpu_tiny_fp32.json").read_text())
    shape = GPTNeoXConfig(**raw["shape"])
    prof = ModelProfile.from_dict(raw["profile"])
    prof.blocks = prof.blocks * shape.n_layers
    return shape, prof


def cpu_plans() -> dict:
    shape, prof = cpu_profile()
    keep = simulate(prof, Plan(["keep"] * shape.n_layers))
    out = {}
    for frac in (1.0, 0.6, 0.35):
        budget = prof.static_bytes + prof.shared_bytes + frac * keep.activation_peak
        out[str(frac)] = describe(plan_profile(prof, shape, MemoryConfig(time_limit_s=120.0), 4, budget))
    return out


def all_decisions() -> dict:
    """Everything this file decides, as recorded in tests/fixtures/decisions.json."""
    precision, balanced, equal = cluster_balance()
    shape = proxies()[0]
    return {
        "plans": {card: {str(b): describe(card_plan(card, b)) for b in MICRO} for card in CARDS},
        "offload_on_t4_at_6gib": describe(card_plan("T4", 1, None, 6 * 2**30)),
        "cluster": {"precision": precision, "balanced": [s.samples for s in balanced.shares],
                    "micro_batches": [s.micro_batches for s in balanced.shares],
                    "balanced_step_s": balanced.predicted_step_s, "equal_step_s": equal.predicted_step_s},
        "attention": {card: {"350m": sdpa_backend(lookup(card), run_precision([lookup(card).caps()])[0], shape.head_dim),
                             "forge-s": sdpa_backend(lookup(card), run_precision([lookup(card).caps()])[0],
                                                     PRESETS["forge-s"].head_dim)} for card in CARDS},
        "cpu_tiny": cpu_plans(),
    }


@lru_cache(maxsize=None)
def recorded() -> dict:
    return json.loads((FIXTURES / "decisions.json").read_text())


@pytest.mark.parametrize("card", CARDS)
def test_plan_per_card_is_the_recorded_one(card):
    got = {str(b): describe(card_plan(card, b)) for b in MICRO}
    assert got == recorded()["plans"][card]


@pytest.mark.parametrize("card", CARDS)
def test_plans_fit_their_card_and_a_bigger_micro_batch_never_needs_less(card):
    budget = usable_bytes(lookup(card))
    fitted = [b for b in MICRO if not isinstance(card_plan(card, b), Exception)]
    assert fitted == list(MICRO[:len(fitted)])  # what fits is a prefix: memory grows with the micro-batch
    for b in fitted:
        dp = card_plan(card, b)
        assert dp.prediction.peak_bytes <= budget
        assert simulate(dp.profile, dp.plan).peak_bytes == dp.prediction.peak_bytes  # re-checked, not trusted
        assert dp.prediction.time_s >= dp.keep_all.time_s * (1 - 1e-12)  # a plan never beats keeping all


def test_offload_only_where_nothing_fits_otherwise():
    got = card_plan("T4", 1, None, 6 * 2**30)
    assert describe(got) == recorded()["offload_on_t4_at_6gib"]
    shape = proxies()[0]
    assert sum(static_bytes(shape).values()) > 6 * 2**30  # weights + gradients + Adam alone: 6.5 GB
    assert got.optimizer_offload and got.prediction.peak_bytes <= 6 * 2**30
    assert not card_plan("T4", 1).optimizer_offload  # 16 GB: the optimizer stays on the card


def test_mixed_cluster_balance_is_the_recorded_one_and_follows_the_cards():
    precision, balanced, equal = cluster_balance()
    want = recorded()["cluster"]
    assert precision == want["precision"] == "fp16"  # V100, T4 and P100 have no bf16
    assert [s.samples for s in balanced.shares] == want["balanced"]
    assert [s.micro_batches for s in balanced.shares] == want["micro_batches"]
    assert balanced.predicted_step_s == pytest.approx(want["balanced_step_s"], rel=1e-12)
    a100, v100, v100b, t4, p100 = (s.samples for s in balanced.shares)
    assert a100 > v100 >= v100b > t4 > p100  # faster cards carry more
    assert abs(v100 - v100b) <= 1 and a100 + v100 + v100b + t4 + p100 == 64
    assert balanced.predicted_step_s < equal.predicted_step_s


def test_a_memory_limited_rank_is_priced_by_its_planned_slowdown():
    """The probe's rule on recorded figures: the same measured keep-all time, one rank that needs
    a recomputing plan (slowdown > 1) gets a smaller share, by the predicted slowdown alone."""
    keep_all = {1: 0.10, 2: 0.19, 4: 0.37}
    free = TimeModel(planned_points(keep_all, {}), 4)
    short = TimeModel(planned_points(keep_all, {1: 1.2, 2: 1.25, 4: 1.3}), 4)
    plan = balanced_plan([RankInfo(0, "h", "big", None, free), RankInfo(1, "h", "small", None, short)], 16)
    assert [s.samples for s in plan.shares] == [9, 7]
    same = balanced_plan([RankInfo(0, "h", "big", None, free), RankInfo(1, "h", "big", None, free)], 16)
    assert [s.samples for s in same.shares] == [8, 8]
    assert largest_fitting(lambda b: b <= 5, 16, bisect=True) == largest_fitting(lambda b: b <= 5, 16, bisect=False) == 5


def test_attention_kernel_per_card_is_the_recorded_one():
    assert all_decisions()["attention"] == recorded()["attention"]
    assert recorded()["attention"]["A100-40GB"] == {"350m": "flash", "forge-s": "math"}


def test_cpu_profile_plans_are_the_recorded_ones():
    got = cpu_plans()
    assert got == recorded()["cpu_tiny"]
    assert set(got["1.0"]["options"]) == {"keep"} and set(got["0.35"]["options"]) != {"keep"}


def test_profiles_record_the_machine_they_were_measured_on():
    _, prof = cpu_profile()
    assert prof.meta["machine"].startswith("cpu-") and "threads=" in prof.meta["machine"]
    shape, lo, hi = proxies()
    assert lo.meta["seq_len"] * 2 == hi.meta["seq_len"] and lo.meta["precision"] == "bf16"
    assert replace(shape, vocab_size=PRESETS["350m"].vocab_size) == PRESETS["350m"]
