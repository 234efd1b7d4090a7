"""A whole cluster's plan before anything runs (`hetforge plan --cluster`, the cluster table in
docs/): per kind of device the strategy, micro-batch, activation plan, predicted peak and
samples/s, and for the job the step time with the collectives at a declared link bandwidth.

Pure given the profiles: `profile_at(micro_batch)` gives a device kind's profile (measured here,
or `memory.analytic` for a card that is not). The strategy is the configured one, or with "auto"
the least sharding under which every kind has a plan (`memory.sharding`'s order). The step is the
balanced compute (the global batch over the summed throughput) or the collectives, whichever is
longer: FSDP2 and DDP overlap communication with compute, so the longer of the two is the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from hetforge.memory.device_plan import DevicePlan, plan_profile
from hetforge.memory.milp import PlanError
from hetforge.memory.plan import ModelProfile
from hetforge.model.accounting import (STRATEGIES, ShardLayout, collective_bytes_per_step, parameter_sizes,
                                       state_shares)
from hetforge.model.gpt_neox import GPTNeoXConfig


@dataclass
class DeviceKind:
    name: str
    count: int
    budget: float  # bytes a plan may use
    profile_at: Callable[[int], ModelProfile]
    speed: float = 1.0  # divides the profiled times (a kind profiled on another device)
    compiled: bool = False  # a run on it compiles its blocks: no rebuilding under memory.rebuild=auto


@dataclass
class KindPlan:
    kind: DeviceKind
    plan: DevicePlan | None
    error: str | None = None
    state_share: float | None = None  # zero1 by memory: the optimizer state's fraction on each of its ranks

    @property
    def samples_per_s(self) -> float:
        return self.plan.micro_batch / self.plan.prediction.time_s if self.plan else 0.0


@dataclass
class ClusterPlan:
    strategy: str
    why: str
    kinds: list[KindPlan]
    compute_s: float = math.inf
    comm_s: float = 0.0
    tokens_per_step: int = 0
    tried: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(k.plan is not None for k in self.kinds)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.fits and self.step_s > 0 else 0.0


def best_plan(kind: DeviceKind, shape: GPTNeoXConfig, mem_cfg, sizes: list[int], optimizer: str,
              layout: ShardLayout) -> KindPlan:
    """The micro-batch with the highest predicted samples/s that has a plan, or why none has."""
    best, first_error = None, None
    for b in sizes:
        try:
            dp = plan_profile(kind.profile_at(b), shape, mem_cfg, b, kind.budget, optimizer, layout, kind.compiled)
        except PlanError as err:
            first_error = first_error or str(err)
            break  # larger micro-batches need more
        dp.prediction.time_s /= kind.speed
        dp.keep_all.time_s /= kind.speed
        if best is None or b / dp.prediction.time_s > best.micro_batch / best.prediction.time_s:
            best = dp
    return KindPlan(kind, best, None if best else first_error)


def zero1_kind_shares(shape: GPTNeoXConfig, kinds: list[DeviceKind]) -> list[float] | None:
    """Per kind, the largest fraction of the optimizer state one of its ranks holds when ZeRO-1
    splits it in proportion to memory (None when every rank has the same memory: equal parts)."""
    weights = [k.budget for k in kinds for _ in range(k.count)]
    if len(set(weights)) <= 1:
        return None
    shares, out, r = state_shares(parameter_sizes(shape), weights), [], 0
    for k in kinds:
        out.append(max(shares[r:r + k.count]))
        r += k.count
    return out


def plan_cluster(shape: GPTNeoXConfig, mem_cfg, kinds: list[DeviceKind], strategy: str, sizes: list[int],
                 global_batch: int, seq_len: int, link_bytes_per_s: float, optimizer: str = "adamw",
                 gather_bytes: int = 2, offload: str = "none", shard_size: int | None = None,
                 state_shares_by_memory: bool = True) -> ClusterPlan:
    """`state_shares_by_memory`: ZeRO-1's optimizer state in proportion to each rank's memory
    (`parallel.state_shares: memory`), else equal parts."""
    world = sum(k.count for k in kinds)
    zero1_shares = zero1_kind_shares(shape, kinds) if state_shares_by_memory else None
    order = [s for s in STRATEGIES if not (offload == "params" and s in ("ddp", "zero1"))] \
        if strategy == "auto" else [strategy]
    # auto: sharding before the optimizer on the host (its copies and host step cost every step,
    # ZeRO's collectives overlap the backward); the host comes in only where nothing else fits
    passes = [mem_cfg.model_copy(update={"optimizer_offload": "off"}), mem_cfg] \
        if strategy == "auto" and mem_cfg.optimizer_offload == "auto" else [mem_cfg]
    tried, last = [], None
    for mem in passes:
        for s in order:
            layout = ShardLayout(s, shard_size or world if s != "ddp" else 1, gather_bytes, offload)
            per_kind = [replace(layout, state_share=zero1_shares[i]) if s == "zero1" and zero1_shares else layout
                        for i in range(len(kinds))]
            plans = [best_plan(k, shape, mem, sizes, optimizer, lay) for k, lay in zip(kinds, per_kind)]
            for p, lay in zip(plans, per_kind):
                p.state_share = lay.state_share
            last = ClusterPlan(s, "", plans, tokens_per_step=global_batch * seq_len, tried=list(tried))
            if last.fits:
                rate = sum(p.kind.count * p.samples_per_s for p in plans)
                last.compute_s = global_batch / rate
                micro = math.ceil(global_batch / world / min(p.plan.micro_batch for p in plans))
                group = world if s in ("ddp", "zero1") else layout.shard_size
                last.comm_s = collective_bytes_per_step(shape, s, group, micro, gather_bytes) / link_bytes_per_s
                last.why = (f"auto: {s}" + (f" ({'; '.join(tried)}: does not fit)" if tried else "")
                            if strategy == "auto" else f"parallel.strategy={s}")
                return last
            short = next(p for p in plans if p.plan is None)
            tried.append(f"{s} on {short.kind.name}" + (" with the optimizer on the host" if mem is not passes[0] else ""))
    last.why = "nothing fits: " + "; ".join(tried)
    return last
