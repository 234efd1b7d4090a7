"""The planner against enumeration and its own invariants, on synthetic profiles (no torch)."""

import copy
import math
import itertools
import random

import pytest

from hetforge.memory.milp import PlanError, TensorMenu, baselines, brute_force, menu_for, minimum_budget, solve
from hetforge.memory.plan import (MENUS, OPTIONS, BlockProfile, BranchPlan, Decision, ModelProfile, Plan, Unit,
                                  simulate)

MB = 2.0**20


def synthetic_block(rng: random.Random, units_per_branch: int = 2) -> BlockProfile:
    """Random but physically shaped: each branch saves some units (keep or offload them) and has as
    many op units (cache or recompute them); recomputing a whole branch lowers its own peaks, and a
    checkpoint costs a fixed overhead, a selective one more. Each branch's last saved unit can be
    rebuilt from the block input, for a tenth of its op's time, freeing 90% of its bytes."""
    a = rng.uniform(1, 4) * MB
    units = [Unit("x", "input", a, a, users=("attn", "mlp"))]
    fwd = 0.0
    full = a
    recompute = {}
    for br in ("attn", "mlp"):
        ops = 0.0
        for k in range(units_per_branch):
            s = rng.uniform(2, 10) * MB
            host = s * rng.uniform(0.7, 1.0)
            t = rng.uniform(0.2, 2) * 1e-3
            if k == units_per_branch - 1:
                units.append(Unit(f"{br}.s{k}", "saved", s, host, time_s=0.1 * t, rebuild_from="x", rebuild_bytes=0.9 * s))
            else:
                units.append(Unit(f"{br}.s{k}", "saved", s, host))
            units.append(Unit(f"{br}.o{k}", "op", s * rng.uniform(0.8, 1.5), time_s=t))
            full += s
            fwd += t
            ops += t
        over = rng.uniform(0.05, 0.3) * 1e-3
        recompute[br] = {"plain": ops + over, "sac": ops + 2 * over, "sac_all": 2 * over}
    peaks = {}
    for am in ("keep", "recompute"):
        for mm in ("keep", "recompute"):
            cut = (0.3 if am == "recompute" else 0.0) + (0.4 if mm == "recompute" else 0.0)
            peaks[f"{am}/{mm}"] = [full * (1 - cut) + a, full * (1 - cut) + 2 * a]
    # both branches recomputed, measured as a whole: below the sum of the two, or above it
    recompute["both"] = {"plain": (recompute["attn"]["plain"] + recompute["mlp"]["plain"]) * rng.uniform(0.7, 1.1)}
    return BlockProfile(fwd, 2 * fwd, a, units, peaks, recompute=recompute)


def synthetic(n: int, seed: int, link_mb_s: float = 2000.0, units_per_branch: int = 2) -> ModelProfile:
    rng = random.Random(seed)
    blocks = [synthetic_block(rng, units_per_branch) for _ in range(n)]
    return ModelProfile(blocks, {"weights": 20 * MB, "gradients": 20 * MB, "optimizer state": 40 * MB},
                        1e-3, 2e-3, 10 * MB, 20 * MB, link_mb_s * MB)


def budget_between(prof: ModelProfile, menu, frac: float) -> float:
    n = len(prof.blocks)
    keep = simulate(prof, Plan(["keep"] * n)).peak_bytes
    lo = minimum_budget(prof, menu)
    return lo + frac * (keep - lo)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("frac", [0.95, 0.6, 0.3])
def test_block_milp_equals_brute_force(seed, frac):
    n = 10 if seed == 0 else 8
    prof = synthetic(n, seed, link_mb_s=[500.0, 3000.0, 20000.0][seed])
    menu = MENUS["block"]
    budget = budget_between(prof, menu, frac)
    best = brute_force(prof, budget, menu)
    plan = solve(prof, budget, menu, gap=0.0)
    pred = simulate(prof, plan)
    assert pred.peak_bytes <= budget * (1 + 1e-9)
    assert best is not None
    assert pred.time_s == pytest.approx(best[0], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("inflight", [2, 4])
@pytest.mark.parametrize("frac", [0.8, 0.3])
def test_milp_with_micro_batches_in_flight_equals_brute_force(inflight, frac):
    """A pipeline stage holding several micro-batches' activations (1F1B): every row carries the
    others' held bytes, `inflight - 1` times the plan's; the MILP's plan fits and is as fast as
    the best enumerated; the smallest budget reported is a real plan's peak, within 2% of the least."""
    prof = synthetic(6, 7)
    keep = simulate(prof, Plan(["keep"] * 6))
    one = copy.deepcopy(prof)
    prof.inflight = inflight
    held = simulate(one, Plan(["keep"] * 6)).held_bytes
    assert simulate(prof, Plan(["keep"] * 6)).peak_bytes == pytest.approx(keep.peak_bytes + (inflight - 1) * held)
    menu = MENUS["block"]
    lowest = minimum_budget(prof, menu)
    true_lowest = min(simulate(prof, Plan(list(c))).peak_bytes for c in itertools.product(menu, repeat=6))
    assert lowest > minimum_budget(one, menu)
    assert brute_force(prof, lowest * (1 + 1e-9), menu) is not None  # a plan reaches it
    assert true_lowest <= lowest <= 1.02 * true_lowest  # the grids' figure: near the least, not below it
    solved_like_brute_force(prof, menu, frac)
    # between the least peak and what the grids found, the solver still finds the plan
    if lowest > true_lowest * (1 + 1e-6):
        budget = (true_lowest + lowest) / 2
        plan = solve(prof, budget, menu, gap=0.0)
        assert simulate(prof, plan).peak_bytes <= budget


def solved_like_brute_force(prof: ModelProfile, menu, frac: float) -> Plan:
    """The MILP's plan at `frac` of the way from the minimum to keep-all, checked: within the budget
    and as fast as the best plan enumeration finds."""
    budget = budget_between(prof, menu, frac)
    best = brute_force(prof, budget, menu)
    plan = solve(prof, budget, menu, gap=0.0)
    pred = simulate(prof, plan)
    assert best is not None and pred.peak_bytes <= budget * (1 + 1e-9)
    assert pred.time_s == pytest.approx(best[0], rel=1e-6, abs=1e-9)
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("frac", [0.8, 0.4, 0.1])
def test_tensor_milp_equals_brute_force(seed, frac, overlap):
    """Every decision of every unit of a 2-block chain (a few thousand plans), with copies beside
    compute (a GPU) and on the compute's own time (the CPU)."""
    prof = synthetic(2, seed, link_mb_s=[800.0, 5000.0][seed - 3], units_per_branch=2)
    prof.overlap = overlap
    menu = TensorMenu()
    assert len(menu.decisions(prof.blocks[0])) > 50
    solved_like_brute_force(prof, menu, frac)


def compiled_profile(n: int, seed: int, link_mb_s: float) -> ModelProfile:
    """A compiled run's profile: per branch three compile budgets, each saving a share of the
    branch's units for a price below the branch's plain recomputation, and a price for running the
    branch eager (to offload or rebuild a unit); per block a price for running under the
    saved-tensor hooks (anything offloaded or rebuilt, the block input included)."""
    prof = synthetic(n, seed, link_mb_s, units_per_branch=1)
    rng = random.Random(seed + 100)
    for blk in prof.blocks:
        blk.recompute["block"] = {"hooks": rng.uniform(0.1, 0.4) * blk.recompute["mlp"]["plain"]}
        for br in ("attn", "mlp"):
            saved = sum(u.bytes for u in blk.of("saved", br))
            plain = blk.recompute[br]["plain"]
            blk.recompute[br]["eager"] = rng.uniform(0.1, 0.6) * plain
            blk.compiled[br] = {f"{b:g}": {"held": saved * share, "time_s": plain * cost}
                                for b, share, cost in ((0.7, rng.uniform(0.5, 0.8), rng.uniform(0.0, 0.1)),
                                                       (0.5, rng.uniform(0.3, 0.5), rng.uniform(0.2, 0.5)),
                                                       (0.0, 0.01, rng.uniform(0.5, 0.9)))}
    return prof


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("frac", [0.8, 0.5, 0.2])
def test_milp_with_compile_budgets_equals_brute_force(frac, overlap):
    """A compiled profile's menu: each kept branch may instead run at one of its compile budgets
    (no unit offloaded or rebuilt then), and one that offloads or rebuilds pays for running eager."""
    prof = compiled_profile(2, 8, link_mb_s=[1500.0, 6000.0][overlap])
    prof.overlap = overlap
    menu = TensorMenu()
    options = menu.decisions(prof.blocks[0])
    assert any("@0.5" in o for o in options) and not any("@" in o for o in TensorMenu().decisions(synthetic(1, 8).blocks[0]))
    plan = solved_like_brute_force(prof, menu, frac)
    if frac == 0.8:  # the budgets are the cheap way down here: the plan uses one
        assert any("@" in o for o in plan.options)


def test_a_compile_budget_costs_what_was_measured_and_reads_back():
    blk = compiled_profile(1, 9, 2000.0).blocks[0]
    d = Decision(BranchPlan("keep", budget=0.5), BranchPlan("keep"))
    text = d.encode()
    assert text.startswith("attn:keep@0.5 | mlp:keep") and Decision.parse(text) == d
    keep, at = blk.cost("keep"), blk.cost(text)
    attn_saved = sum(u.bytes for u in blk.of("saved", "attn"))
    assert at.held == pytest.approx(keep.held - attn_saved + blk.compiled["attn"]["0.5"]["held"])
    assert at.recompute_s == pytest.approx(blk.compiled["attn"]["0.5"]["time_s"])
    # offloading a unit runs the kept branch eager in a compiled run, under the saved-tensor hooks
    off = Decision(BranchPlan("keep", frozenset({"attn.s0"})), BranchPlan("keep")).encode()
    assert blk.hooks_s > 0 and blk.cost(off).recompute_s == pytest.approx(blk.eager_s("attn") + blk.hooks_s)
    both = Decision(BranchPlan("keep", frozenset({"attn.s0"})), BranchPlan("keep", frozenset({"mlp.s0"})),
                    frozenset({"x"})).encode()
    assert blk.cost(both).recompute_s == pytest.approx(blk.eager_s("attn") + blk.eager_s("mlp") + blk.hooks_s)
    # the block input alone: the hooks, and no branch runs eager
    assert blk.cost("attn:keep | mlp:keep | offload[x]").recompute_s == pytest.approx(blk.hooks_s)
    for bad in ("attn:recompute@0.5 | mlp:keep", "attn:keep@0.5-offload[s0] | mlp:keep", "attn:keep@1.5 | mlp:keep"):
        with pytest.raises(ValueError, match="compile budget"):
            Decision.parse(bad)
    with pytest.raises(ValueError, match="no measurement"):
        blk.cost("attn:keep@0.3 | mlp:keep")


def test_a_block_recomputing_both_branches_costs_what_the_pair_measured():
    """The pair's measured price replaces the sum of the branches' where both are recomputed by
    plain checkpoints; one branch alone, or a selective one beside, keeps the branches' own."""
    blk = synthetic_block(random.Random(7))
    plain = {br: blk.recompute[br]["plain"] for br in ("attn", "mlp")}
    blk.recompute["both"] = {"plain": 0.8 * (plain["attn"] + plain["mlp"])}
    assert blk.cost("recompute").recompute_s == pytest.approx(blk.recompute["both"]["plain"])
    assert blk.cost("recompute-mlp").recompute_s == pytest.approx(plain["mlp"])
    assert blk.cost("recompute-attn").recompute_s == pytest.approx(plain["attn"])
    one_cached = Decision(BranchPlan("recompute", frozenset({"attn.o0"})), BranchPlan("recompute")).encode()
    sac_attn = blk.recompute["attn"]["sac_all"] + sum(u.time_s for u in blk.of("op", "attn") if u.name != "attn.o0")
    assert blk.cost(one_cached).recompute_s == pytest.approx(sac_attn + plain["mlp"])  # measured plain only
    assert blk.both_extra_s == pytest.approx(-0.2 * (plain["attn"] + plain["mlp"]))
    del blk.recompute["both"]
    blk._costs.clear()
    assert blk.both_extra_s == 0.0 and blk.cost("recompute").recompute_s == pytest.approx(sum(plain.values()))


def test_the_cpu_link_is_the_rate_of_the_copies_the_model_made():
    """Everything offloaded pays every byte out in the forward and back in the backward: the rate is
    twice those bytes over the time the copies added; unmeasured, or lost in the noise, there is none
    (the profile then times a copy alone)."""
    blk = synthetic_block(random.Random(3))
    moved = sum(u.host_bytes for u in blk.units if u.kind in ("saved", "input"))
    assert blk.cost("offload").host == pytest.approx(moved)
    assert blk.copy_rate() is None
    blk.recompute["block"] = {"hooks": 1e-4, "copy": 2e-3}
    assert blk.copy_rate() == pytest.approx(2 * moved / 2e-3)
    for lost in (0.0, -1e-4):
        blk.recompute["block"]["copy"] = lost
        assert blk.copy_rate() is None


@pytest.mark.parametrize("overlap", [True, False])
def test_minimum_budget_is_the_brute_force_minimum(overlap):
    prof = synthetic(7, 5)
    prof.overlap = overlap
    true_min = min(simulate(prof, Plan(list(c))).peak_bytes for c in itertools.product(MENUS["block"], repeat=7))
    assert minimum_budget(prof, MENUS["block"]) == pytest.approx(true_min, rel=1e-6)
    tiny = synthetic(2, 6, units_per_branch=1)
    tiny.overlap = overlap
    menu = TensorMenu()
    options = menu.decisions(tiny.blocks[0])
    true_min = min(simulate(tiny, Plan(list(c))).peak_bytes for c in itertools.product(options, repeat=2))
    assert minimum_budget(tiny, menu) == pytest.approx(true_min, rel=1e-6)


@pytest.mark.slow
def test_monotonic_and_keep_all_and_baselines_never_faster():
    prof = synthetic(12, 3)
    keep = simulate(prof, Plan(["keep"] * 12))
    lo = minimum_budget(prof, TensorMenu())
    assert solve(prof, keep.peak_bytes, TensorMenu(), gap=0.0).options == ["keep"] * 12
    last = None
    for frac in [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]:
        budget = lo + frac * (keep.peak_bytes - lo)
        t = simulate(prof, solve(prof, budget, TensorMenu(), gap=0.0)).time_s
        if last is not None:
            assert t >= last - 1e-12  # a smaller budget is never faster
        last = t
        for name, p in baselines(prof, budget, "tensor").items():
            if p is not None:
                assert simulate(prof, p).time_s >= t - 1e-12, name
        # a finer menu contains the coarser ones, so it is never slower
        for g in ("block", "sublayer"):
            try:
                coarse = simulate(prof, solve(prof, budget, menu_for(g), gap=0.0)).time_s
            except PlanError:
                continue
            assert coarse >= t - 1e-12, g


def test_infeasible_budget_names_the_minimum():
    prof = synthetic(6, 4)
    lo = minimum_budget(prof, TensorMenu())
    with pytest.raises(PlanError, match="smallest feasible budget") as e:
        solve(prof, lo * 0.98, TensorMenu())
    assert f"{math.ceil(lo)} bytes" in str(e.value)
    assert solve(prof, lo * 1.0001, TensorMenu()) is not None
    with pytest.raises(PlanError, match="weights \\+ gradients \\+ optimizer state"):
        solve(prof, prof.static_bytes * 0.5, TensorMenu())


def test_sqrt_segments_hold_less_than_keep_all():
    prof = synthetic(9, 6)
    keep = simulate(prof, Plan(["keep"] * 9))
    sq = simulate(prof, Plan(["keep"] * 9, segments=[(0, 3), (3, 6), (6, 9)]))
    assert sq.held_bytes == pytest.approx(sum(prof.blocks[i].input_bytes for i in (0, 3, 6)))
    assert sq.held_bytes < keep.held_bytes
    assert sq.time_s > keep.time_s


def test_decisions_encode_and_name():
    blk = synthetic(1, 7).blocks[0]
    d = Decision(BranchPlan("keep", frozenset({"attn.s1"})), BranchPlan("recompute", frozenset({"mlp.o0"})),
                 frozenset({"x"}))
    text = d.encode()
    assert text == "attn:keep-offload[s1] | mlp:recompute-cache[o0] | offload[x]"
    assert Decision.parse(text) == d
    made = Decision(BranchPlan("keep", frozenset({"attn.s0"}), frozenset({"attn.s1"})), BranchPlan("recompute"))
    assert made.encode() == "attn:keep-offload[s0]-rebuild[s1] | mlp:recompute"
    assert Decision.parse(made.encode()) == made
    with pytest.raises(ValueError, match="only a kept branch"):
        Decision.parse("attn:recompute-rebuild[s1] | mlp:keep")
    # rebuilding holds what the op does not make and pays the op again; a unit that cannot be
    # rebuilt (no price) is held as kept
    s1, keep = next(u for u in blk.units if u.name == "attn.s1"), blk.cost("keep")
    c = blk.cost(Decision(BranchPlan("keep", frozenset(), frozenset({"attn.s1", "attn.s0"})), BranchPlan("keep")).encode())
    assert c.held == pytest.approx(keep.held - s1.rebuild_bytes) and c.recompute_s == pytest.approx(s1.time_s)
    assert c.host == 0 and (c.fwd_peak, c.bwd_peak) == (keep.fwd_peak, keep.bwd_peak)
    # a named option written out unit by unit is recognised as that option
    every = frozenset(u.name for u in blk.of("saved", "mlp"))
    assert blk.name(Decision(BranchPlan("keep"), BranchPlan("keep", every))) == "offload-mlp"
    assert blk.name(blk.decision("offload")) == "offload"
    for o in OPTIONS:
        assert blk.cost(blk.name(blk.decision(o))) == blk.cost(o)
    # keep-all holds every unit; offloading everything holds none and moves it all
    assert blk.cost("keep").held == pytest.approx(sum(u.bytes for u in blk.units if u.kind != "op"))
    off = blk.cost("offload")
    assert off.held == 0 and off.host == pytest.approx(sum(u.host_bytes for u in blk.units if u.kind != "op"))
    with pytest.raises(ValueError, match="cannot read"):
        blk.cost("attn:sometimes | mlp:keep")


@pytest.mark.slow
def test_tensor_solve_scales_to_deep_models():
    """FORGE-l depth (48 blocks) and twice that, at the tightest and a middle budget."""
    base = synthetic(1, 8, link_mb_s=300.0, units_per_branch=4)
    for n in (48, 96):
        prof = copy.copy(base)
        prof.blocks = base.blocks * n
        for frac in (0.5, 0.05):
            plan = solve(prof, budget_between(prof, TensorMenu(), frac), TensorMenu(), time_limit_s=60, gap=0.01)
            assert plan.solve["gap"] <= 0.01
            assert plan.solve["seconds"] < 60


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(60))
def test_answers_are_checked_the_minimum_passes_back_and_keep_all_is_exact(seed):
    """The planner's answers hold under the simulator: the minimum it names (exact, and as printed,
    rounded up) is accepted when passed back; no plan it returns is over the budget, not even by
    rounding; keep-all is chosen exactly when it fits (a byte below its peak it is not)."""
    prof = synthetic(2 + seed % 5, 100 + seed, units_per_branch=1 + seed % 2)
    prof.overlap = bool(seed % 2)
    menu = TensorMenu() if seed % 3 else menu_for("sublayer")
    n = len(prof.blocks)
    lo = minimum_budget(prof, menu)
    keep = simulate(prof, Plan(["keep"] * n)).peak_bytes
    for budget in (lo, float(math.ceil(lo)), lo + 0.37 * (keep - lo), keep - 1.0, keep - 1e-3, keep, keep + 1.0):
        plan = solve(prof, budget, menu, time_limit_s=5)
        assert simulate(prof, plan).peak_bytes <= budget, budget
        assert (plan.options == ["keep"] * n) == (budget >= keep), budget
    with pytest.raises(PlanError):
        solve(prof, lo - max(1.0, 1e-6 * lo), menu, time_limit_s=5)


def test_a_compiled_run_plans_without_rebuilding():
    """`memory.rebuild: auto` offers rebuilding only where the blocks run eager: a branch that
    rebuilds runs eager, a price the eager profile does not show. The menu without it never
    rebuilds, and where rebuilding is cheap the menu with it is faster."""
    from hetforge.config import MemoryConfig
    from hetforge.memory.device_plan import rebuild_units
    from hetforge.memory.milp import plan_for_strategy

    assert rebuild_units(MemoryConfig(), compiled=False) and not rebuild_units(MemoryConfig(), compiled=True)
    assert rebuild_units(MemoryConfig(rebuild="on"), compiled=True)
    assert not rebuild_units(MemoryConfig(rebuild=False), compiled=False)  # YAML's bare off
    prof = synthetic(6, 11)
    budget = budget_between(prof, TensorMenu(), 0.5)
    with_ = plan_for_strategy(prof, budget, "milp", "tensor", rebuild=True)
    without = plan_for_strategy(prof, budget, "milp", "tensor", rebuild=False)
    assert any("rebuild[" in o for o in with_.options)
    assert not any("rebuild[" in o for o in without.options)
    assert simulate(prof, with_).time_s < simulate(prof, without).time_s


@pytest.mark.parametrize("drift", [0.0, 0.004, -0.003])
def test_a_price_is_its_option_against_the_base_runs_beside_it(drift):
    """The profile prices an option by its time less the mean of the base runs just before and just
    after it, each run warmed up by one of its own: on a machine whose step time drifts linearly (a
    synthetic clock, no timing), every round's price is the option's own extra time exactly, in
    every shuffled order; priced against the round's one base run instead, the drift times the runs
    between them would be added."""
    from hetforge.memory.profile import sandwiched

    cost = {"keep": 0.0, "a": 0.003, "b": 0.011, "c": -0.002, "d": 0.0}
    ran: list[str] = []

    def run(k: str) -> float:
        ran.append(k)
        return 0.050 + drift * len(ran) + cost[k]  # the machine slows (or speeds up) by `drift` a run

    rounds: list[int] = []
    got = sandwiched(run, ["a", "b", "c", "d"], "keep", lambda r: r < 6, rounds.append)
    assert rounds == list(range(6))
    for k, v in got.items():
        assert len(v) == 5  # the first round warms up
        assert v == pytest.approx([cost[k]] * 5, abs=1e-12)
    # every option sits between two base runs, each timed run after an untimed one of its own, and
    # the order changes between rounds
    per_round = [ran[i * 18:(i + 1) * 18] for i in range(6)]
    assert all(r[0::4] == ["keep"] * 5 and r[1::4] == ["keep"] * 5 for r in per_round)
    assert all(r[2::4] == r[3::4] for r in per_round)
    assert len({tuple(r[2::4]) for r in per_round}) > 1
