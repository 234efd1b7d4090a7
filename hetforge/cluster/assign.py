"""Giving every rank its share of the global batch at the start of a run, and re-balancing when
the measured step times drift from the plan.

Every rank probes itself, the reports are all-gathered, and each rank solves the same deterministic
problem; rank 0's plan is broadcast anyway so that no rank can ever disagree. The plan is saved to
`RUN/balance.json` with a fingerprint of what it depends on (ranks, their devices, model, batch,
sequence length) and reused when a run resumes on the same cluster.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from hetforge.cluster.balance import (
    BalanceError,
    BalancePlan,
    RankInfo,
    RankShare,
    TimeModel,
    balanced_plan,
    choose_accumulation,
    collective_seconds,
    equal_counts,
    equal_plan,
    fit_link,
    fixed_plan,
)
from hetforge.cluster.dist import DistContext, all_gather_object, broadcast_object
from hetforge.cluster.probe import micro_batches_within, probe, proxy_model, time_all_gathers
from hetforge.cluster.spec import Slowdown, device_memory_bytes, device_name, rank_device
from hetforge.config import RunConfig
from hetforge.memory.device_plan import plan_for_config
from hetforge.memory.milp import PlanError
from hetforge.model.accounting import (
    ShardLayout,
    collective_bytes_per_step,
    collectives_per_micro_batch,
    shard_units,
    unsharded_accumulation_collectives,
)

PLAN_FILE = "balance.json"
# what a saved plan was solved with: plans of an older pricing are solved again, not reused
BALANCE_VERSION = 3
LINK_PROBE_BYTES = (4096, 16 << 20)  # the all-gathers that time the link: latency, and bandwidth


def _fingerprint(cfg: RunConfig, reports: list[dict], layout: ShardLayout | None = None) -> str:
    key = {
        "version": BALANCE_VERSION,
        "layout": asdict(layout or ShardLayout()),
        "ranks": [(r["host"], r["device"], r["memory_gb"], r["declared"]) for r in reports],
        "model": cfg.model.model_dump(mode="json"),
        "global_batch": cfg.train.global_batch_size,
        "seq_len": cfg.train.seq_len,
        "max_micro": cfg.train.micro_batch_size,
        "precision": cfg.train.precision,
        "balance": cfg.cluster.balance,
        "assignments": [a.model_dump() for a in cfg.cluster.assignments],
        "memory": cfg.memory.model_dump(mode="json"),
        "accumulation": cfg.parallel.accumulation,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def single_process_plan(cfg: RunConfig) -> BalancePlan:
    """One rank: micro-batches of train.micro_batch_size, exactly the plain loop's schedule."""
    b, B = cfg.train.micro_batch_size, cfg.train.global_batch_size
    parts = [b] * (B // b) + ([B % b] if B % b else [])
    return BalancePlan(B, "single", [RankShare(0, "localhost", "local", None, 0.0, b, B, parts, 0.0)])


def micro_batch_collectives_s(cfg: RunConfig, ctx: DistContext, shape, layout: ShardLayout,
                              device: torch.device) -> tuple[float, dict]:
    """Seconds of the collectives each micro-batch runs under a sharded layout accumulating sharded,
    the same for every rank, and how they were priced: the link's latency and bandwidth from
    all-gathers timed on the run's group (the slowest rank's figures), or `parallel.link_gbps` where
    declared. The figures also hold `unsharded_step_s`, the same link's price of accumulating
    unsharded (one gather and one reduce-scatter a unit, once a step)."""
    count = collectives_per_micro_batch(shape, layout.strategy, layout.unit_params)
    if count == 0 or not ctx.distributed:
        return 0.0, {}
    biggest = max(shard_units(shape, layout.unit_params)) * layout.gather_bytes // max(layout.shard_size, 1)
    sizes = sorted({LINK_PROBE_BYTES[0], max(min(biggest, LINK_PROBE_BYTES[1]), LINK_PROBE_BYTES[0] * 2)})
    timed = time_all_gathers(device, sizes)
    slowest = {n: max(r[str(n)] for r in all_gather_object(ctx, {str(k): v for k, v in timed.items()}))
               for n in sizes}
    latency, bandwidth = fit_link(slowest, ctx.world_size)
    if cfg.parallel.link_gbps:
        bandwidth = cfg.parallel.link_gbps * 1e9
    sent = collective_bytes_per_step(shape, layout.strategy, layout.shard_size, 1, layout.gather_bytes)
    seconds = collective_seconds(count, sent, latency, bandwidth)
    once = collective_seconds(*unsharded_accumulation_collectives(shape, layout.shard_size, layout.gather_bytes,
                                                                  layout.unit_params), latency, bandwidth)
    return seconds, {"collectives": count, "bytes_sent": sent, "latency_s": latency, "bytes_per_s": bandwidth,
                     "all_gather_s": {str(n): t for n, t in slowest.items()}, "unsharded_step_s": once}


def _memory_planner(cfg: RunConfig, model: nn.Module, device: torch.device, memory: float | None, run_dir: Path,
                    backend: str, layout: ShardLayout | None = None):
    core = getattr(model, "module", model)

    def at(b: int):
        try:
            return plan_for_config(cfg, core.cfg, device, b, memory, run_dir / "memory", backend, layout)
        except PlanError as err:
            return err

    return at


def plan_for_run(
    cfg: RunConfig, ctx: DistContext, model: nn.Module, device: torch.device, autocast, vocab: int,
    run_dir: Path, console=None, layout: ShardLayout | None = None,
    wrap_proxy: Callable[[nn.Module], nn.Module] | None = None,
) -> BalancePlan:
    """The batch balance of a distributed run. Under a sharded `layout` each rank is probed on a
    local proxy of the model (it is never whole on one rank), and the plan says how FSDP2
    accumulates (`parallel.accumulation`): sharded, every rank running the same number of
    micro-batches (each one is a collective), or unsharded, each rank its own number.
    `wrap_proxy` shards the proxy as the model is, on a mesh of the calling rank alone (see `probe`)."""
    if not ctx.distributed:
        return single_process_plan(cfg)
    layout = layout or ShardLayout()
    spec = rank_device(cfg.cluster, ctx)
    memory = device_memory_bytes(spec, device)
    report = {
        "rank": ctx.rank, "host": ctx.host, "device": device_name(spec, device),
        "memory_gb": memory / 2**30 if memory else None,
        "declared": spec.speed if spec else None,
    }
    reports = all_gather_object(ctx, report)
    fingerprint = _fingerprint(cfg, reports, layout)
    saved = BalancePlan.load(run_dir / PLAN_FILE)
    if saved is not None and saved.fingerprint == fingerprint:
        if console is not None and ctx.is_main:
            console.print(f"reusing the batch balance in {run_dir / PLAN_FILE}")
        return saved

    label = f"rank {ctx.rank} ({report['device']} on {ctx.host})"
    all_declared = all(r["declared"] for r in reports)
    memory_plans = None
    if cfg.memory.active:  # the balancer sees each device's planned (recompute/offload) step
        memory_plans = _memory_planner(cfg, model, device, memory, run_dir, ctx.backend, layout)
    shape = getattr(model, "module", model).cfg
    static = sum(layout.static_bytes(shape, cfg.train.optimizer).values())
    per_micro_s, link = micro_batch_collectives_s(cfg, ctx, shape, layout, device) if layout.sharded else (0.0, {})
    timed = proxy_model(shape, device) if layout.sharded else model
    tm, facts = probe(timed, cfg.train.seq_len, vocab, device, autocast, cfg.train.micro_batch_size, memory,
                      Slowdown(spec), cfg.cluster.probe_steps, spec.speed if all_declared else None, label,
                      memory_plans, cfg.train.optimizer, static=static, full_shape=shape if layout.sharded else None,
                      wrap=wrap_proxy if layout.sharded else None)
    del timed
    # FSDP2 accumulating unsharded (`model.accounting.ACCUMULATIONS`): the largest micro-batch that
    # fits beside full weights and gradients. Under an activation plan only where configured: the
    # plan is solved for the layout's own bytes.
    unsharded_limit = 0
    if layout.accumulation == "unsharded":
        unsharded_limit = tm.max_micro
    elif layout.sharded and cfg.parallel.may_accumulate_unsharded() and memory_plans is None:
        whole = sum(replace(layout, accumulation="unsharded").static_bytes(shape, cfg.train.optimizer).values())
        unsharded_limit = micro_batches_within(memory, whole, facts["activation_bytes_per_sample"], tm.max_micro)
    gathered = all_gather_object(ctx, {"points": tm.points, "max_micro": tm.max_micro, "step_costs": tm.step_costs,
                                       "facts": facts, "unsharded_limit": unsharded_limit})
    if link and console is not None and ctx.is_main:
        bw = "free" if link["bytes_per_s"] == float("inf") else f"{link['bytes_per_s'] / 1e9:.2g} GB/s"
        console.print(f"{layout.strategy}: {link['collectives']} collectives a micro-batch, priced "
                      f"{per_micro_s * 1e3:.1f} ms ({link['latency_s'] * 1e3:.2f} ms each + "
                      f"{link['bytes_sent'] / 2**20:.1f} MiB at {bw}"
                      f"{' declared' if cfg.parallel.link_gbps else ' measured'}); accumulating unsharded, "
                      f"{link['unsharded_step_s'] * 1e3:.1f} ms once a step")
    B = cfg.train.global_batch_size

    def solve(per_micro: float, per_step: float, unsharded: bool) -> BalancePlan:
        infos = [RankInfo(r["rank"], r["host"], r["device"], r["memory_gb"],
                          TimeModel(g["points"], g["unsharded_limit"] if unsharded else g["max_micro"],
                                    g["step_costs"], per_micro, per_step))
                 for r, g in zip(reports, gathered)]
        if cfg.cluster.balance == "fixed":
            plan = fixed_plan(infos, B, [(a.samples, a.micro_batch_size) for a in cfg.cluster.assignments])
        elif cfg.cluster.balance == "equal":
            plan = equal_plan(infos, B)
        else:  # accumulating sharded, every micro-batch is a collective: every rank runs as many
            plan = balanced_plan(infos, B, equal_counts=layout.sharded and not unsharded)
        return equal_counts(plan, infos) if layout.sharded and not unsharded else plan

    if not layout.sharded:
        plan = solve(0.0, 0.0, False)
    else:
        sharded_plan = solve(per_micro_s, 0.0, False) if layout.accumulation == "sharded" else None
        unsharded_plan = None
        if all(g["unsharded_limit"] >= 1 for g in gathered):
            try:
                unsharded_plan = solve(0.0, link.get("unsharded_step_s", 0.0), True)
            except BalanceError:  # a fixed share whose micro-batch fits only sharded
                if layout.accumulation == "unsharded":
                    raise
        plan, why = choose_accumulation(sharded_plan, unsharded_plan, cfg.parallel.accumulation)
        if console is not None and ctx.is_main:
            console.print(f"{layout.strategy}: {why}")
    plan.fingerprint = fingerprint
    plan = broadcast_object(ctx, plan)
    if ctx.is_main:
        plan.save(run_dir / PLAN_FILE)
        if console is not None:
            console.print(plan.table())
    return plan


class DriftMonitor:
    """Watches each rank's measured compute time per step against the plan's prediction. When some
    rank is off by more than `threshold` (relative to the median rank) for `window` consecutive
    steps, it rescales that rank's time model by what was observed and solves again. The global
    batch never changes; every rank sees the same gathered times, so all reach the same new plan."""

    def __init__(self, plan: BalancePlan, threshold: float, window: int, warmup_steps: int = 2):
        self.plan, self.threshold, self.window, self.warmup = plan, threshold, window, warmup_steps
        self.strikes, self.seen = 0, 0
        self.models = [TimeModel(m["points"], m["max_micro"], m.get("step_costs", []), m.get("per_micro_s", 0.0),
                                 m.get("per_step_s", 0.0))
                       for m in plan.models]

    def observe(self, compute_s: list[float]) -> BalancePlan | None:
        self.seen += 1
        if self.seen <= self.warmup or len(self.models) != len(compute_s):
            return None
        ratios = {s.rank: compute_s[s.rank] / s.predicted_s for s in self.plan.shares
                  if s.samples > 0 and s.predicted_s > 0}
        if len(ratios) < 2:
            return None
        med = statistics.median(ratios.values())
        drift = max(abs(r / med - 1.0) for r in ratios.values())
        self.strikes = self.strikes + 1 if drift > self.threshold else 0
        if self.strikes < self.window:
            return None
        self.models = [m.scaled(ratios.get(i, med)) for i, m in enumerate(self.models)]
        infos = [RankInfo(s.rank, s.host, s.device, s.memory_gb, m) for s, m in zip(self.plan.shares, self.models)]
        new = balanced_plan(infos, self.plan.global_batch)
        new.fingerprint, new.mode = self.plan.fingerprint, "rebalanced"
        self.plan, self.strikes, self.seen = new, 0, 0
        return new
