"""Everything a run decides, decided once: `resolve_plan(cfg, shape, facts) -> RunPlan`.

The choices of a run (precision, head padding, compile, the data-parallel strategy with its shard
group, FSDP unit size and ZeRO-1 state shares, each rank's share of the global batch and its
micro-batches, FSDP2's accumulation, each rank's activation plan and optimizer placement) are a pure
function of the config and of what is known about the ranks (`Facts`): the devices and their memory,
and, through each rank's `RankView`, its step times and memory profiles. `train` resolves the plan
once on facts its ranks measure (`cluster.facts.LaunchedFacts`), writes it to the run directory and
builds the run from it; `hetforge plan` resolves the same function on facts taken from a device, a
card of the table or a cluster file (`DeclaredFacts`), so both give the same object for the same
cluster.

Where facts come from per rank, `Facts.gather(fn)` evaluates `fn` with each rank's view: in a
launched run every rank evaluates its own and the answers are all-gathered (so each rank runs this
same code, collective for collective, and reaches the same plan); declared facts evaluate every
rank here, once per kind of rank.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

from hetforge.cluster.balance import (BalanceError, BalancePlan, RankInfo, RankShare, TimeModel, balanced_plan,
                                      choose_accumulation, collective_seconds, equal_counts, equal_plan, fixed_plan)
from hetforge.cluster.layouts import Links, Ranks, candidates, choose, offload_seconds
from hetforge.cluster.pipeline_plan import PipelinePlan, buffer_bytes, inflight, plan_pipeline
from hetforge.cluster.probe import (WORKSPACE_MARGIN, candidate_sizes, largest_fitting, micro_batches_within,
                                    planned_points, planned_step_costs)
from hetforge.config import ConfigError, MeshConfig, RunConfig
from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.core.hardware import Capability, compile_decision, padded_head_dim, run_precision, sdpa_backend
from hetforge.core.sizes import format_bytes
from hetforge.memory.analytic import activation_bytes_per_sample, block_summary
from hetforge.memory.device_plan import DevicePlan, comm_workspace, plan_profile, rebuild_units, resolve_budget
from hetforge.memory.milp import PlanError, plan_for_strategy
from hetforge.memory.plan import ModelProfile, Plan, simulate, stage_profile
from hetforge.memory.sharding import HOST_OPTIMIZER, HOST_PARAMS, NoStrategyFits, RankNeed, choose_strategy, pick_strategy, \
    unit_size_that_fits
from hetforge.model.accounting import (STRATEGIES, ShardLayout, collective_bytes_per_step, collectives_per_micro_batch,
                                       parameter_sizes, stage_state_bytes,
                                       state_shares, unsharded_accumulation_collectives)
from hetforge.model.gpt_neox import GPTNeoXConfig

PLAN_VERSION = 1
PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class RankFacts:
    """What is known of a rank before anything runs on it."""

    rank: int
    node: int
    host: str
    device: str  # what the device is called: "cpu", a card of the table, what the driver reports
    capability: Capability
    memory_bytes: float | None  # what a plan may use; None: unbounded (a CPU with no memory declared)
    speed: float | None = None  # declared relative samples/s (`DeviceSpec.speed`)
    host_memory_bytes: float | None = None  # the node's host memory (`NodeSpec.memory_gb`)

    @property
    def kind(self) -> str:
        return self.capability.kind

    def to_dict(self) -> dict:
        return {**asdict(self), "capability": self.capability.to_dict()}


@dataclass(frozen=True)
class Link:
    """The link between ranks as the planner prices it: seconds per collective, bytes per second."""

    latency_s: float
    bytes_per_s: float
    source: str  # "measured", "declared", "assumed"


class RankView(Protocol):
    """One rank, where its figures come from: measured on its device, or estimated."""

    facts: RankFacts
    estimates: bool  # its figures are estimates (a card of the table): free to ask, nothing is run
    cache: dict  # plans already solved for it (shared by views of the same kind of rank)

    def profile(self, micro_batch: int, precision: str, head_dim: int, compiled: bool) -> ModelProfile:
        """The memory profile of the model at this micro-batch on this rank's device."""

    def step_times(self, sizes: list[int], precision: str, layout: ShardLayout, plans: dict[int, Plan],
                   head_dim: int) -> dict[int, float]:
        """Seconds of a forward and backward micro-step at each size (keep-all, or under `plans[b]`
        where a size must run under its activation plan to be timed at all)."""


class Facts(Protocol):
    ranks: list[RankFacts]

    def gather(self, fn: Callable[[RankView], Any]) -> list[Any]:
        """`fn` of every rank's view, in rank order (JSON-able results)."""

    def link(self, layout: ShardLayout) -> Link:
        """The link the collectives of `layout` run over."""


@dataclass
class RankPlan:
    rank: int
    node: int
    host: str
    device: str
    memory_bytes: float | None
    head_dim: int
    attention: str  # the attention kernel at that head size: flash, mem-efficient, math (cpu: the CPU's)
    state_share: float | None  # zero1 by memory: this rank's fraction of the optimizer state
    static_bytes: dict[str, float]
    activation_plan: list[str] | None = None  # per block (None: no activation plan, keep all)
    segments: list[list[int]] | None = None
    summary: str = "keep all"
    optimizer_offload: bool = False
    predicted_peak_bytes: float | None = None
    predicted_held_bytes: float | None = None
    predicted_micro_step_s: float | None = None  # one micro-batch under the plan
    keep_all_micro_step_s: float | None = None
    activation_peak_bytes: float | None = None
    recompute_share: float = 0.0  # of the blocks' forward, repeated in the backward (hardware FLOPs)

    @property
    def plan(self) -> Plan | None:
        if self.activation_plan is None:
            return None
        return Plan(self.activation_plan, segments=[tuple(s) for s in self.segments] if self.segments else None)


@dataclass
class RunPlan:
    world_size: int
    precision: str
    compile: bool
    strategy: str  # single | ddp | zero1 | zero2 | fsdp
    mesh: tuple[int, int] | None  # (replicate, shard) of a sharded run
    unit_params: int
    offload: str
    accumulation: str
    balance: BalancePlan
    ranks: list[RankPlan]
    link: Link | None
    predicted_step_s: float | None
    step_parts: dict[str, float]
    why: dict[str, str] = field(default_factory=dict)  # per decision, one line
    fingerprint: str = ""
    facts: dict = field(default_factory=dict)  # what it was decided on
    pipeline: PipelinePlan | None = None  # strategy "pipeline": stages, blocks, micro-batches per replica
    layouts: list[dict] = field(default_factory=list)  # pipeline stages auto: every layout priced (layouts.Candidate)

    @property
    def sharded(self) -> bool:
        return self.strategy in ("zero2", "fsdp")

    @property
    def distributed_state(self) -> bool:
        """Every rank holds a part of the state of its own (shards, or a pipeline stage's): each
        writes and reads its part of a checkpoint."""
        return self.sharded or self.pipeline is not None

    @property
    def gather_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def layout(self, rank: int) -> ShardLayout:
        """The layout rank `rank` runs under, as the planner priced it."""
        return _layout(self.strategy, self.mesh[1] if self.mesh else self.world_size, self.gather_bytes,
                       self.offload, self.unit_params, self.ranks[rank].state_share, self.accumulation)

    def decisions(self) -> dict:
        """The plan without the facts it was made from: what must agree between `train` and `plan`."""
        d = self.to_dict()
        d.pop("facts")
        return d

    def to_dict(self) -> dict:
        """As JSON has it (lists, not tuples): what `plan.json` holds and `hetforge plan --json` prints."""
        return json.loads(json.dumps(self._dict()))

    def _dict(self) -> dict:
        return {"version": PLAN_VERSION, "world_size": self.world_size, "precision": self.precision,
                "compile": self.compile, "strategy": self.strategy, "mesh": list(self.mesh) if self.mesh else None,
                "unit_params": self.unit_params, "offload": self.offload, "accumulation": self.accumulation,
                "balance": self.balance.to_dict(), "ranks": [asdict(r) for r in self.ranks],
                "link": asdict(self.link) if self.link else None, "predicted_step_s": self.predicted_step_s,
                "step_parts": self.step_parts, "why": self.why, "fingerprint": self.fingerprint, "facts": self.facts,
                "pipeline": self.pipeline.to_dict() if self.pipeline else None, "layouts": self.layouts}

    @classmethod
    def from_dict(cls, d: dict) -> "RunPlan":
        return cls(d["world_size"], d["precision"], d["compile"], d["strategy"],
                   tuple(d["mesh"]) if d["mesh"] else None, d["unit_params"], d["offload"], d["accumulation"],
                   BalancePlan.from_dict(d["balance"]), [RankPlan(**r) for r in d["ranks"]],
                   Link(**d["link"]) if d["link"] else None, d["predicted_step_s"], d["step_parts"], d["why"],
                   d["fingerprint"], d["facts"], PipelinePlan.from_dict(d["pipeline"]) if d.get("pipeline") else None,
                   d.get("layouts", []))

    def save(self, run_dir: Path) -> Path:
        """`RUN/plan.json`, and the same as tables in `RUN/plan.txt`."""
        from hetforge.core.console import render_text

        write_text_atomic(Path(run_dir) / "plan.txt", render_text(*self.tables()))
        return write_text_atomic(Path(run_dir) / PLAN_FILE, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> "RunPlan | None":
        try:
            d = json.loads((Path(run_dir) / PLAN_FILE).read_text())
            return cls.from_dict(d) if d.get("version") == PLAN_VERSION else None
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return None

    def tables(self) -> list:
        from rich.markup import escape
        from rich.table import Table

        head = Table(title=f"run plan: {self.world_size} rank(s)", show_header=False)
        rows = [("precision", self.precision), ("strategy", self.strategy), ("compile", "on" if self.compile else "off")]
        if self.sharded:
            rows.append(("accumulation", self.accumulation))
        if self.offload != "none":
            rows.append(("offload", self.offload))
        if self.layouts:
            rows.append(("layout", self.why["layout"].split(":")[0]))
        if self.pipeline is not None:
            rows.append(("pipeline", f"{self.pipeline.stages} stages x {self.pipeline.replicas} replica(s), blocks "
                                     f"{'+'.join(map(str, self.pipeline.layers))}"
                                     + (f", {self.pipeline.virtual} chunks a stage" if self.pipeline.virtual > 1 else "")
                                     + (", stages sharded over their replicas" if self.pipeline.shard else "")))
        for key, value in rows:
            head.add_row(key, value, escape(self.why.get(key, "")))
        if self.predicted_step_s is not None:
            parts = ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in self.step_parts.items())
            tokens = self.balance.global_batch * self.facts.get("seq_len", 0) / self.predicted_step_s
            head.add_row("step", f"{self.predicted_step_s * 1e3:,.1f} ms", f"{parts}; {tokens:,.0f} tokens/s")
        extra = [self._layouts_table()] if self.layouts else []
        if self.pipeline is not None:
            return [head, *extra, self._pipeline_table()]
        ranks = Table(title=f"per rank (global batch {self.balance.global_batch})")
        for col in ("rank", "host", "device", "attention", "memory", "samples", "micro-batches", "activations", "peak",
                    "step"):
            ranks.add_column(col, justify="left" if col in ("host", "device", "attention", "activations") else "right")
        for r, s in zip(self.ranks, self.balance.shares):
            ranks.add_row(str(r.rank), r.host, r.device, f"{r.attention}, head {r.head_dim}",
                          format_bytes(r.memory_bytes) if r.memory_bytes else "-",
                          str(s.samples), _micro_text(s.micro_batches), escape(r.summary),
                          format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes else "-",
                          f"{s.predicted_s * 1e3:,.1f} ms" if s.predicted_s else "-")
        return [head, *extra, ranks]


    def _layouts_table(self):
        from rich.markup import escape
        from rich.table import Table

        t = Table(title="layouts compared (pipeline stages: auto), fastest first")
        for col in ("layout", "fits", "step", "compute", "communication", "bubble", "peak a rank"):
            t.add_column(col, justify="left" if col in ("layout", "fits") else "right")
        for c in sorted(self.layouts, key=lambda c: (not c["fits"], c["step_s"] or 0.0)):
            t.add_row(escape(c["layout"]), "yes" if c["fits"] else escape(f"no: {c['note']}"),
                      f"{c['step_s']:.3g} s" if c["fits"] else "-", f"{c['compute_s']:.3g} s" if c["fits"] else "-",
                      f"{c['comm_s']:.3g} s" if c["fits"] else "-", f"{c['bubble']:.0%}" if c["stages"] else "-",
                      format_bytes(c["peak_bytes"]) if c["peak_bytes"] is not None else "-")
        return t

    def _pipeline_table(self):
        from rich.table import Table

        pipe = self.pipeline
        t = Table(title=f"pipeline: {pipe.stages} stages x {pipe.replicas} replica(s) (global batch "
                        f"{self.balance.global_batch}, micro-batches of {pipe.micro_batch_size})")
        for col in ("rank", "host", "device", "stage", "blocks", "replica", "micro-batches", "schedule", "bubble",
                    "peak"):
            t.add_column(col, justify="left" if col in ("host", "device", "schedule") else "right")
        for r in self.ranks:
            s, rep = pipe.stage_of(r.rank), pipe.replica_of(r.rank)
            t.add_row(str(r.rank), r.host, r.device, str(s), pipe.blocks_text(s), str(rep),
                      str(pipe.micro_batches[rep]), pipe.schedules[rep], f"{pipe.bubble(rep):.0%}",
                      format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes else "-")
        return t


def _micro_text(parts: list[int]) -> str:
    if not parts:
        return "-"
    if len(set(parts)) == 1:
        return f"{len(parts)} x {parts[0]}"
    return " + ".join(map(str, parts))


def _layout(strategy: str, shard: int, gather: int, offload: str, unit_params: int, state_share: float | None,
            accumulation: str) -> ShardLayout:
    replicated = strategy in ("single", "ddp")
    return ShardLayout("ddp" if strategy == "single" else strategy, 1 if replicated else shard, gather, offload,
                       unit_params, state_share if strategy == "zero1" else None,
                       accumulation if strategy in ("zero2", "fsdp") else "sharded")


# ------------------------------------------------------------------------------------------- decide
def resolve_plan(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts) -> RunPlan:
    """The run's plan (see the module's docstring). Raises ConfigError, in one line, where nothing fits."""
    if cfg.parallel.pipeline is not None:
        if cfg.parallel.pipeline.stages == "auto":
            return _chosen_layout_plan(cfg, shape, facts)
        return _pipeline_run_plan(cfg, shape, facts)
    world, ranks = len(facts.ranks), facts.ranks
    why: dict[str, str] = {}
    precision, why["precision"] = _precision(cfg, ranks)
    memory_plan = cfg.memory.active
    compiled, why["compile"] = compile_decision(cfg.train.compile, _torch_device(ranks[0].kind), memory_plan)
    heads = [_head_dim(cfg, shape, r.capability, precision) for r in ranks]
    strategy, mesh, offload, why["strategy"] = _choose_strategy(cfg, shape, facts, precision, heads, compiled)
    shard = mesh[1] if mesh else world
    weights = _state_weights(cfg, ranks) if strategy == "zero1" else None
    shares = state_shares(parameter_sizes(shape), weights) if weights else [None] * world
    unit_params, why["unit_params"] = _unit_params(cfg, shape, facts, strategy, shard, precision, heads, offload)
    layout_of = lambda acc: [_layout(strategy, shard, 4 if precision == "fp32" else 2, offload,  # noqa
                                     unit_params, shares[r], acc) for r in range(world)]
    balance, link, why["accumulation"] = _balance(cfg, shape, facts, layout_of, precision, heads, compiled)
    layouts = layout_of(balance.accumulation)
    rank_plans = _rank_plans(cfg, shape, facts, layouts, balance, precision, heads, compiled, shares)
    compute_s = balance.predicted_step_s
    parts = {"compute": compute_s}
    if link is not None and strategy in ("ddp", "zero1"):
        parts["collectives"] = collective_seconds(1 if strategy == "ddp" else 2, collective_bytes_per_step(
            shape, strategy, world, 1, layouts[0].gather_bytes), link.latency_s, link.bytes_per_s)
    host_s = 0.0 if offload != "params" else offload_seconds(  # (a host optimizer's step is in the rank plans)
        shape, shard, offload, layouts[0].gather_bytes, max(len(s.micro_batches) for s in balance.shares),
        [r.device for r in ranks])
    if host_s:  # the host's optimizer step and copies do not overlap the device's work
        parts["host"] = host_s
    known = all(s.predicted_s > 0 for s in balance.shares if s.samples)
    step_s = max(v for k, v in parts.items() if k != "host") + host_s
    plan = RunPlan(world, precision, compiled, strategy, mesh, unit_params, offload,
                   balance.accumulation, balance, rank_plans, link, step_s if known else None,
                   parts if known else {}, why)
    plan.fingerprint = fingerprint(cfg, shape, ranks)
    plan.facts = {"seq_len": cfg.train.seq_len, "ranks": [r.to_dict() for r in ranks],
                  "time_models": balance.models}
    return plan


def _pipeline_run_plan(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts) -> RunPlan:
    """A pipeline run's plan: its layout (`pipeline_plan.plan_pipeline`), the replicas' shares of
    the global batch as a balance over replicas, and each rank's stage and bytes."""
    ranks, world = facts.ranks, len(facts.ranks)
    why: dict[str, str] = {}
    precision, why["precision"] = _precision(cfg, ranks)
    heads = [_head_dim(cfg, shape, r.capability, precision) for r in ranks]
    pipe = plan_pipeline(cfg, shape, [r.device for r in ranks], [r.speed for r in ranks],
                         [r.memory_bytes for r in ranks], precision, max(heads))
    why["strategy"] = f"parallel.pipeline: {pipe.why}"
    why["compile"] = "off under a pipeline (the stages run eagerly)"
    slot = max(pipe.stage_micro_s)  # a micro-batch's slot: the slowest stage's time (relative units)
    shares = []
    for r in range(pipe.replicas):
        first = ranks[pipe.pipeline_ranks(r)[0]]
        n = pipe.micro_batches[r]
        shares.append(RankShare(r, first.host, f"pipeline {r}", None, 0.0, pipe.micro_batch_size,
                                n * pipe.micro_batch_size, [pipe.micro_batch_size] * n,
                                pipe.slots(r) * slot))
    balance = BalancePlan(cfg.train.global_batch_size, cfg.cluster.balance, shares)
    activations: list[dict | None] = [None] * world
    if cfg.memory.active:  # each rank's per-tensor plan for its stage replaces the blocks' recomputation
        activations = facts.gather(lambda view: _stage_memory_plan(cfg, shape, view, pipe, precision,
                                                                   heads[view.facts.rank]))
        why["memory"] = (f"per stage, an activation plan ({cfg.memory.strategy}) for its blocks with the schedule's "
                         f"micro-batches in flight")
    rank_plans = []
    for r in ranks:
        s, act = pipe.stage_of(r.rank), activations[r.rank]
        kernel = sdpa_backend(r.capability, precision, heads[r.rank]) if r.kind == "cuda" else "cpu"
        rank_plans.append(RankPlan(r.rank, r.node, r.host, r.device, r.memory_bytes, heads[r.rank], kernel, None,
                                   stage_state_bytes(shape, pipe.layers[s], s == 0, s == pipe.stages - 1,
                                                     cfg.train.optimizer, pipe.replicas if pipe.shard else 1,
                                                     4 if precision == "fp32" else 2),
                                   activation_plan=act["options"] if act else None,
                                   segments=act["segments"] if act else None,
                                   summary=f"stage {s}, blocks {pipe.blocks_text(s)}"
                                   + (f", {pipe.recomputed[s]} recomputed" if pipe.recomputed and pipe.recomputed[s]
                                      else "")
                                   + (f", activations: {act['summary']}" if act else "")
                                   + (f", sharded over {pipe.replicas} replicas" if pipe.shard else ""),
                                   predicted_peak_bytes=act["peak"] if act else pipe.stage_bytes[s],
                                   predicted_held_bytes=act["held"] if act else None,
                                   predicted_micro_step_s=act["time_s"] if act else None,
                                   keep_all_micro_step_s=act["keep_s"] if act else None))
    plan = RunPlan(world, precision, False, "pipeline", None, cfg.parallel.unit_params, "none", "sharded", balance,
                   rank_plans, None, None, {}, why, pipeline=pipe)
    plan.fingerprint = fingerprint(cfg, shape, ranks)
    plan.facts = {"seq_len": cfg.train.seq_len, "ranks": [r.to_dict() for r in ranks]}
    return plan


def _stage_memory_plan(cfg: RunConfig, shape: GPTNeoXConfig, view: RankView, pipe: PipelinePlan, precision: str,
                       head_dim: int) -> dict:
    """One rank's activation plan for its stage: its device's profile cut to the stage
    (`memory.plan.stage_profile`: its blocks, the head where it is last, its own static bytes and
    buffers) with the micro-batches its schedule holds at once, solved under its budget."""
    rank = view.facts.rank
    if pipe.virtual > 1:
        raise PlanError("an activation plan per stage runs under the 1f1b or gpipe schedule, not interleaved")
    s, rep = pipe.stage_of(rank), pipe.replica_of(rank)
    n, first, last = pipe.layers[s], s == 0, s == pipe.stages - 1
    micro, elt = pipe.micro_batch_size, 4 if precision == "fp32" else 2
    prof = view.profile(micro, precision, head_dim, False)
    static = stage_state_bytes(shape, n, first, last, cfg.train.optimizer, pipe.replicas if pipe.shard else 1, elt)
    held = inflight(pipe.schedules[rep], pipe.stages, s, max(pipe.micro_batches[rep], 1))
    sp = stage_profile(prof, n, last, static, held, buffer_bytes(shape, micro, cfg.train.seq_len, elt))
    mem = cfg.memory
    try:
        plan = plan_for_strategy(sp, resolve_budget(mem, view.facts.memory_bytes), mem.strategy, mem.granularity,
                                 mem.time_limit_s, rebuild_units(mem, False))
    except PlanError as err:
        raise PlanError(f"pipeline stage {s} (rank {rank}: {n} blocks, {held} micro-batch(es) in flight): {err}") from None
    pred, keep = simulate(sp, plan), simulate(sp, Plan(["keep"] * n))
    return {"options": plan.options, "segments": [list(x) for x in plan.segments] if plan.segments else None,
            "peak": pred.peak_bytes, "held": pred.held_bytes, "time_s": pred.time_s, "keep_s": keep.time_s,
            "summary": block_summary(sp, plan.options)}


def _chosen_layout_plan(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts) -> RunPlan:
    """`parallel.pipeline.stages: auto`: every data-parallel layout and every pipeline priced alike
    (`layouts.candidates`), the fastest that fits planned as if configured, the comparison kept."""
    ranks = facts.ranks
    precision, _ = _precision(cfg, ranks)
    head = max(_head_dim(cfg, shape, r.capability, precision) for r in ranks)
    cands = candidates(cfg, shape, Ranks([r.device for r in ranks], [r.node for r in ranks], [r.speed for r in ranks],
                                         [r.memory_bytes for r in ranks], {r.node: r.host_memory_bytes for r in ranks}),
                       precision, head, Links.declared(cfg))
    best, line = choose(cands)
    pc = cfg.parallel
    if best.stages:
        chosen = pc.model_copy(update={"strategy": best.stage_strategy,
                                       "pipeline": pc.pipeline.model_copy(update={"stages": best.stages,
                                                                                  "schedule": best.schedule})})
    else:
        mesh = MeshConfig(replicate=best.mesh[0], shard=best.mesh[1]) if best.mesh else pc.mesh
        chosen = pc.model_copy(update={"pipeline": None, "strategy": best.strategy, "mesh": mesh,
                                       "offload": best.offload})
    plan = resolve_plan(cfg.model_copy(update={"parallel": chosen}), shape, facts)
    plan.why["layout"] = line
    plan.layouts = [c.to_dict() for c in cands]
    plan.fingerprint = fingerprint(cfg, shape, ranks)
    return plan


def _torch_device(kind: str):
    import torch

    return torch.device(kind)


def _precision(cfg: RunConfig, ranks: list[RankFacts]) -> tuple[str, str]:
    if cfg.train.precision != "auto":
        return cfg.train.precision, "as configured"
    return run_precision([r.capability for r in ranks])


def _head_dim(cfg: RunConfig, shape: GPTNeoXConfig, cap: Capability, precision: str) -> int:
    try:
        return padded_head_dim(cap, precision, shape.head_dim, cfg.model.pad_head_dim)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def activation_bytes(shape: GPTNeoXConfig, seq: int, precision: str, head_dim: int, floor: bool) -> float:
    """Activation bytes of one sample, workspace margin included (`memory.analytic`)."""
    return WORKSPACE_MARGIN * activation_bytes_per_sample(shape, seq, precision, head_dim, floor)


def _shard_size(cfg: RunConfig, world: int) -> tuple[int, tuple[int, int] | None]:
    mc = cfg.parallel.mesh
    if mc.replicate is None and mc.shard is None:
        return world, None
    r = mc.replicate or world // (mc.shard or world)
    s = mc.shard or world // r
    if r * s != world:
        raise ConfigError(f"parallel.mesh replicate={mc.replicate} x shard={mc.shard} does not cover the {world} "
                          f"ranks of this job (replicate x shard must equal the world size)")
    return s, (r, s)


def _state_weights(cfg: RunConfig, ranks: list[RankFacts]) -> list[float] | None:
    """Every rank's memory, when ZeRO-1 splits the optimizer state in proportion to it and they differ."""
    memory = [r.memory_bytes for r in ranks]
    if cfg.parallel.state_shares != "memory" or any(m is None for m in memory) or len(set(memory)) == 1:
        return None
    return [float(m) for m in memory]


def _choose_strategy(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts, precision: str, heads: list[int],
                     compiled: bool) -> tuple[str, tuple[int, int] | None, str, str]:
    """(strategy, mesh, offload, why): as configured, or the least sharding under which every rank
    fits, FSDP with its shards on the host the last resort where `parallel.offload` is none."""
    pc, world, ranks = cfg.parallel, len(facts.ranks), facts.ranks
    if world == 1:
        note = f"; parallel.strategy={pc.strategy} has nothing to shard" if pc.strategy not in ("auto", "ddp") else ""
        return "single", None, pc.offload, "one process" + note
    shard, mesh = _shard_size(cfg, world)
    if pc.strategy != "auto":
        return (pc.strategy, (mesh or (1, world)) if pc.strategy in ("zero2", "fsdp") else None, pc.offload,
                "as configured")
    gather = 4 if precision == "fp32" else 2
    weights = _state_weights(cfg, ranks)
    shares = state_shares(parameter_sizes(shape), weights) if weights else None
    try:
        if cfg.memory.active and any(r.memory_bytes is not None for r in ranks):
            strategy, why = _strategy_by_plans(cfg, shape, facts, precision, heads, compiled, shard, gather, shares)
        else:
            needs = [RankNeed(r.rank, r.device, r.memory_bytes, activation_bytes(
                shape, cfg.train.seq_len, precision, h, floor=False) if r.memory_bytes is not None else 0.0)
                for r, h in zip(ranks, heads)]
            strategy, why = choose_strategy(shape, cfg.train.optimizer, needs, shard, gather, pc.offload,
                                            pc.unit_params, shares)
    except NoStrategyFits as err:
        raise ConfigError(str(err)) from None
    strategy, offload = ("fsdp", "params") if strategy == HOST_PARAMS else (strategy, pc.offload)
    if strategy == "fsdp" and offload == "params" and pc.offload == "none":
        why = f"{why}; parallel.offload=params: weight, gradient and optimizer shards on the host"
    return strategy, (mesh or (1, world)) if strategy in ("zero2", "fsdp") else None, offload, why


def _strategy_by_plans(cfg, shape, facts, precision, heads, compiled, shard, gather, shares) -> tuple[str, str]:
    """With an activation plan the planner itself says what fits: every strategy's static bytes under
    each rank's budget, at micro-batch 1; DDP with the optimizer on the host where nothing else does."""
    pc = cfg.parallel
    candidates = [s for s in STRATEGIES if not ((pc.offload == "params" and s in ("ddp", "zero1"))
                                                or (pc.offload == "optimizer" and s != "ddp"))]
    host_too = pc.offload == "none" and cfg.memory.optimizer_offload == "auto"
    no_host = cfg.memory.model_copy(update={"optimizer_offload": "off"})
    world = len(facts.ranks)

    def verdicts(view: RankView) -> dict[str, bool]:
        r = view.facts.rank
        out = {}
        for s in candidates:
            layout = _layout(s, shard, gather, pc.offload, pc.unit_params, shares[r] if shares else None, "sharded")
            out[s] = _fits(cfg, shape, view, layout, no_host, 1, precision, heads[r], compiled, world)
        if host_too:
            out[HOST_OPTIMIZER] = _fits(cfg, shape, view, ShardLayout(gather_bytes=gather), cfg.memory, 1, precision,
                                        heads[r], compiled, world)
        if pc.offload == "none":
            layout = _layout("fsdp", shard, gather, "params", pc.unit_params, None, "sharded")
            out[HOST_PARAMS] = _fits(cfg, shape, view, layout, no_host, 1, precision, heads[r], compiled, world)
        return out

    return pick_strategy(facts.gather(verdicts), [r.device for r in facts.ranks])


def _memory_plan(cfg: RunConfig, shape: GPTNeoXConfig, view: RankView, layout: ShardLayout, mem_cfg, micro: int,
                 precision: str, head_dim: int, compiled: bool, world: int) -> DevicePlan:
    """The activation plan of one rank at a micro-batch (raises PlanError where none fits); solved
    once per kind of rank."""
    key = (micro, precision, head_dim, compiled, world, layout, mem_cfg.model_dump_json(), cfg.train.optimizer)
    if key not in view.cache:
        try:
            view.cache[key] = _solve_memory_plan(cfg, shape, view, layout, mem_cfg, micro, precision, head_dim,
                                                 compiled, world)
        except PlanError as err:
            view.cache[key] = err
    if isinstance(view.cache[key], PlanError):
        raise view.cache[key]
    return view.cache[key]


def _solve_memory_plan(cfg, shape, view, layout, mem_cfg, micro, precision, head_dim, compiled, world) -> DevicePlan:
    prof = view.profile(micro, precision, head_dim, compiled)
    backend = None if world == 1 else ("nccl" if view.facts.kind == "cuda" else "gloo")
    prof.workspace_bytes = 0.0 if layout.sharded else comm_workspace(backend, prof.static.get("gradients", 0.0))
    return plan_profile(prof, shape, mem_cfg, micro, resolve_budget(mem_cfg, view.facts.memory_bytes),
                        cfg.train.optimizer, layout, compiled)


def _fits(cfg, shape, view, layout, mem_cfg, micro, precision, head_dim, compiled, world) -> bool:
    try:
        _memory_plan(cfg, shape, view, layout, mem_cfg, micro, precision, head_dim, compiled, world)
        return True
    except PlanError:
        return False


def _unit_params(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts, strategy: str, shard: int, precision: str,
                 heads: list[int], offload: str) -> tuple[int, str]:
    """FSDP's unit floor: as set, or by default `parallel.unit_params` unless a rank fits only with
    one block a unit (`memory.sharding.unit_size_that_fits`: every rank wraps the model alike)."""
    pc = cfg.parallel
    if strategy not in ("zero2", "fsdp") or "unit_params" in pc.model_fields_set:
        return pc.unit_params, "as configured" if "unit_params" in pc.model_fields_set else ""
    needs = [RankNeed(r.rank, r.device, r.memory_bytes, activation_bytes(
        shape, cfg.train.seq_len, precision, h, floor=cfg.memory.active) if r.memory_bytes is not None else 0.0)
        for r, h in zip(facts.ranks, heads)]
    units, why = unit_size_that_fits(shape, cfg.train.optimizer, needs, strategy, shard,
                                     4 if precision == "fp32" else 2, offload, pc.unit_params)
    return units, why or ""


# ------------------------------------------------------------------------------------------ balance
def _fit_sizes(cfg: RunConfig, shape: GPTNeoXConfig, view: RankView, layout: ShardLayout, precision: str,
               head_dim: int, compiled: bool, world: int) -> dict:
    """What one rank can run: its largest micro-batch, the sizes worth timing up to it, and under an
    activation plan each size's predicted slowdown over keep-all, its host optimizer's cost per step,
    and whether it must be timed under its plan (a GPU's memory is real)."""
    cap = cfg.train.micro_batch_size
    static = sum(layout.static_bytes(shape, cfg.train.optimizer).values())
    memory = view.facts.memory_bytes
    if not cfg.memory.active:
        act = activation_bytes(shape, cfg.train.seq_len, precision, head_dim, floor=False)
        limit = micro_batches_within(memory, static, act, cap)
        if limit < 1:
            need = (static + act) / 2**30
            return {"error": f"rank {view.facts.rank} ({view.facts.device}) has {memory / 2**30:.2f} GiB but the model "
                             f"needs about {need:.2f} GiB at micro-batch 1 ({static / 2**30:.2f} GiB weights, gradients "
                             f"and optimizer state, {act / 2**30:.2f} GiB activations); use a smaller model, more "
                             f"memory, or an activation plan (memory.budget: auto)"}
        whole = sum(replace(layout, accumulation="unsharded").static_bytes(shape, cfg.train.optimizer).values())
        unsharded = micro_batches_within(memory, whole, act, limit) if layout.sharded else 0
        return {"sizes": _sizes(cap, limit), "limit": limit, "unsharded_limit": unsharded}
    plans: dict[int, DevicePlan | PlanError] = {}

    def at(b: int):
        if b not in plans:
            try:
                plans[b] = _memory_plan(cfg, shape, view, layout, cfg.memory, b, precision, head_dim, compiled, world)
            except PlanError as err:
                plans[b] = err
        return plans[b]

    if isinstance(at(1), PlanError):
        return {"error": f"rank {view.facts.rank} ({view.facts.device}): {at(1)}"}
    limit = largest_fitting(lambda b: not isinstance(at(b), PlanError), cap, bisect=True)
    sizes = _sizes(cap, limit)
    real_memory = view.facts.kind == "cuda"  # a CPU's budget is declared: keep-all runs whatever it says
    return {"sizes": sizes, "limit": limit, "unsharded_limit": limit if layout.accumulation == "unsharded" else 0,
            "slowdown": {b: at(b).prediction.time_s / at(b).keep_all.time_s for b in sizes},
            "keep_all_s": {b: at(b).keep_all.time_s for b in sizes}, "offload_s": {b: at(b).offload_s for b in sizes},
            "planned": [b for b in sizes if real_memory and at(b).budget is not None
                        and at(b).keep_all.peak_bytes > at(b).budget],
            "options": {b: (at(b).plan.options, at(b).plan.segments) for b in sizes}}


def _sizes(cap: int, limit: int) -> list[int]:
    sizes = [b for b in candidate_sizes(cap) if b <= limit]
    return sizes if limit in sizes else sizes + [limit]


def _time_models(cfg: RunConfig, facts: Facts, fitted: list[dict], layouts: list[ShardLayout],
                 precision: str, heads: list[int]) -> list[TimeModel]:
    """Each rank's time model: declared speeds where every rank declares one, else its step times
    (measured or estimated), times the activation plan's predicted slowdown at each size."""
    if all(r.speed for r in facts.ranks):
        times = [{b: b / r.speed for b in f["sizes"]} for r, f in zip(facts.ranks, fitted)]
    else:
        def timed(view: RankView) -> dict[int, float]:
            f = fitted[view.facts.rank]
            plans = {b: Plan(f["options"][b][0], segments=f["options"][b][1]) for b in f.get("planned", [])}
            return view.step_times(f["sizes"], precision, layouts[view.facts.rank], plans, heads[view.facts.rank])

        times = [{int(b): t for b, t in d.items()} for d in facts.gather(timed)]
    models = []
    for t, f in zip(times, fitted):
        slowdown = {int(b): s for b, s in f.get("slowdown", {}).items() if int(b) not in f.get("planned", [])}
        costs = planned_step_costs(t, {int(b): s for b, s in f.get("keep_all_s", {}).items()},
                                   {int(b): s for b, s in f.get("offload_s", {}).items()}) if "keep_all_s" in f else []
        models.append(TimeModel(planned_points(t, slowdown), f["limit"], costs))
    return models


def _balance(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts, layout_of, precision: str, heads: list[int],
             compiled: bool) -> tuple[BalancePlan, Link | None, str]:
    """Each rank's share of the global batch and its micro-batches, priced on its time model (and,
    under FSDP, the collectives every micro-batch or every step runs), and FSDP2's accumulation."""
    world, ranks, B = len(facts.ranks), facts.ranks, cfg.train.global_batch_size
    if world == 1:
        b = cfg.train.micro_batch_size
        parts = [b] * (B // b) + ([B % b] if B % b else [])
        r = ranks[0]
        return (BalancePlan(B, "single", [RankShare(0, r.host, r.device, _gb(r.memory_bytes), 0.0, b, B, parts, 0.0)]),
                None, "")
    layouts = layout_of(cfg.parallel.accumulation if cfg.parallel.accumulation != "auto" else "sharded")
    sharded = layouts[0].sharded
    fitted = facts.gather(lambda v: _fit_sizes(cfg, shape, v, layouts[v.facts.rank], precision,
                                               heads[v.facts.rank], compiled, world))
    for f in fitted:
        if "error" in f:
            raise ConfigError(f["error"])
    models = _time_models(cfg, facts, fitted, layouts, precision, heads)
    link = facts.link(layouts[0])
    per_micro_s = per_step_s = 0.0
    if sharded:
        lay = layouts[0]
        count = collectives_per_micro_batch(shape, lay.strategy, lay.unit_params)
        sent = collective_bytes_per_step(shape, lay.strategy, lay.shard_size, 1, lay.gather_bytes)
        per_micro_s = collective_seconds(count, sent, link.latency_s, link.bytes_per_s)
        per_step_s = collective_seconds(*unsharded_accumulation_collectives(shape, lay.shard_size, lay.gather_bytes,
                                                                             lay.unit_params),
                                        link.latency_s, link.bytes_per_s)

    def solve(per_micro: float, per_step: float, unsharded: bool) -> BalancePlan:
        infos = [RankInfo(r.rank, r.host, r.device, _gb(r.memory_bytes),
                          TimeModel(m.points, f["unsharded_limit"] if unsharded else m.max_micro, m.step_costs,
                                    per_micro, per_step)) for r, m, f in zip(ranks, models, fitted)]
        try:
            if cfg.cluster.balance == "fixed":
                plan = fixed_plan(infos, B, [(a.samples, a.micro_batch_size) for a in cfg.cluster.assignments])
            elif cfg.cluster.balance == "equal":
                plan = equal_plan(infos, B)
            else:  # accumulating sharded, every micro-batch is a collective: every rank runs as many
                plan = balanced_plan(infos, B, equal_counts=sharded and not unsharded)
            return equal_counts(plan, infos) if sharded and not unsharded else plan
        except BalanceError as err:
            raise ConfigError(str(err)) from None

    if not sharded:
        return solve(0.0, 0.0, False), link, ""
    sharded_plan = solve(per_micro_s, 0.0, False) if layouts[0].accumulation == "sharded" else None
    unsharded_plan = None
    if all(f["unsharded_limit"] >= 1 for f in fitted) and cfg.parallel.may_accumulate_unsharded():
        try:
            unsharded_plan = solve(0.0, per_step_s, True)
        except ConfigError:  # a fixed share whose micro-batch fits only sharded
            if cfg.parallel.accumulation == "unsharded":
                raise
    try:
        plan, why = choose_accumulation(sharded_plan, unsharded_plan, cfg.parallel.accumulation)
    except BalanceError as err:
        raise ConfigError(str(err)) from None
    return plan, link, why


def _gb(memory: float | None) -> float | None:
    return memory / 2**30 if memory else None


def _rank_plans(cfg: RunConfig, shape: GPTNeoXConfig, facts: Facts, layouts: list[ShardLayout],
                balance: BalancePlan, precision: str, heads: list[int], compiled: bool,
                shares: list[float | None]) -> list[RankPlan]:
    """Each rank's activation plan at the micro-batch it was given (and its optimizer's place), or,
    without one, keep-all priced where the rank's figures are estimates."""
    world = len(facts.ranks)

    def plan_of(view: RankView) -> dict:
        r = view.facts.rank
        micro = balance.shares[r].micro_batch_size or 1
        out = {"static_bytes": layouts[r].static_bytes(shape, cfg.train.optimizer)}
        if not cfg.memory.active and not view.estimates:
            return out
        mem = cfg.memory if cfg.memory.active else cfg.memory.model_copy(update={"budget": None})
        try:
            dp = _memory_plan(cfg, shape, view, layouts[r], mem, micro, precision, heads[r], compiled, world)
        except PlanError as err:
            raise ConfigError(f"rank {r} ({view.facts.device}): {err}") from None
        out.update(static_bytes=layouts[r].static_bytes(shape, cfg.train.optimizer, dp.optimizer_offload),
                   optimizer_offload=dp.optimizer_offload, predicted_peak_bytes=dp.prediction.peak_bytes,
                   predicted_held_bytes=dp.prediction.held_bytes, predicted_micro_step_s=dp.prediction.time_s,
                   keep_all_micro_step_s=dp.keep_all.time_s, activation_peak_bytes=dp.prediction.activation_peak,
                   recompute_share=dp.prediction.breakdown_time["recompute"] / max(
                       sum(b.fwd_s for b in dp.profile.blocks), 1e-12))
        if cfg.memory.active:
            out.update(activation_plan=dp.plan.options, summary=dp.summary(),
                       segments=[list(s) for s in dp.plan.segments] if dp.plan.segments else None)
        return out

    rows = facts.gather(plan_of)
    plans = []
    for r, row, head in zip(facts.ranks, rows, heads):
        kernel = sdpa_backend(r.capability, precision, head) if r.kind == "cuda" else "cpu"
        plans.append(RankPlan(r.rank, r.node, r.host, r.device, r.memory_bytes, head, kernel, shares[r.rank], **row))
    if world == 1 and plans[0].predicted_micro_step_s is not None:  # one process: its step is its micro-batches
        s, p = balance.shares[0], plans[0]
        s.predicted_s = p.predicted_micro_step_s * sum(s.micro_batches) / max(s.micro_batch_size, 1)
    return plans


def fingerprint(cfg: RunConfig, shape: GPTNeoXConfig, ranks: list[RankFacts]) -> str:
    """What a plan depends on besides measurements: a saved plan with the same one is reused."""
    key = {"version": PLAN_VERSION, "shape": shape.to_dict(),
           "ranks": [{k: v for k, v in r.to_dict().items() if k != "host"} for r in ranks],
           "train": cfg.train.model_dump(mode="json", include={"seq_len", "micro_batch_size", "grad_accum",
                                                               "global_batch_tokens", "optimizer", "precision",
                                                               "compile"}),
           "model": cfg.model.model_dump(mode="json", include={"pad_head_dim"}),
           "cluster": cfg.cluster.model_dump(mode="json", include={"balance", "assignments"}),
           "memory": cfg.memory.model_dump(mode="json"), "parallel": cfg.parallel.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def rank_device_plan(cfg: RunConfig, shape: GPTNeoXConfig, facts, plan: RunPlan, rank: int) -> DevicePlan:
    """One declared rank's activation plan in full (its profile, prediction and keep-all beside
    it), as `resolve_plan` solved it: what `hetforge plan` shows in detail."""
    micro = plan.balance.shares[rank].micro_batch_size or 1
    return _memory_plan(cfg, shape, facts.views[rank], plan.layout(rank), cfg.memory, micro, plan.precision,
                        plan.ranks[rank].head_dim, plan.compile, plan.world_size)
