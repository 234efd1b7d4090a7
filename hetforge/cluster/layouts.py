"""Which layout trains fastest on these ranks and links: data parallelism (DDP, ZeRO-1/2, FSDP, and
FSDP sharded within nodes and replicated across them) or a pipeline of each stage count, priced
alike from the model's FLOPs and bytes, each rank's FLOP rate and the declared links.

A data-parallel step is the balanced compute (the global batch's FLOPs over the ranks' summed
rates) or its collectives, whichever is longer (FSDP prefetches and DDP reduces while the backward
runs, so the two overlap): the collectives of a group that spans nodes run at the inter-node link
(`cluster.inter_node_gbit`; ring collectives go at their slowest hop). Each is tried as well with
its state on the host, where the strategy allows: DDP with optimizer offload, ZeRO-2 and FSDP with
FSDP2's parameter offload; that adds the host's AdamW step over the rank's parameters and the
copies over the card's host link, and the node's ranks together must fit its host memory
(`memory_gb` of a node in the cluster file) where that is declared. A pipeline's step is
(micro-batches + (stages - 1) / chunks) slots of its slowest stage, a slot being the stage's
compute or its boundary's traffic (activations forward, their gradients back, once per chunk),
whichever is longer, then the sum of a stage's gradients over its replicas; where the schedule is
auto, each stage count is priced with 1F1B (or GPipe) and with the interleaved schedule, and where
a stage has replicas, also with each stage sharded over them (FSDP2: its state divided, its
weights gathered once a step and its gradients reduce-scattered in place of the all-reduce). A layout fits when every rank's static bytes and
activations fit its memory. The plan records every candidate, and says why the chosen one beat the
runner-up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hetforge.cluster.pipeline_plan import plan_pipeline, rank_rates
from hetforge.config import ConfigError, PipelineConfig, RunConfig
from hetforge.core.sizes import format_bytes
from hetforge.core.hardware import lookup
from hetforge.memory.analytic import HOST_STEP_S_PER_PARAM, trace
from hetforge.model.accounting import (GRAD_BYTES, WEIGHT_BYTES, boundary_bytes, collective_bytes_per_step, count_parameters,
                                       flops_per_token, sharded_static_bytes, stage_parameters)
from hetforge.model.gpt_neox import GPTNeoXConfig

WORKSPACE = 1.15
ASSUMED_LINK_GBPS = 10.0  # GB/s between ranks, where neither declared nor measured (`hetforge plan --cluster`)
LINK_LATENCY_S = 50e-6  # per collective, where the link is declared


@dataclass(frozen=True)
class Links:
    """Bytes per second and seconds per message within a node and between nodes."""

    intra_bytes_per_s: float
    inter_bytes_per_s: float
    latency_s: float

    def between(self, spans_nodes: bool) -> float:
        return self.inter_bytes_per_s if spans_nodes else self.intra_bytes_per_s

    @classmethod
    def declared(cls, cfg: RunConfig) -> "Links":
        """Within a node `parallel.link_gbps` (GB/s; else an assumed figure), between nodes
        `cluster.inter_node_gbit` (Gbit/s; else the same)."""
        intra = (cfg.parallel.link_gbps or ASSUMED_LINK_GBPS) * 1e9
        inter = cfg.cluster.inter_node_gbit * 1e9 / 8 if cfg.cluster.inter_node_gbit else intra
        latency = cfg.parallel.link_latency_us * 1e-6 if cfg.parallel.link_gbps else LINK_LATENCY_S
        return cls(intra, inter, latency)


@dataclass
class Candidate:
    layout: str  # what the table shows
    strategy: str  # ddp | zero1 | zero2 | fsdp | pipeline
    mesh: tuple[int, int] | None  # (replicate, shard) for FSDP within nodes
    stages: int | None
    fits: bool
    step_s: float | None
    compute_s: float
    comm_s: float
    bubble: float
    peak_bytes: float
    note: str  # why it does not fit, or what its time is made of
    offload: str = "none"  # parallel.offload: none | optimizer | params
    host_s: float = 0.0  # the host's optimizer step and the copies to and from it
    schedule: str | None = None  # a pipeline's parallel.pipeline.schedule
    stage_strategy: str = "ddp"  # a pipeline's stages replicated (ddp) or sharded (fsdp) over their replicas

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_bytes"] = None if math.isinf(self.peak_bytes) else self.peak_bytes  # JSON has no infinity
        return d


OFFLOADS = {"ddp": ("none", "optimizer"), "zero1": ("none",), "zero2": ("none", "params"),
            "fsdp": ("none", "params")}  # what parallel.offload each strategy takes


@dataclass(frozen=True)
class Ranks:
    """The ranks a layout is priced for: device names, node indices, declared speeds, the bytes
    a plan may use on each device, and each node's host memory (None: not declared)."""

    devices: list[str]
    nodes: list[int]
    speeds: list[float | None]
    memory: list[float | None]
    host_memory: dict[int, float | None]


def candidates(cfg: RunConfig, shape: GPTNeoXConfig, ranks: Ranks, precision: str, head_dim: int,
               links: Links) -> list[Candidate]:
    """Every layout for these ranks, priced (those that do not fit say why)."""
    rates = rank_rates(cfg, ranks.devices, ranks.speeds, precision)
    world, nodes = len(ranks.devices), ranks.nodes
    meshes: list[tuple[int, int] | None] = [None]
    per_node = world // max(len(set(nodes)), 1)
    if len(set(nodes)) > 1 and per_node > 1 and all(nodes.count(n) == per_node for n in set(nodes)):
        meshes.append((len(set(nodes)), per_node))
    cards = all(d != "cpu" for d in ranks.devices)  # a CPU's memory is the host's: nothing to offload to
    out = [_data_parallel(cfg, shape, s, mesh, offload, rates, ranks, precision, head_dim, links)
           for mesh in meshes for s in (OFFLOADS if mesh is None else ("fsdp",))
           for offload in (OFFLOADS[s] if cards else ("none",))]
    pc = cfg.parallel.pipeline
    schedules = [pc.schedule if pc is not None else "auto"]
    if schedules[0] == "auto" and not cfg.memory.active:  # per-stage activation plans run 1F1B or GPipe
        schedules.append("interleaved")
    for stages in range(2, min(world, shape.n_layers) + 1):
        if world % stages:
            continue
        for schedule in schedules:
            if schedule != "interleaved" or 2 * stages <= shape.n_layers:
                out.append(_pipeline(cfg, shape, stages, schedule, "ddp", ranks, precision, head_dim, links))
        if world > stages and schedules[0] != "interleaved":
            out.append(_pipeline(cfg, shape, stages, schedules[0], "fsdp", ranks, precision, head_dim, links))
    return out


def choose(cands: list[Candidate]) -> tuple[Candidate, str]:
    """The fastest layout that fits, and one line on why (against the runner-up)."""
    fitting = sorted((c for c in cands if c.fits), key=lambda c: c.step_s)
    if not fitting:
        shortest = min(cands, key=lambda c: c.peak_bytes)
        raise ConfigError(f"no layout fits: the least memory-hungry ({shortest.layout}) {shortest.note}")
    best = fitting[0]
    if len(fitting) == 1:
        return best, f"{best.layout}: the only layout that fits ({_parts(best)})"
    runner = fitting[1]
    return best, (f"{best.layout}: {best.step_s:.3g} s a step ({_parts(best)}) against {runner.layout}'s "
                  f"{runner.step_s:.3g} s ({_parts(runner)})")


def _parts(c: Candidate) -> str:
    text = f"compute {c.compute_s:.3g} s, communication {c.comm_s:.3g} s"
    text += f", host {c.host_s:.3g} s" if c.offload != "none" else ""
    return text + (f", bubble {c.bubble:.0%}" if c.stages else "")


def _activations(cfg: RunConfig, shape, static: float, memory: list[float | None], precision: str,
                 head_dim: int) -> tuple[float, float]:
    """(activation bytes, compute factor): every activation kept, or where that does not fit a rank
    and the run makes an activation plan (`memory.budget`), every block recomputed: the blocks'
    inputs held, and one block's whole working set while it runs (a second forward: 4/3 of the
    step's FLOPs; the planner's per-tensor choice lies between the two)."""
    micro, seq = cfg.train.micro_batch_size, cfg.train.seq_len
    t = trace(shape, micro, seq, precision, head_dim)
    block = sum(u.bytes for u in t.units)
    kept = shape.n_layers * block + t.head_held
    if not cfg.memory.active or all(m is None or WORKSPACE * (static + kept) <= m for m in memory):
        return kept, 1.0
    inputs = shape.n_layers * boundary_bytes(shape, micro, seq, 4 if precision == "fp32" else 2)
    return inputs + block + t.head_held, 4 / 3


def _data_parallel(cfg, shape, strategy, mesh, offload, rates, ranks: Ranks, precision, head_dim, links) -> Candidate:
    world, micro, seq = len(rates), cfg.train.micro_batch_size, cfg.train.seq_len
    nodes, memory = ranks.nodes, ranks.memory
    shard = mesh[1] if mesh else world
    gather = 4 if precision == "fp32" else 2
    static = sum(sharded_static_bytes(shape, cfg.train.optimizer, strategy, shard, offload, gather,
                                      cfg.parallel.unit_params).values())
    activations, recompute = _activations(cfg, shape, static, memory, precision, head_dim)
    peak = WORKSPACE * (static + activations)
    short = [r for r, m in enumerate(memory) if m is not None and peak > m]
    gb = cfg.train.global_batch_size
    compute = recompute * gb * seq * flops_per_token(shape, seq) / sum(rates)
    micro_batches = math.ceil(gb / (world * micro))
    spans = len(set(nodes)) > 1
    if mesh:  # shard within each node, then the gradient shards summed across the nodes
        n = count_parameters(shape)["total"]
        inside = collective_bytes_per_step(shape, strategy, shard, micro_batches, gather)
        across = 2 * GRAD_BYTES * n / shard * (mesh[0] - 1) / mesh[0]
        comm = inside / links.intra_bytes_per_s + across / links.inter_bytes_per_s
        name = f"fsdp within nodes ({mesh[0]} x {mesh[1]})"
    else:
        sent = collective_bytes_per_step(shape, strategy, world, micro_batches, gather)
        comm = sent / links.between(spans) if world > 1 else 0.0
        name = strategy
    comm += (2 * micro_batches if strategy in ("zero2", "fsdp") else 2) * links.latency_s * (world > 1)
    note = (f"needs {format_bytes(peak)} a rank; rank {short[0]} has {format_bytes(memory[short[0]])}" if short
            else f"{format_bytes(peak)} a rank" + (", blocks recomputed" if recompute > 1 else ""))
    host_s, host_short = 0.0, ""
    if offload != "none":
        name += f" + {offload} offload"
        host_s, host_short = _host_side(cfg, shape, strategy, shard, offload, gather, micro_batches, ranks)
    return Candidate(name, strategy, mesh, None, not short and not host_short, max(compute, comm) + host_s, compute,
                     comm, 0.0, peak, note if short or not host_short else host_short, offload, host_s)


def offload_seconds(shape: GPTNeoXConfig, shard: int, offload: str, gather: int, micro_batches: int,
                    devices: list[str]) -> float:
    """Seconds a step spends on the host under `offload`: its AdamW step over the parameters the
    rank owns, and the copies over the slowest card's host link (shards in for both gathers and
    gradients out every micro-batch under params; gradients out and weights in once a step under
    optimizer). A CPU rank copies nothing."""
    if offload == "none":
        return 0.0
    owned = count_parameters(shape)["total"] / (shard if offload == "params" else 1)
    copies = (2 * WEIGHT_BYTES + GRAD_BYTES) * owned * micro_batches if offload == "params" \
        else (gather + GRAD_BYTES) * owned
    links = [card.link_gbps * 1e9 for card in map(lookup, devices) if card is not None]
    return HOST_STEP_S_PER_PARAM * owned + (copies / min(links) if links else 0.0)


def _host_side(cfg, shape, strategy, shard, offload, gather, micro_batches, ranks: Ranks) -> tuple[float, str]:
    """Seconds a step spends on the host (`offload_seconds`), and why the nodes' host memory does
    not hold the offloaded state ("" where it does, or is not declared)."""
    kept = sum(sharded_static_bytes(shape, cfg.train.optimizer, strategy, shard, "none", gather).values())
    moved = kept - sum(sharded_static_bytes(shape, cfg.train.optimizer, strategy, shard, offload, gather).values())
    seconds = offload_seconds(shape, shard, offload, gather, micro_batches, ranks.devices)
    for node, limit in sorted(ranks.host_memory.items()):
        need = moved * ranks.nodes.count(node)
        if limit is not None and need > limit:
            return seconds, (f"node {node}'s host needs {format_bytes(need)} for its ranks' offloaded state; it has "
                             f"{format_bytes(limit)}")
    return seconds, ""


def _pipeline(cfg, shape, stages, schedule, stage_strategy, ranks: Ranks, precision, head_dim, links) -> Candidate:
    nodes = ranks.nodes
    name = f"pipeline {stages} stages x {len(ranks.devices) // stages}"
    pc = cfg.parallel.pipeline or PipelineConfig(stages="auto")
    if schedule == "interleaved":
        name += f" interleaved x{pc.virtual_stages}"
    if stage_strategy == "fsdp":
        name += ", stages sharded"
    trial = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={
        "strategy": stage_strategy,
        "pipeline": pc.model_copy(update={"stages": stages, "layers": None, "schedule": schedule})})})
    try:
        pipe = plan_pipeline(trial, shape, ranks.devices, ranks.speeds, ranks.memory, precision, head_dim)
    except ConfigError as err:
        return Candidate(name, "pipeline", None, stages, False, None, 0.0, 0.0, 0.0, float("inf"), str(err),
                         schedule=schedule, stage_strategy=stage_strategy)
    seq, micro = cfg.train.seq_len, pipe.micro_batch_size
    elt = 4 if precision == "fp32" else 2
    step = busy = traffic = 0.0
    for r in range(pipe.replicas):
        chain, n = pipe.pipeline_ranks(r), pipe.micro_batches[r]
        computes = pipe.stage_micro_s  # a micro-batch's forward and backward on each stage's slowest rank
        pairs = [(s, s + 1) for s in range(stages - 1)] + ([(stages - 1, 0)] if pipe.virtual > 1 else [])
        hops = [pipe.virtual * (boundary_bytes(shape, micro, seq, elt) / links.between(nodes[chain[a]] != nodes[chain[b]])
                                + links.latency_s) for a, b in pairs]  # once per chunk a micro-batch passes
        slot = max(computes + hops)
        step = max(step, pipe.slots(r) * slot)
        busy, traffic = max(busy, n * max(computes)), max(traffic, n * max(hops))
    reduce = 0.0
    if pipe.replicas > 1:  # a stage's gradients summed over its replicas, after the schedule (all-reduced, or
        # reduce-scattered and its weights gathered at the step's first forward where sharded)
        per_param = GRAD_BYTES + elt if pipe.shard else 2 * GRAD_BYTES
        for s in range(stages):
            group = pipe.stage_ranks(s)
            sent = per_param * stage_parameters(shape, pipe.layers[s], s == 0, s == stages - 1) \
                * (pipe.replicas - 1) / pipe.replicas
            reduce = max(reduce, sent / links.between(len({nodes[x] for x in group}) > 1) + links.latency_s)
    bubble = max(pipe.bubble(r) for r in range(pipe.replicas))
    return Candidate(f"{name} (blocks {'+'.join(map(str, pipe.layers))})", "pipeline", None, stages, True,
                     step + reduce, busy, traffic + reduce, bubble, max(pipe.stage_bytes), pipe.why, schedule=schedule,
                     stage_strategy=stage_strategy)
