"""A pipeline's layout, decided once from the ranks' facts: blocks per stage, micro-batches per
replica, each replica's schedule, and what that predicts.

Ranks are stage-major: rank = stage x replicas + replica, so the replicas of a stage (whose
gradients are reduced together every step) are neighbouring ranks, on one node where they fit,
and only activations cross a stage boundary. A stage is as slow as its slowest rank; blocks are
split to minimise the slowest stage's time per micro-batch (each rank's FLOP rate from its card's
peak at the run's precision, in the ratios of declared speeds where every rank has one), under
each stage's memory: its parameters' weights, gradients and AdamW state, and the activations of
the micro-batches it holds at once (1F1B: stages - stage, at most the micro-batch count; GPipe:
all of them). Where kept activations do not fit, each stage recomputes the fewest of its blocks
that make it fit (`parallel.pipeline.recompute: blocks`: all of them): a recomputed block holds
only its input per in-flight micro-batch, one block's working set lives while it runs again, and
it costs 4/3 of its FLOPs. The split weighs that cost too.

With the interleaved schedule each rank of a pipeline holds `virtual` chunks of its blocks (virtual
stages, looped: chunk c of stage p is virtual stage c x stages + p), so a micro-batch passes each
rank `virtual` times: the fill and drain shrink to (stages - 1) / virtual slots, for `virtual` times
the boundary traffic and more micro-batches' activations in flight (PyTorch's warm-up count).

With `parallel.strategy: fsdp` each stage's weights, gradients and optimizer state are sharded over
its replicas (FSDP2, as PyTorch's schedules drive it): gathered once at a step's first forward and
kept through its micro-batches, the gradients accumulated unsharded and reduce-scattered once after
the last, so a replica's micro-batch count does not change its collectives.

Replicas get whole micro-batches of one size (a stage's buffers are sized by the first one): in
proportion to their speed with `cluster.balance: auto`, equal parts with `equal`, and with `fixed`
the `cluster.assignments` given per replica. A replica's step takes (micro-batches + stages - 1)
slots of its slowest stage (the pipeline fills and drains once per step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hetforge.config import RunConfig
from hetforge.core.errors import ConfigError
from hetforge.core.hardware import lookup
from hetforge.core.sizes import format_bytes
from hetforge.memory.analytic import EFFICIENCY, trace
from hetforge.model.accounting import boundary_bytes, stage_flops_per_sample, stage_static_bytes
from hetforge.model.gpt_neox import GPTNeoXConfig

WORKSPACE = 1.15  # allocator and kernel scratch above what the stage's tensors need
CPU_TFLOPS = 0.2  # a CPU rank's peak where train.peak_tflops does not say


@dataclass
class PipelinePlan:
    stages: int
    replicas: int
    layers: list[int]  # blocks per stage, first to last
    micro_batch_size: int
    micro_batches: list[int]  # per replica
    schedules: list[str]  # per replica: 1f1b | gpipe
    stage_micro_s: list[float]  # a micro-batch's forward and backward on each stage (its slowest rank), relative
    stage_bytes: list[float]  # predicted peak bytes of each stage's ranks
    why: str
    recomputed: list[int] | None = None  # per stage, how many of its blocks (its first) are recomputed in the backward
    virtual: int = 1  # chunks (virtual stages) per rank: above 1 under the interleaved schedule
    shard: bool = False  # each stage's state sharded over its replicas (FSDP2; parallel.strategy fsdp)

    def stage_of(self, rank: int) -> int:
        return rank // self.replicas

    def replica_of(self, rank: int) -> int:
        return rank % self.replicas

    def recomputed_blocks(self, stage: int) -> set[int]:
        """The blocks of a stage recomputed in their backward: its first `recomputed[stage]`."""
        return set(self.blocks(stage)[:self.recomputed[stage]]) if self.recomputed else set()

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.virtual

    def chunk_layers(self, stage: int) -> list[int]:
        """The stage's blocks in its `virtual` chunks, as even as can be (the larger ones first)."""
        n, v = self.layers[stage], self.virtual
        return [n // v + (c < n % v) for c in range(v)]

    def virtual_blocks(self, index: int) -> range:
        """The blocks of virtual stage `index` (chunk index // stages of stage index % stages)."""
        start = sum(self.chunk_layers(g % self.stages)[g // self.stages] for g in range(index))
        return range(start, start + self.chunk_layers(index % self.stages)[index // self.stages])

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages a stage's ranks run, first to last."""
        return [c * self.stages + stage for c in range(self.virtual)]

    def blocks(self, stage: int) -> list[int]:
        """Every block a stage's ranks hold."""
        return [i for g in self.chunks(stage) for i in self.virtual_blocks(g)]

    def blocks_text(self, stage: int) -> str:
        return ",".join(f"{b.start}-{b.stop - 1}" for b in map(self.virtual_blocks, self.chunks(stage)))

    def slots(self, replica: int) -> float:
        """A replica's step in micro-batch slots of its slowest stage: its micro-batches, and the
        fill and drain ((stages - 1) / virtual)."""
        n = self.micro_batches[replica]
        return n + (self.stages - 1) / self.virtual if n else 0.0

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [s * self.replicas + replica for s in range(self.stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        return [stage * self.replicas + r for r in range(self.replicas)]

    def bubble(self, replica: int) -> float:
        """The share of the replica's step its stages idle while the pipeline fills and drains."""
        return (self.stages - 1) / self.virtual / self.slots(replica) if self.micro_batches[replica] else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PipelinePlan":
        return cls(**d)


def rank_rates(cfg: RunConfig, devices: list[str], speeds: list[float | None], precision: str) -> list[float]:
    """FLOP/s each rank reaches training: its card's peak at the run's precision times the
    roofline's efficiency (a CPU's from train.peak_tflops, else an assumed figure: between CPUs only
    the ratios matter); declared speeds, where every rank has one, set the ratios instead."""
    out = []
    for name in devices:
        card = lookup(name) if name != "cpu" else None
        peak = card.peak_tflops(precision) if card is not None else (cfg.train.peak_tflops or CPU_TFLOPS)
        out.append(peak * 1e12 * EFFICIENCY)
    if all(s is not None for s in speeds):
        mean_speed, mean_rate = sum(speeds) / len(speeds), sum(out) / len(out)
        out = [mean_rate * s / mean_speed for s in speeds]
    return out


def inflight(schedule: str, stages: int, stage: int, micro_batches: int, virtual: int = 1) -> int:
    """Micro-batches whose activations a stage holds at once; under the interleaved schedule,
    chunk micro-batches (PyTorch's warm-up forwards, then one more before the first backward)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "interleaved":
        per_round = micro_batches // max(1, micro_batches // stages)
        return min((virtual - 1) * per_round + 2 * (stages - 1 - stage) + 1, micro_batches * virtual)
    return min(stages - stage, micro_batches)


def buffer_bytes(shape: GPTNeoXConfig, micro_batch: int, seq_len: int, dtype_bytes: int, virtual: int = 1) -> float:
    """A stage's send and receive buffers: activations received and gradients sent, both ways,
    per chunk."""
    return 4.0 * virtual * boundary_bytes(shape, micro_batch, seq_len, dtype_bytes)


def interleaved_fits(micro_batches: int, stages: int) -> bool:
    """PyTorch's interleaved 1F1B runs micro-batches in rounds of equal size (max(1, n // stages) of them)."""
    return micro_batches % max(1, micro_batches // stages) == 0


def split_blocks(n_layers: int, costs: list[tuple[float, float]], memory: list[float | None],
                 bytes_of, least: int = 1) -> list[int]:
    """Blocks per stage (at least `least` each) minimising the slowest stage's time, within each stage's memory.
    `costs[s]` = (seconds per block, fixed seconds of the stage: embedding or head, rate divisor
    folded in); `bytes_of(stage, blocks)` = the stage's peak bytes. Exact (dynamic programming
    over the cut points); raises ConfigError naming the stage and its shortfall when no split fits."""
    stages = len(costs)
    inf = float("inf")
    # best[s][k]: the least max stage time of stages 0..s-1 covering the first k blocks
    best = [[inf] * (n_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(stages):
        per_block, fixed = costs[s][0], costs[s][1]
        for k in range(s * least, n_layers + 1):
            if best[s][k] == inf:
                continue
            for n in range(least, n_layers - k - least * (stages - s - 1) + 1):
                if memory[s] is not None and bytes_of(s, n) > memory[s]:
                    break
                t = max(best[s][k], fixed + n * per_block)
                if t < best[s + 1][k + n]:
                    best[s + 1][k + n], cut[s + 1][k + n] = t, n
    if best[stages][n_layers] == inf:
        need = [(s, bytes_of(s, least), memory[s]) for s in range(stages)
                if memory[s] is not None and bytes_of(s, least) > memory[s]]
        if need:
            s, b, m = need[0]
            raise ConfigError(f"pipeline stage {s} does not fit even with {'one block' if least == 1 else f'{least} blocks'}: it needs {format_bytes(b)} of "
                              f"{format_bytes(m)} (short by {format_bytes(b - m)}); use more stages or a smaller "
                              f"micro-batch")
        raise ConfigError(f"no split of {n_layers} blocks into {stages} stages fits every stage's memory; use more "
                          f"stages, a smaller micro-batch, or declare parallel.pipeline.layers")
    layers, k = [], n_layers
    for s in range(stages, 0, -1):
        layers.append(cut[s][k])
        k -= cut[s][k]
    return layers[::-1]


def micro_counts(cfg: RunConfig, replicas: int, micro: int, replica_rates: list[float]) -> list[int]:
    """Micro-batches per replica: fixed (cluster.assignments, one per replica), equal, or in
    proportion to speed (largest remainders), all of `micro` samples."""
    gb = cfg.train.global_batch_size
    if cfg.cluster.balance == "fixed":
        got = cfg.cluster.assignments
        if len(got) != replicas:
            raise ConfigError(f"cluster.assignments has {len(got)} entries for {replicas} pipeline replicas; under "
                              f"parallel.pipeline give one per replica")
        if any(a.micro_batch_size != micro or a.samples % micro for a in got):
            raise ConfigError(f"under parallel.pipeline every replica's micro-batch is train.micro_batch_size={micro} "
                              f"and its samples a multiple of it (cluster.assignments: "
                              f"{[(a.samples, a.micro_batch_size) for a in got]})")
        return [a.samples // micro for a in got]
    if gb % micro:
        raise ConfigError(f"under parallel.pipeline the global batch ({gb} samples) must be a multiple of "
                          f"train.micro_batch_size ({micro}): replicas take whole micro-batches")
    total = gb // micro
    weights = [1.0] * replicas if cfg.cluster.balance == "equal" else replica_rates
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(e) for e in exact]
    for r in sorted(range(replicas), key=lambda r: counts[r] - exact[r])[:total - sum(counts)]:
        counts[r] += 1
    return counts


def plan_pipeline(cfg: RunConfig, shape: GPTNeoXConfig, devices: list[str], speeds: list[float | None],
                  memory: list[float | None], precision: str, head_dim: int) -> PipelinePlan:
    """The layout for `cfg.parallel.pipeline` on these ranks (in rank order)."""
    pc, world = cfg.parallel.pipeline, len(devices)
    stages, seq, micro = pc.stages, cfg.train.seq_len, cfg.train.micro_batch_size
    if world % stages:
        raise ConfigError(f"parallel.pipeline.stages={stages} does not divide the {world} ranks of this job; "
                          f"launch a multiple of {stages} ranks")
    if stages > shape.n_layers:
        raise ConfigError(f"parallel.pipeline.stages={stages} is more than the model's {shape.n_layers} blocks")
    replicas = world // stages
    virtual = pc.virtual_stages if pc.schedule == "interleaved" else 1
    gather = 4 if precision == "fp32" else 2
    if stages * virtual > shape.n_layers:
        raise ConfigError(f"parallel.pipeline: {stages} stages x {virtual} chunks each need {stages * virtual} blocks; "
                          f"the model has {shape.n_layers}")
    rates = rank_rates(cfg, devices, speeds, precision)
    stage_rate = [min(rates[s * replicas + r] for r in range(replicas)) for s in range(stages)]
    replica_rate = [min(rates[s * replicas + r] for s in range(stages)) for r in range(replicas)]
    counts = micro_counts(cfg, replicas, micro, replica_rate)
    schedules = [_schedule(pc.schedule, n, stages) for n in counts]
    stage_mem = [min((memory[s * replicas + r] for r in range(replicas) if memory[s * replicas + r] is not None),
                     default=None) for s in range(stages)]
    t = trace(shape, micro, seq, precision, head_dim)
    block_act, head_act = sum(u.bytes for u in t.units), t.head_held
    boundary = boundary_bytes(shape, micro, seq, gather)
    most = max(counts, default=1) or 1
    held_schedule = schedules[0] if len(set(schedules)) == 1 else "gpipe"

    def split(recompute: str, shard: bool) -> tuple[list[int], str, list[float], list[float], list[int]]:
        """The split with `recompute` none (every activation kept), all (every block recomputed)
        or fit (per stage, the fewest blocks recomputed that fit its memory)."""
        def bytes_at(s: int, n: int, r: int) -> float:
            first, last = s == 0, s == stages - 1
            held = inflight(held_schedule, stages, s, most, virtual)
            # a held micro-batch holds one chunk's blocks: per block, held x chunk / n of them
            per_block = held * -(-n // virtual) / n if n else 0.0
            head = head_act * (1 if virtual > 1 else held) if last else 0.0
            # a kept block saves all its activations, a recomputed one its input, and one
            # recomputed block's whole working set lives while its backward runs
            act = per_block * ((n - r) * block_act + r * boundary) + head + (block_act if r else 0.0)
            buffers = buffer_bytes(shape, micro, seq, gather, virtual)
            static = stage_static_bytes(shape, n, first, last, cfg.train.optimizer, replicas if shard else 1, gather)
            return WORKSPACE * (static + act + buffers)

        def redone(s: int, n: int) -> int:
            if recompute != "fit" or stage_mem[s] is None:
                return n if recompute == "all" else 0
            return next((r for r in range(n + 1) if bytes_at(s, n, r) <= stage_mem[s]), n)

        def bytes_of(s: int, n: int) -> float:
            return bytes_at(s, n, redone(s, n))

        def cost(s: int, n: int) -> float:
            last = s == stages - 1
            per_block = stage_flops_per_sample(shape, seq, 1, False)
            blocks = per_block * (n + redone(s, n) / 3)  # a recomputed block's second forward: 1/3 of its cost
            return (blocks + stage_flops_per_sample(shape, seq, 0, last)) * micro / stage_rate[s]

        if pc.layers is not None:
            layers, how = list(pc.layers), "as configured"
            for s, n in enumerate(layers):
                if stage_mem[s] is not None and bytes_of(s, n) > stage_mem[s]:
                    raise ConfigError(f"pipeline stage {s} ({n} blocks) needs {format_bytes(bytes_of(s, n))} but its "
                                      f"ranks have {format_bytes(stage_mem[s])} (short by "
                                      f"{format_bytes(bytes_of(s, n) - stage_mem[s])}); move blocks off it")
        else:
            costs = [(cost(s, 1) - cost(s, 0), cost(s, 0)) for s in range(stages)]
            layers = split_blocks(shape.n_layers, costs, stage_mem, bytes_of, least=virtual)
            how = "sized to each stage's speed and memory"
        return (layers, how, [cost(s, n) for s, n in enumerate(layers)], [bytes_of(s, n) for s, n in enumerate(layers)],
                [redone(s, n) for s, n in enumerate(layers)])

    # the ways to hold a stage, cheapest first: every activation kept, replicated then sharded (a
    # gather and reduce-scatter a step); then the fewest blocks recomputed per stage (a third of
    # their FLOPs again), replicated then sharded; what the config fixes is not varied
    recomputes = {"none": ["none"], "blocks": ["all"], "auto": ["none", "fit"]}[pc.recompute]
    if cfg.memory.active:  # a per-tensor plan per stage decides; recomputed blocks only size the split
        recomputes = ["none", "fit"]
    shards = [False] if replicas == 1 or virtual > 1 else \
        {"fsdp": [True], "auto": [False, True]}.get(cfg.parallel.strategy, [False])
    tries = [(r, sh) for r in recomputes for sh in shards]
    for i, (recompute, shard) in enumerate(tries):
        try:
            layers, how, micro_s, stage_bytes, recomputed = split(recompute, shard)
            break
        except ConfigError:
            if i == len(tries) - 1:
                raise
    if cfg.memory.active:
        recomputed = [0] * stages
        how += "; activations planned per stage"
    how += f"; blocks recomputed in the backward: {'+'.join(map(str, recomputed))}" if any(recomputed) else ""
    how += f"; {virtual} chunks a stage" if virtual > 1 else ""
    how += f"; each stage sharded over its {replicas} replicas" if shard else ""
    why = (f"{stages} stages x {replicas} replica(s), blocks {'+'.join(map(str, layers))} ({how}); "
           f"micro-batches of {micro}: {', '.join(f'{n} {sch}' for n, sch in zip(counts, schedules))}")
    return PipelinePlan(stages, replicas, layers, micro, counts, schedules, micro_s, stage_bytes, why, recomputed,
                        virtual, shard)


def _schedule(setting: str, micro_batches: int, stages: int) -> str:
    """1F1B needs at least as many micro-batches as stages (PyTorch's check); GPipe runs any count;
    interleaved 1F1B any count that splits into its rounds."""
    if setting == "auto":
        return "1f1b" if micro_batches >= stages else "gpipe"
    if setting == "interleaved" and not interleaved_fits(max(micro_batches, 1), stages):
        rounds = max(1, micro_batches // stages)
        raise ConfigError(f"parallel.pipeline.schedule=interleaved runs a replica's micro-batches in {rounds} equal "
                          f"rounds; a replica has {micro_batches}, not a multiple of {rounds}: change the global "
                          f"batch or the micro-batch size")
    if setting == "1f1b" and 0 < micro_batches < stages:
        raise ConfigError(f"parallel.pipeline.schedule=1f1b needs at least {stages} micro-batches per replica (one "
                          f"per stage); a replica has {micro_batches}: use schedule gpipe or auto, or a larger batch")
    return setting
