"""The smallest feasible budget of a chain, exactly, by dynamic programming.

Minimising the peak is a min-max problem on which branch and bound is slow (its LP relaxation is
weak, and identical blocks make it symmetric): HiGHS leaves a 10% gap after 30 s at 48 blocks. The
chain structure gives an exact answer instead. Every stage row of `plan.simulate` has the form

    static + P_k + host_{k-1} + own_k        (P_k = bytes held by blocks before k)

(without overlapped copies, host_{k-1} only in the backward rows)
so for a candidate bound B, whether some plan keeps every row within B is a forward pass whose
state is the previous block's host bytes: for each state, the least P_k that reaches it. Bisection
on B, then the plan at the smallest feasible B is rebuilt and simulated, so the figure returned is
a real plan's peak.
"""

from __future__ import annotations

import numpy as np

from hetforge.memory.plan import BlockProfile, ModelProfile, Plan, simulate


def _options(blk: BlockProfile, menu) -> tuple[list[str], np.ndarray]:
    """The menu's options of one block, less those another beats on held, host and both own peaks."""
    names = list(menu.decisions(blk) if hasattr(menu, "decisions") else menu)
    costs = np.array([[c.held, c.host, c.fwd_peak, c.bwd_peak] for c in map(blk.cost, names)])
    keep = []
    order = np.lexsort(costs.T[::-1])
    for i in order:
        if not any(np.all(costs[j] <= costs[i]) for j in keep):
            keep.append(i)
    return [names[i] for i in keep], costs[keep]


def _feasible(menus: list[tuple[list[str], np.ndarray]], head: float, bound: float,
              overlap: bool = True) -> list[str] | None:
    """A plan whose every row is within `bound` (bytes above static), or None. Without overlap the
    previous block's copy is on the device only in the backward rows (see `plan.simulate`)."""
    hosts = np.array([0.0])  # the previous block's host bytes, one per state
    held = np.array([0.0])  # the least bytes held by earlier blocks reaching that state
    back = []
    for names, c in menus:
        fwd = c[None, :, 2] + (hosts[:, None] if overlap else 0.0)
        total = held[:, None] + np.maximum(fwd, hosts[:, None] + c[None, :, 3])  # states x options
        ok = total <= bound
        cand = np.where(ok, held[:, None] + c[None, :, 0], np.inf)
        best_state = cand.argmin(axis=0)
        best = cand[best_state, np.arange(len(names))]
        new_hosts = np.unique(c[:, 1])
        new_held = np.full(len(new_hosts), np.inf)
        pick = np.full(len(new_hosts), -1)
        slot = np.searchsorted(new_hosts, c[:, 1])
        for j in np.argsort(best):
            if np.isfinite(best[j]) and best[j] < new_held[slot[j]]:
                new_held[slot[j]], pick[slot[j]] = best[j], j
        live = np.isfinite(new_held)
        if not live.any():
            return None
        back.append((pick[live], best_state, names))
        hosts, held = new_hosts[live], new_held[live]
    final = held + (hosts if overlap else 0.0) + head
    if final.min() > bound:
        return None
    state = int(final.argmin())
    plan = []
    for pick, best_state, names in reversed(back):
        j = int(pick[state])
        plan.append(names[j])
        state = int(best_state[j])
    return plan[::-1]


def _menus(profile: ModelProfile, menu) -> list[tuple[list[str], np.ndarray]]:
    cache: dict[int, tuple[list[str], np.ndarray]] = {}
    return [cache[id(b)] if id(b) in cache else cache.setdefault(id(b), _options(b, menu)) for b in profile.blocks]


def feasible_plan(profile: ModelProfile, menu, budget: float) -> Plan | None:
    """Some plan whose peak, as `plan.simulate` computes it, is within `budget` (the one holding
    least), or None if none is.

    The chain search adds the same bytes in another order than the simulator, so the two can
    differ in the last bits: the search runs with a hair of slack (a plan at exactly the minimum
    must be found when that minimum is passed back) and its answer is then simulated; one over
    the budget by rounding sends the search again with the bound lowered by the excess."""
    menus = _menus(profile, menu)
    bound = budget - profile.base_bytes
    slack = 1e-9 * max(abs(budget), 1.0)
    if profile.inflight > 1:
        peak, plan = _inflight_minimum(profile, menus)
        return plan if peak <= budget else None
    for _ in range(4):
        names = _feasible(menus, profile.head_peak, bound + slack, profile.overlap)
        if names is None:
            return None
        plan = Plan(names, "feasible")
        excess = simulate(profile, plan).peak_bytes - budget
        if excess <= 0:
            return plan
        bound -= excess + slack
    return None


def _inflight_minimum(profile: ModelProfile, menus, samples: int = 48) -> tuple[float, Plan]:
    """With k micro-batches in flight every row carries (k - 1) x the plan's total held bytes H, so
    the bound is no longer one pass: the least peak is min over row bounds b of b + (k - 1) x H(b),
    H(b) the least total any plan within rows b holds (what the pass finds). H is a step function
    of b, so the minimum sits just above one of its steps: a grid over b, then a finer one around
    the best; each plan found is simulated, so what is returned is a real plan's peak."""
    keep = Plan(["keep"] * len(profile.blocks))
    best: tuple[float, Plan] = (simulate(profile, keep).peak_bytes, keep)
    hi = best[0] - profile.base_bytes
    lo = max([profile.head_peak] + [float(c[:, 2:].max(axis=1).min()) for _, c in menus]) - 1.0
    for _ in range(2):
        step = (hi - lo) / samples
        at = lo
        for i in range(samples + 1):
            b = lo + i * step
            names = _feasible(menus, profile.head_peak, b, profile.overlap)
            if names is not None:
                plan = Plan(names, "feasible")
                peak = simulate(profile, plan).peak_bytes
                if peak < best[0]:
                    best, at = (peak, plan), b
        lo, hi = max(lo, at - step), at + step
    return best


def minimum_peak(profile: ModelProfile, menu) -> tuple[float, Plan]:
    """The smallest peak any plan on `menu` reaches, and that plan (with several micro-batches in
    flight, `_inflight_minimum`'s: as low as its grids find)."""
    if profile.inflight > 1:
        peak, plan = _inflight_minimum(profile, _menus(profile, menu))
        return peak, Plan(plan.options, "min-memory")
    menus = _menus(profile, menu)
    n = len(profile.blocks)
    hi = simulate(profile, Plan(["keep"] * n)).peak_bytes - profile.base_bytes
    lo = max([profile.head_peak] + [float(c[:, 2:].max(axis=1).min()) for _, c in menus]) - 1.0
    best = _feasible(menus, profile.head_peak, hi, profile.overlap) or ["keep"] * n
    while hi - lo > max(1.0, 1e-9 * hi):
        mid = (lo + hi) / 2
        plan = _feasible(menus, profile.head_peak, mid, profile.overlap)
        if plan is None:
            lo = mid
        else:
            hi, best = mid, plan
    plan = Plan(best, "min-memory")
    return simulate(profile, plan).peak_bytes, plan
