"""Choosing a plan: the HiGHS mixed-integer program, the baselines it must beat, and brute force.

The MILP mirrors `plan.simulate` exactly, so its optimum is the optimum of the simulator over the
menu (the tests check this against enumeration of every plan). Per block either one binary per
named option, or (granularity "tensor") binaries per branch, saved unit, op unit, input and
compile budget whose sums give the block's held bytes, host bytes and recompute time; a continuous running sum of held bytes (so each stage's memory row has O(menu) terms, not O(n));
one continuous stall per stage, at least the overlapping transfer minus the stage's compute.
Memory is in MiB and time in ms to keep the coefficients near 1.
"""

from __future__ import annotations

import itertools
import math
import time

import highspy
import numpy as np

from hetforge.core.errors import HetforgeError
from hetforge.core.sizes import format_bytes
from hetforge.memory.minimum import feasible_plan, minimum_peak
from hetforge.memory.plan import (ALL, BRANCHES, MENUS, RECOMPUTE_ONLY, BlockProfile, BranchPlan, Decision, ModelProfile, Plan,
                                  budget_key, simulate, sqrt_segments)

MIB = 2.0**20
MS = 1e3
TIE_MS_PER_MIB = 1e-5
TIE_MS_PER_REGION = 1e-5


MILP_MARGIN_BYTES = 64.0


class PlanError(HetforgeError, ValueError):
    """The budget cannot be met; the message states why and the smallest feasible budget."""


class TensorMenu:
    """Granularity "tensor": per branch keep or recompute; in a kept branch each saved unit on the
    device, offloaded or (where the profile prices it) rebuilt in the backward, or (where a compiled
    profile measured them) the whole branch at a compile budget; in a recomputed one each op unit
    cached or recomputed; inputs offloadable. `offload=False` is Checkmate's problem (recomputation
    only, rebuilding and compile budgets included: both are recomputation)."""

    def __init__(self, offload: bool = True, rebuild: bool = True):
        self.offload, self.rebuild = offload, rebuild

    def __repr__(self) -> str:
        return f"TensorMenu(offload={self.offload}, rebuild={self.rebuild})"

    def decisions(self, blk: BlockProfile) -> list[str]:
        """Every distinct decision of one block (for brute force and the minimum-peak search)."""
        def subsets(names):
            return [frozenset(c) for k in range(len(names) + 1) for c in itertools.combinations(names, k)]

        per_branch = {}
        for br in BRANCHES:
            saved = [u.name for u in blk.of("saved", br)]
            movable = saved if self.offload else []
            makeable = [u for u in saved if u in blk.rebuildable] if self.rebuild else []
            # each saved unit kept, offloaded or rebuilt (never both)
            keep = [BranchPlan("keep", off, made) for off in subsets(movable) for made in subsets(makeable)
                    if not off & made]
            keep += [BranchPlan("keep", budget=b) for b in blk.budgets(br)]  # a compiled run's profile
            rec = [BranchPlan("recompute", u) for u in subsets([u.name for u in blk.of("op", br)])]
            per_branch[br] = keep + rec
        out = []
        for a in per_branch["attn"]:
            for m in per_branch["mlp"]:
                keepers = {br for br, bp in (("attn", a), ("mlp", m)) if bp.mode == "keep"}
                # an input is offloadable only where a kept branch saves it
                movable = [u.name for u in blk.of("input") if keepers & set(u.users)] if self.offload else []
                out.extend(Decision(a, m, x).encode() for x in subsets(movable))
        return out


Menu = tuple[str, ...] | TensorMenu


def menu_for(granularity: str, recompute_only: bool = False, rebuild: bool = True) -> Menu:
    if granularity == "tensor":
        return TensorMenu(offload=not recompute_only, rebuild=rebuild)
    menu = MENUS[granularity]
    return tuple(o for o in menu if o in RECOMPUTE_ONLY) if recompute_only else menu


def _c(coef: float, var):
    """coef * var, or nothing where coef is rounding noise (HiGHS refuses a row holding |a| <= 1e-9)."""
    return coef * var if abs(coef) > 1e-9 else 0.0


def _option_terms(h: highspy.Highs, blk: BlockProfile, menu: tuple[str, ...]) -> dict:
    """One binary per option; the block's held MiB, host MiB, recompute ms and own peaks in MiB as
    linear expressions, and how to read the chosen option back."""
    y = {o: h.addBinary() for o in menu}
    h.addConstr(sum(y.values()) == 1)
    cost = {o: blk.cost(o) for o in menu}

    def lin(attr: str, scale: float):
        return sum(_c(getattr(cost[o], attr) * scale, y[o]) for o in menu)

    regions = [o for o in menu if "recompute" in (blk.decision(o).attn.mode, blk.decision(o).mlp.mode)]
    return {"held": lin("held", 1 / MIB), "host": lin("host", 1 / MIB), "rec": lin("recompute_s", MS),
            "fwd_peak": lin("fwd_peak", 1 / MIB), "bwd_peak": lin("bwd_peak", 1 / MIB),
            "regions": sum(y[o] for o in regions), "extract": lambda: max(menu, key=lambda o: h.val(y[o])),
            "assign": lambda option: [(y[o], float(o == option)) for o in menu]}


def _tensor_terms(h: highspy.Highs, blk: BlockProfile, menu: TensorMenu) -> dict:
    """Binaries per branch (recompute), per saved unit (offload), per op unit (cache), per input
    (offload), and a continuous "input on the device" bounded below by every branch that needs it.
    The own peaks depend on both branch modes: `both` is their product, made exact by three rows."""
    return _TensorTerms(h, blk, menu).terms()


class _TensorTerms:
    """The variables and rows of one block at granularity "tensor" (`_tensor_terms`), added to `h`
    part by part; `held`, `host`, `rec` and `cached` are the block's linear terms as they grow."""

    def __init__(self, h: highspy.Highs, blk: BlockProfile, menu: TensorMenu):
        self.h, self.blk, self.menu = h, blk, menu
        self.r = {br: h.addBinary() for br in BRANCHES}
        self.off, self.made, self.cache, self.ins, self.sels, self.budgets = {}, {}, {}, {}, {}, {}
        self.held, self.host, self.rec, self.cached = 0.0, 0.0, 0.0, 0.0
        self._saved_units()
        self._kept_branches()
        self._recomputed_branches()
        self._inputs()
        self._hooks()
        self.both = self._both()

    def _saved_units(self) -> None:
        h, r = self.h, self.r
        for u in self.blk.of("saved"):
            self.held = self.held + u.bytes / MIB - _c(u.bytes / MIB, r[u.branch])
            if self.menu.offload:
                o = self.off[u.name] = h.addBinary()
                h.addConstr(o + r[u.branch] <= 1)
                self.held = self.held - _c(u.bytes / MIB, o)
                self.host = self.host + _c(u.host_bytes / MIB, o)
            if self.menu.rebuild and u.name in self.blk.rebuildable:
                m = self.made[u.name] = h.addBinary()  # rebuilt in the backward: not held, its op paid again
                h.addConstr(m + r[u.branch] + self.off.get(u.name, 0.0) <= 1)
                self.held = self.held - _c(u.rebuild_bytes / MIB, m)
                self.rec = self.rec + _c(u.time_s * MS, m)

    def _kept_branches(self) -> None:
        h, blk, off, made = self.h, self.blk, self.off, self.made
        for br in BRANCHES:
            saved = blk.of("saved", br)
            # a compiled run's kept branch runs eager once it offloads or rebuilds any unit
            per_op = [v for u in saved for v in (off.get(u.name), made.get(u.name)) if v is not None]
            if per_op and blk.eager_s(br) > 1e-12:
                e = h.addVariable(lb=0, ub=1)
                for v in per_op:
                    h.addConstr(e - v >= 0)
                self.rec = self.rec + _c(blk.eager_s(br) * MS, e)
            # A kept branch compiled at a budget under 1 (a compiled run's profile): its measured bytes
            # replace its saved units', whose offload and rebuild binaries it excludes.
            zs = self.budgets[br] = {b: h.addBinary() for b in blk.budgets(br)}
            if not zs:
                continue
            h.addConstr(self.r[br] + sum(zs.values()) <= 1)
            for u in saved:
                if u.name in off or u.name in made:
                    h.addConstr(off.get(u.name, 0.0) + made.get(u.name, 0.0) + sum(zs.values()) <= 1)
            units_mib = sum(u.bytes for u in saved) / MIB
            for b, z in zs.items():
                fig = blk.compiled[br][budget_key(b)]
                self.held = self.held + _c(fig["held"] / MIB - units_mib, z)
                self.rec = self.rec + _c(fig["time_s"] * MS, z)

    def _recomputed_branches(self) -> None:
        """A recomputed branch costs its plain checkpoint; caching any op unit switches it to selective
        checkpointing (`sac`: fixed cost, then each cached unit saves its time)."""
        h, blk = self.h, self.blk
        for br in BRANCHES:
            ops = blk.of("op", br)
            fixed = blk.recompute.get(br)
            plain = fixed["plain"] if fixed else sum(v.time_s for v in ops)
            sac = fixed["sac"] if fixed else sum(v.time_s for v in ops)
            self.rec = self.rec + _c(plain * MS, self.r[br])
            if not ops:
                continue
            sel = self.sels[br] = h.addBinary()  # selective checkpointing in use
            h.addConstr(sel - self.r[br] <= 0)
            for v in ops:
                c = self.cache[v.name] = h.addBinary()
                h.addConstr(c - sel <= 0)
                self.cached = self.cached + _c(v.bytes / MIB, c)
                self.rec = self.rec - _c(v.time_s * MS, c)
            h.addConstr(sel - sum(self.cache[v.name] for v in ops) <= 0)
            self.rec = self.rec + _c((sac - plain) * MS, sel)

    def _inputs(self) -> None:
        h, r = self.h, self.r
        for x in self.blk.of("input"):
            on = h.addVariable(lb=0, ub=1)
            o = h.addBinary() if self.menu.offload else None
            if o is not None:
                self.ins[x.name] = o
            for b in x.users:
                h.addConstr(on - r[b] >= 0)  # a recomputed branch holds its input
                h.addConstr(on + r[b] + (o if o is not None else 0.0) >= 1)  # a kept branch saves it
            if o is not None:
                h.addConstr(o + sum(r[b] for b in x.users) <= len(x.users))  # offloaded only if saved
                self.host = self.host + _c(x.host_bytes / MIB, o)
            self.held = self.held + _c(x.bytes / MIB, on)

    def _hooks(self) -> None:
        movers = [*self.off.values(), *self.made.values(), *self.ins.values()]
        if movers and self.blk.hooks_s > 1e-12:  # the block runs under the saved-tensor hooks once anything moves
            hooked = self.h.addVariable(lb=0, ub=1)
            for v in movers:
                self.h.addConstr(hooked - v >= 0)
            self.rec = self.rec + _c(self.blk.hooks_s * MS, hooked)

    def _both(self):
        h, r = self.h, self.r
        both = h.addVariable(lb=0, ub=1)
        h.addConstr(both - r["attn"] - r["mlp"] >= -1)
        h.addConstr(both - r["attn"] <= 0)
        h.addConstr(both - r["mlp"] <= 0)
        extra = self.blk.both_extra_s
        if abs(extra) > 1e-12:
            # both branches recomputed by plain checkpoints (no selective one): 1 exactly then, for
            # either sign of the correction (the rows bound it from above and from below)
            plain_both = h.addVariable(lb=0, ub=1)
            for br in BRANCHES:
                h.addConstr(plain_both - r[br] <= 0)
            for sel in self.sels.values():
                h.addConstr(plain_both + sel <= 1)
            h.addConstr(plain_both - r["attn"] - r["mlp"] + sum(self.sels.values()) >= -1)
            self.rec = self.rec + _c(extra * MS, plain_both)
        return both

    def peak(self, i: int):
        p = {k: v[i] / MIB for k, v in self.blk.peaks.items()}
        kk, rk, kr, rr = p["keep/keep"], p["recompute/keep"], p["keep/recompute"], p["recompute/recompute"]
        r = self.r
        return kk + _c(rk - kk, r["attn"]) + _c(kr - kk, r["mlp"]) + _c(rr - rk - kr + kk, self.both) + self.cached

    def extract(self) -> str:
        h = self.h
        chosen = lambda d: frozenset(k for k, v in d.items() if h.val(v) > 0.5)  # noqa: E731
        plans = {}
        for br in BRANCHES:
            if h.val(self.r[br]) > 0.5:
                plans[br] = BranchPlan("recompute", frozenset(k for k in chosen(self.cache) if k.startswith(br + ".")))
            elif any(h.val(z) > 0.5 for z in self.budgets[br].values()):
                plans[br] = BranchPlan("keep", budget=next(b for b, z in self.budgets[br].items() if h.val(z) > 0.5))
            else:
                plans[br] = BranchPlan("keep", frozenset(k for k in chosen(self.off) if k.startswith(br + ".")),
                                       frozenset(k for k in chosen(self.made) if k.startswith(br + ".")))
        return self.blk.name(Decision(plans["attn"], plans["mlp"], chosen(self.ins)))

    def assign(self, option: str) -> list:
        """The binaries' values for `option` (a start for the search)."""
        blk = self.blk
        d = blk.decision(option)
        vals = []
        for br in BRANCHES:
            bp = d.branch(br)
            vals.append((self.r[br], float(bp.mode == "recompute")))
            vals.extend((z, float(bp.mode == "keep" and bp.budget == b)) for b, z in self.budgets[br].items())
            for u in blk.of("saved", br):
                offloaded = bp.mode == "keep" and bp.budget == 1 and (ALL in bp.units or u.name in bp.units)
                if u.name in self.off:
                    vals.append((self.off[u.name], float(offloaded)))
                if u.name in self.made:
                    vals.append((self.made[u.name], float(bp.mode == "keep" and bp.budget == 1 and not offloaded
                                                          and u.name in bp.rebuilt)))
            for v in blk.of("op", br):
                vals.append((self.cache[v.name], float(bp.mode == "recompute" and v.name in bp.units)))
        keepers = {br for br in BRANCHES if d.branch(br).mode == "keep"}
        for name, o in self.ins.items():
            users = next(u.users for u in blk.of("input") if u.name == name)
            vals.append((o, float(name in d.offload_inputs and bool(keepers & set(users)))))
        return vals

    def terms(self) -> dict:
        return {"held": self.held + self.cached, "host": self.host, "rec": self.rec, "fwd_peak": self.peak(0),
                "bwd_peak": self.peak(1), "regions": self.r["attn"] + self.r["mlp"], "extract": self.extract,
                "assign": self.assign}


def _build(profile: ModelProfile, menu: Menu, budget: float):
    """The model: least step time with every stage's memory within `budget`."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    blocks, n = profile.blocks, len(profile.blocks)
    link_ms_per_mib = MIB / profile.link_bytes_per_s * MS
    terms = [(_tensor_terms(h, b, menu) if isinstance(menu, TensorMenu) else _option_terms(h, b, menu))
             for b in blocks]
    held, host, rec = ([t[k] for t in terms] for k in ("held", "host", "rec"))

    limit = (budget - profile.base_bytes) / MIB
    prefix = [0.0]  # held MiB by blocks < k
    for k in range(n):
        p = h.addVariable(lb=0)
        h.addConstr(p == prefix[-1] + held[k])
        prefix.append(p)

    others = (profile.inflight - 1) * prefix[n] if profile.inflight > 1 and n else 0.0  # see ModelProfile.inflight

    def mem_row(expr) -> None:
        h.addConstr(expr + others <= limit)

    stalls = []

    def stall(transfer, compute_ms) -> None:
        s = h.addVariable(lb=0)
        h.addConstr(s - transfer + compute_ms >= 0)
        stalls.append(s)

    lap = profile.overlap
    for k in range(n):
        prev = host[k - 1] if k and lap else 0.0
        mem_row(prefix[k] + prev + terms[k]["fwd_peak"])
        if k and lap:
            stall(host[k - 1] * link_ms_per_mib, blocks[k].fwd_s * MS)
    if n:
        mem_row(prefix[n] + (host[n - 1] if lap else 0.0) + profile.head_peak / MIB)
        if lap:
            stall(host[n - 1] * link_ms_per_mib, (profile.head_fwd_s + profile.head_bwd_s) * MS)
    for k in range(n):
        prev = host[k - 1] if k else 0.0
        mem_row(prefix[k] + prev + terms[k]["bwd_peak"])
        if k and lap:
            stall(host[k - 1] * link_ms_per_mib, blocks[k].bwd_s * MS + rec[k])
    if not lap:  # every byte moved is copied out and back on the compute's own time
        stalls.append(sum(host) * (2 * link_ms_per_mib))
    # On a tie in time prefer moving fewer bytes (a free offload still uses the link and host memory)
    # and fewer checkpointed regions (caching everything equals keeping it, at more cost).
    tie = sum(host) * TIE_MS_PER_MIB + sum(t["regions"] for t in terms) * TIE_MS_PER_REGION
    # The compute every plan pays is a constant offset: the MIP gap is then relative to the step.
    compute = (sum(b.fwd_s + b.bwd_s for b in blocks) + profile.head_fwd_s + profile.head_bwd_s) * MS
    # (setObjective, not minimize: highspy's minimize also solves, with no time limit)
    h.setObjective(sum(rec) + sum(stalls) + tie + compute, highspy.ObjSense.kMinimize)
    return h, terms


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


def minimum_budget(profile: ModelProfile, menu: Menu) -> float:
    """The smallest peak any plan on this menu reaches (bytes); exact, see `memory.minimum`."""
    return minimum_peak(profile, menu)[0]


def solve(
    profile: ModelProfile,
    budget: float,
    menu: Menu = MENUS["sublayer"],
    time_limit_s: float = 60.0,
    gap: float = 1e-3,
    strategy: str = "milp",
) -> Plan:
    """The fastest plan whose peak stays within `budget` bytes at every stage of the step."""
    if budget < profile.static_bytes:
        parts = " + ".join(profile.static)
        hint = ("memory.optimizer_offload (auto or on)" if "optimizer state" in profile.static
                else "more memory or a smaller model")
        raise PlanError(
            f"budget {format_bytes(budget)} is below the {parts} alone ({format_bytes(profile.static_bytes)}); "
            f"no activation plan can help: use {hint}"
        )
    keep = Plan(["keep"] * len(profile.blocks), strategy)
    if simulate(profile, keep).peak_bytes <= budget:  # nothing is faster than keeping everything
        keep.solve = {"status": "keep-all fits", "seconds": 0.0, "gap": 0.0, "variables": 0, "constraints": 0}
        return keep
    start = feasible_plan(profile, menu, budget)  # simulated: within the budget
    if start is None and profile.inflight > 1:  # the chain search's grids may miss a plan that fits
        h, terms = _build(profile, menu, budget - MILP_MARGIN_BYTES)
        status, secs, mip_gap = _run(h, time_limit_s, gap)
        if _has_solution(h):
            plan = Plan([t["extract"]() for t in terms], strategy)
            if simulate(profile, plan).peak_bytes <= budget:
                plan.solve = {"status": status, "seconds": secs, "gap": mip_gap, "variables": h.getNumCol(),
                              "constraints": h.getNumRow()}
                return plan
    if start is None:
        need = math.ceil(minimum_budget(profile, menu))
        raise PlanError(
            f"no {strategy} plan fits a budget of {format_bytes(budget)}: the smallest feasible budget for this "
            f"model, micro-batch and menu is {need} bytes ({format_bytes(need, round_up=True)})"
        )
    # HiGHS works in MiB and accepts rows a feasibility tolerance (~1e-6 MiB) over: the model gets
    # a few bytes less than the budget, and what it returns is simulated before it is trusted.
    h, terms = _build(profile, menu, budget - MILP_MARGIN_BYTES)
    # A feasible start (the chain search's): branch and bound prunes against it from the first node.
    pairs = [pv for t, o in zip(terms, start.options) for pv in t["assign"](o)]
    h.setSolution(len(pairs), np.array([v.index for v, _ in pairs], dtype=np.int32),
                  np.array([x for _, x in pairs], dtype=np.float64))
    status, secs, mip_gap = _run(h, time_limit_s, gap)
    info = {"status": status, "seconds": secs, "gap": mip_gap, "variables": h.getNumCol(),
            "constraints": h.getNumRow()}
    plan = Plan([t["extract"]() for t in terms], strategy) if _has_solution(h) else None
    if plan is None or simulate(profile, plan).peak_bytes > budget:
        # within the margin of the minimum (or rounded over): the chain search's plan, which fits
        plan = Plan(list(start.options), strategy)
        info["status"] = f"{status}; the search's feasible plan (the solver's was not within the budget)"
    plan.solve = info
    return plan


def brute_force(profile: ModelProfile, budget: float, menu: Menu) -> tuple[float, Plan] | None:
    """Every plan on the menu (|menu|^n of them): the reference for small chains."""
    options = menu.decisions(profile.blocks[0]) if isinstance(menu, TensorMenu) else menu
    best = None
    for combo in itertools.product(options, repeat=len(profile.blocks)):
        pred = simulate(profile, Plan(list(combo), "brute-force"))
        if pred.peak_bytes <= budget * (1 + 1e-9) and (best is None or pred.time_s < best[0]):
            best = (pred.time_s, Plan(list(combo), "brute-force"))
    return best


def baselines(profile: ModelProfile, budget: float, granularity: str = "tensor",
              time_limit_s: float = 60.0, rebuild: bool = True) -> dict[str, Plan | None]:
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
    try:
        out["recompute-only MILP"] = solve(profile, budget, menu_for(granularity, recompute_only=True, rebuild=rebuild),
                                           time_limit_s, strategy="recompute-only")
    except PlanError:
        out["recompute-only MILP"] = None
    return out


def plan_for_strategy(profile: ModelProfile, budget: float | None, strategy: str, granularity: str = "tensor",
                      time_limit_s: float = 60.0, rebuild: bool = True) -> Plan:
    """The plan a config's `memory.strategy` asks for; fixed strategies are checked against the budget.
    `rebuild`: whether the tensor menu offers rebuilding units (see `memory.rebuild`)."""
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
        return solve(profile, budget, menu_for(granularity, strategy == "recompute-only", rebuild), time_limit_s,
                     strategy=strategy)
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
