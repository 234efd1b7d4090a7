"""The planner against enumeration and its own invariants, on synthetic profiles (no torch)."""

import random

import pytest

from hetforge.memory.milp import PlanError, baselines, brute_force, minimum_budget, solve
from hetforge.memory.plan import MENUS, BlockProfile, ModelProfile, OptionCost, Plan, simulate

MB = 2.0**20


def synthetic(n: int, seed: int, link_mb_s: float = 2000.0) -> ModelProfile:
    """Random but physically shaped blocks: keep holds S, recompute holds the input and costs the
    forward, offload holds nothing and moves S over the link."""
    rng = random.Random(seed)
    blocks = []
    for _ in range(n):
        a = rng.uniform(1, 4) * MB
        s_attn, s_mlp = rng.uniform(2, 8) * MB, rng.uniform(4, 12) * MB
        f_attn, f_mlp = rng.uniform(0.5, 2) * 1e-3, rng.uniform(0.5, 3) * 1e-3
        fwd, bwd = f_attn + f_mlp, 2 * (f_attn + f_mlp)
        full = a + s_attn + s_mlp
        opts = {}
        for name in MENUS["sublayer"]:
            from hetforge.memory.plan import OPTIONS

            am, mm = OPTIONS[name]
            held = (a if "offload" != am or "offload" != mm else 0.0)
            held += (s_attn if am == "keep" else 0.0) + (s_mlp if mm == "keep" else 0.0)
            host = (s_attn if am == "offload" else 0.0) + (s_mlp if mm == "offload" else 0.0)
            host += a if am == mm == "offload" else 0.0
            rec = (f_attn if am == "recompute" else 0.0) + (f_mlp if mm == "recompute" else 0.0)
            opts[name] = OptionCost(held, host, full + a, full + 2 * a, rec)
        blocks.append(BlockProfile(fwd, bwd, a, opts))
    return ModelProfile(blocks, {"weights": 20 * MB, "gradients": 20 * MB, "optimizer state": 40 * MB},
                        1e-3, 2e-3, 10 * MB, 20 * MB, link_mb_s * MB)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("frac", [0.95, 0.6, 0.3])
def test_milp_equals_brute_force(seed, frac):
    n = 10 if seed == 0 else 8
    prof = synthetic(n, seed, link_mb_s=[500.0, 3000.0, 20000.0][seed])
    keep = simulate(prof, Plan(["keep"] * n)).peak_bytes
    lo = minimum_budget(prof, MENUS["block"])
    budget = lo + frac * (keep - lo)
    best = brute_force(prof, budget, MENUS["block"])
    plan = solve(prof, budget, MENUS["block"], gap=0.0)
    pred = simulate(prof, plan)
    assert pred.peak_bytes <= budget * (1 + 1e-9)
    assert best is not None
    assert pred.time_s == pytest.approx(best[0], rel=1e-6, abs=1e-9)


def test_minimum_budget_is_the_brute_force_minimum():
    prof = synthetic(7, 5)
    import itertools

    true_min = min(simulate(prof, Plan(list(c))).peak_bytes for c in itertools.product(MENUS["block"], repeat=7))
    assert minimum_budget(prof, MENUS["block"]) == pytest.approx(true_min, rel=1e-6)


def test_monotonic_and_keep_all_and_recompute_only_never_faster():
    prof = synthetic(12, 3)
    keep = simulate(prof, Plan(["keep"] * 12))
    lo = minimum_budget(prof, MENUS["sublayer"])
    assert solve(prof, keep.peak_bytes).options == ["keep"] * 12
    last = None
    for frac in [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]:
        budget = lo + frac * (keep.peak_bytes - lo)
        t = simulate(prof, solve(prof, budget, gap=0.0)).time_s
        if last is not None:
            assert t >= last - 1e-12  # smaller budget never faster
        last = t
        base = baselines(prof, budget)
        for name, p in base.items():
            if p is not None:
                assert simulate(prof, p).time_s >= t - 1e-12, name


def test_infeasible_budget_names_the_minimum():
    prof = synthetic(6, 4)
    lo = minimum_budget(prof, MENUS["sublayer"])
    with pytest.raises(PlanError, match="smallest feasible budget") as e:
        solve(prof, lo * 0.98)
    assert f"{lo:.0f} bytes" in str(e.value)
    assert solve(prof, lo * 1.0001) is not None
    with pytest.raises(PlanError, match="weights \\+ gradients \\+ optimizer state"):
        solve(prof, prof.static_bytes * 0.5)


def test_sqrt_segments_hold_less_than_keep_all():
    prof = synthetic(9, 6)
    keep = simulate(prof, Plan(["keep"] * 9))
    sq = simulate(prof, Plan(["keep"] * 9, segments=[(0, 3), (3, 6), (6, 9)]))
    assert sq.held_bytes == pytest.approx(sum(prof.blocks[i].input_bytes for i in (0, 3, 6)))
    assert sq.held_bytes < keep.held_bytes
    assert sq.time_s > keep.time_s
