"""Choosing a plan: the HiGHS mixed-integer program, the baselines it must beat, and brute force.

The MILP mirrors `plan.simulate` exactly, so its optimum is the optimum of the simulator over the
menu (the tests check this against enumeration of every plan). Per block one binary per option;
a continuous running sum of held bytes (so each stage's memory row has O(menu) terms, not O(n));
one continuous stall per stage, at least the overlapping transfer minus the stage's compute.
Memory is in MiB and time in ms to keep the coefficients near 1.
"""

from __future__ import annotations

import itertools
import time

import highspy

from hetforge.memory.plan import MENUS, RECOMPUTE_ONLY, ModelProfile, Plan, format_bytes, simulate, sqrt_segments

MIB = 2.0**20
MS = 1e3
TIE_MS_PER_MIB = 1e-7


class PlanError(ValueError):
    """The budget cannot be met; the message states why and the smallest feasible budget."""


def _build(profile: ModelProfile, menu: tuple[str, ...], budget: float | None):
    """The model; with budget None, minimise the peak instead (the smallest feasible budget)."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    blocks, n = profile.blocks, len(profile.blocks)
    link = profile.link_bytes_per_s
    y = [{o: h.addBinary() for o in menu} for _ in range(n)]
    for i in range(n):
        h.addConstr(sum(y[i].values()) == 1)

    def lin(i: int, attr: str, scale: float):
        return sum(getattr(blocks[i].options[o], attr) / scale * y[i][o] for o in menu)

    def xfer_ms(i: int):
        return sum(blocks[i].options[o].host / link * MS * y[i][o] for o in menu)

    cap = h.addVariable(lb=0) if budget is None else None
    limit = (budget - profile.static_bytes) / MIB if budget is not None else None
    prefix = [0.0]  # held MiB by blocks < k
    for k in range(n):
        p = h.addVariable(lb=0)
        h.addConstr(p == prefix[-1] + lin(k, "held", MIB))
        prefix.append(p)

    def mem_row(expr) -> None:
        if cap is None:
            h.addConstr(expr <= limit)
        else:
            h.addConstr(expr - cap <= 0)

    stalls = []

    def stall(transfer, compute_ms) -> None:
        s = h.addVariable(lb=0)
        h.addConstr(s - transfer + compute_ms >= 0)
        stalls.append(s)

    for k in range(n):
        prev = lin(k - 1, "host", MIB) if k else 0.0
        mem_row(prefix[k] + prev + lin(k, "fwd_peak", MIB))
        if k:
            stall(xfer_ms(k - 1), blocks[k].fwd_s * MS)
    if n:
        mem_row(prefix[n] + lin(n - 1, "host", MIB) + profile.head_peak / MIB)
        stall(xfer_ms(n - 1), (profile.head_fwd_s + profile.head_bwd_s) * MS)
    for k in range(n):
        prev = lin(k - 1, "host", MIB) if k else 0.0
        mem_row(prefix[k] + prev + lin(k, "bwd_peak", MIB))
        if k:
            stall(xfer_ms(k - 1), blocks[k].bwd_s * MS + lin(k, "recompute_s", 1 / MS))
    if cap is not None:
        h.minimize(cap)
    else:
        rec = sum(lin(i, "recompute_s", 1 / MS) for i in range(n))
        # On a tie in time prefer moving fewer bytes: a free offload still uses the link and host memory.
        moved = sum(lin(i, "host", MIB) for i in range(n)) * TIE_MS_PER_MIB
        h.minimize(rec + sum(stalls) + moved)
    return h, y


def _run(h: highspy.Highs, time_limit_s: float, gap: float) -> tuple[str, float, float]:
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(gap))
    t0 = time.perf_counter()
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    return status, time.perf_counter() - t0, float(info.mip_gap)


def _has_solution(h: highspy.Highs) -> bool:
    return h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible


def minimum_budget(profile: ModelProfile, menu: tuple[str, ...], time_limit_s: float = 30.0) -> float:
    """The smallest peak any plan on this menu reaches (bytes)."""
    h, y = _build(profile, menu, None)
    _run(h, time_limit_s, 1e-6)
    if not _has_solution(h):
        raise RuntimeError("HiGHS found no plan while minimising the peak")
    return simulate(profile, _extract(h, y, menu, "min-memory")).peak_bytes


def _extract(h, y, menu, strategy) -> Plan:
    opts = [max(menu, key=lambda o: h.val(row[o])) for row in y]
    return Plan(opts, strategy)


def solve(
    profile: ModelProfile,
    budget: float,
    menu: tuple[str, ...] = MENUS["sublayer"],
    time_limit_s: float = 60.0,
    gap: float = 1e-3,
    strategy: str = "milp",
) -> Plan:
    """The fastest plan whose peak stays within `budget` bytes at every stage of the step."""
    if budget < profile.static_bytes:
        raise PlanError(
            f"budget {format_bytes(budget)} is below the weights + gradients + optimizer state alone "
            f"({format_bytes(profile.static_bytes)}); no activation plan can help: use more memory, a smaller "
            "model, or optimizer-state offload"
        )
    h, y = _build(profile, menu, budget)
    status, secs, mip_gap = _run(h, time_limit_s, gap)
    if not _has_solution(h):
        need = minimum_budget(profile, menu)
        raise PlanError(
            f"no {strategy} plan fits a budget of {format_bytes(budget)}: the smallest feasible budget for this "
            f"model, micro-batch and menu is {format_bytes(need)} ({need:.0f} bytes)"
        )
    plan = _extract(h, y, menu, strategy)
    plan.solve = {"status": status, "seconds": secs, "gap": mip_gap, "variables": h.getNumCol(),
                  "constraints": h.getNumRow()}
    return plan


def brute_force(profile: ModelProfile, budget: float, menu: tuple[str, ...]) -> tuple[float, Plan] | None:
    """Every plan on the menu (|menu|^n of them): the reference for small chains."""
    best = None
    for combo in itertools.product(menu, repeat=len(profile.blocks)):
        pred = simulate(profile, Plan(list(combo), "brute-force"))
        if pred.peak_bytes <= budget * (1 + 1e-9) and (best is None or pred.time_s < best[0]):
            best = (pred.time_s, Plan(list(combo), "brute-force"))
    return best


def baselines(profile: ModelProfile, budget: float, granularity: str = "sublayer",
              time_limit_s: float = 60.0) -> dict[str, Plan | None]:
    """The plans a user already has, on the same profile; None where one does not fit."""
    n = len(profile.blocks)
    out: dict[str, Plan | None] = {
        "keep-all": Plan(["keep"] * n, "keep-all"),
        "every-block": Plan(["recompute"] * n, "every-block"),
        "sqrt(n)": Plan(["keep"] * n, "sqrt(n)", segments=sqrt_segments(n)),
    }
    for k, p in list(out.items()):
        if simulate(profile, p).peak_bytes > budget:
            out[k] = None
    menu = tuple(o for o in MENUS[granularity] if o in RECOMPUTE_ONLY)
    try:
        out["recompute-only MILP"] = solve(profile, budget, menu, time_limit_s, strategy="recompute-only")
    except PlanError:
        out["recompute-only MILP"] = None
    return out


def plan_for_strategy(profile: ModelProfile, budget: float | None, strategy: str, granularity: str = "sublayer",
                      time_limit_s: float = 60.0) -> Plan:
    """The plan a config's `memory.strategy` asks for; fixed strategies are checked against the budget."""
    n = len(profile.blocks)
    if strategy == "none":
        plan = Plan(["keep"] * n, "none")
    elif strategy == "full":
        plan = Plan(["recompute"] * n, "full")
    elif strategy == "sqrt":
        plan = Plan(["keep"] * n, "sqrt", segments=sqrt_segments(n))
    elif strategy in ("milp", "recompute-only"):
        if budget is None:
            return Plan(["keep"] * n, strategy, solve={"status": "no budget: keep all"})
        menu = MENUS[granularity]
        if strategy == "recompute-only":
            menu = tuple(o for o in menu if o in RECOMPUTE_ONLY)
        return solve(profile, budget, menu, time_limit_s, strategy=strategy)
    else:
        raise ValueError(f"unknown memory strategy {strategy!r}")
    if budget is not None:
        peak = simulate(profile, plan).peak_bytes
        if peak > budget:
            raise PlanError(
                f"strategy {strategy} needs {format_bytes(peak)}, over the budget of {format_bytes(budget)}; "
                "use strategy milp to search for a plan that fits"
            )
    return plan
