"""Which layout trains fastest on these ranks and links: data parallelism (DDP, ZeRO-1/2, FSDP, and
FSDP sharded within nodes and replicated across them) or a pipeline of each stage count, priced
alike from the model's FLOPs and bytes, each rank's FLOP rate and the declared links.

A data-parallel step is the balanced compute (the global batch's FLOPs over the ranks' summed
rates) or its collectives, whichever is longer (FSDP prefetches and DDP reduces while the backward
runs, so the two overlap): the collectives of a group that spans nodes run at the inter-node link
(`cluster.inter_node_gbit`; ring collectives go at their slowest hop). A pipeline's step is
(micro-batches + stages - 1) slots of its slowest stage, a slot being the stage's compute or its
boundary's traffic (activations forward, their gradients back), whichever is longer, then the sum
of a stage's gradients over its replicas. A layout fits when every rank's static bytes and
activations fit its memory. The plan records every candidate, and says why the chosen one beat the
runner-up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hetforge.cluster.pipeline_plan import plan_pipeline, rank_rates
from hetforge.config import ConfigError, RunConfig
from hetforge.core.sizes import format_bytes
from hetforge.memory.analytic import trace
from hetforge.model.accounting import (GRAD_BYTES, boundary_bytes, collective_bytes_per_step, count_parameters,
                                       flops_per_token, sharded_static_bytes, stage_flops_per_sample, stage_parameters)
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_bytes"] = None if math.isinf(self.peak_bytes) else self.peak_bytes  # JSON has no infinity
        return d


def candidates(cfg: RunConfig, shape: GPTNeoXConfig, devices: list[str], nodes: list[int], speeds: list[float | None],
               memory: list[float | None], precision: str, head_dim: int, links: Links) -> list[Candidate]:
    """Every layout for these ranks, priced (those that do not fit say why)."""
    rates = rank_rates(cfg, devices, speeds, precision)
    world = len(devices)
    out = [_data_parallel(cfg, shape, s, None, rates, nodes, memory, precision, head_dim, links)
           for s in ("ddp", "zero1", "zero2", "fsdp")]
    per_node = world // max(len(set(nodes)), 1)
    if len(set(nodes)) > 1 and per_node > 1 and all(nodes.count(n) == per_node for n in set(nodes)):
        out.append(_data_parallel(cfg, shape, "fsdp", (len(set(nodes)), per_node), rates, nodes, memory, precision,
                                  head_dim, links))
    for stages in range(2, min(world, shape.n_layers) + 1):
        if world % stages == 0:
            out.append(_pipeline(cfg, shape, stages, devices, nodes, speeds, memory, precision, head_dim, links, rates))
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
    return text + (f", bubble {c.bubble:.0%}" if c.stages else "")


def _activation_bytes(shape: GPTNeoXConfig, micro: int, seq: int, precision: str, head_dim: int) -> float:
    t = trace(shape, micro, seq, precision, head_dim)
    return shape.n_layers * sum(u.bytes for u in t.units) + t.head_held


def _data_parallel(cfg, shape, strategy, mesh, rates, nodes, memory, precision, head_dim, links) -> Candidate:
    world, micro, seq = len(rates), cfg.train.micro_batch_size, cfg.train.seq_len
    shard = mesh[1] if mesh else world
    gather = 4 if precision == "fp32" else 2
    static = sharded_static_bytes(shape, cfg.train.optimizer, strategy, shard, "none", gather, cfg.parallel.unit_params)
    peak = WORKSPACE * (sum(static.values()) + _activation_bytes(shape, micro, seq, precision, head_dim))
    short = [r for r, m in enumerate(memory) if m is not None and peak > m]
    gb = cfg.train.global_batch_size
    compute = gb * seq * flops_per_token(shape, seq) / sum(rates)
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
            else f"{format_bytes(peak)} a rank")
    return Candidate(name, strategy, mesh, None, not short, max(compute, comm), compute, comm, 0.0, peak, note)


def _pipeline(cfg, shape, stages, devices, nodes, speeds, memory, precision, head_dim, links, rates) -> Candidate:
    name = f"pipeline {stages} stages x {len(devices) // stages}"
    trial = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={
        "pipeline": cfg.parallel.pipeline.model_copy(update={"stages": stages, "layers": None})})})
    try:
        pipe = plan_pipeline(trial, shape, devices, speeds, memory, precision, head_dim)
    except ConfigError as err:
        return Candidate(name, "pipeline", None, stages, False, None, 0.0, 0.0, 0.0, float("inf"), str(err))
    seq, micro = cfg.train.seq_len, pipe.micro_batch_size
    elt = 4 if precision == "fp32" else 2
    step = busy = traffic = 0.0
    for r in range(pipe.replicas):
        ranks, n = pipe.pipeline_ranks(r), pipe.micro_batches[r]
        computes = [stage_flops_per_sample(shape, seq, pipe.layers[s], s == stages - 1) * micro
                    / min(rates[x] for x in pipe.stage_ranks(s)) for s in range(stages)]
        hops = [boundary_bytes(shape, micro, seq, elt) / links.between(nodes[ranks[s]] != nodes[ranks[s + 1]])
                + links.latency_s for s in range(stages - 1)]
        slot = max(computes + hops)
        step = max(step, (n + stages - 1) * slot if n else 0.0)
        busy, traffic = max(busy, n * max(computes)), max(traffic, n * max(hops))
    reduce = 0.0
    if pipe.replicas > 1:  # a stage's gradients summed over its replicas, after the schedule
        for s in range(stages):
            group = pipe.stage_ranks(s)
            sent = 2 * GRAD_BYTES * stage_parameters(shape, pipe.layers[s], s == 0, s == stages - 1) \
                * (pipe.replicas - 1) / pipe.replicas
            reduce = max(reduce, sent / links.between(len({nodes[x] for x in group}) > 1) + links.latency_s)
    bubble = max(pipe.bubble(r) for r in range(pipe.replicas))
    return Candidate(f"{name} (blocks {'+'.join(map(str, pipe.layers))})", "pipeline", None, stages, True,
                     step + reduce, busy, traffic + reduce, bubble, max(pipe.stage_bytes), pipe.why)
