"""Where a plan's facts come from (`cluster.run_plan`): the ranks of a launched run, each measuring
its own device, or a device, a card of the table or a cluster file, declared.

A launched run's ranks describe themselves (the device the driver reports, the declared entry of
the cluster file, the memory a plan may use) and measure what the plan asks of them: step times at
the micro-batches they fit (`probe.time_steps`, on the model or, under FSDP, a local proxy of it),
memory profiles (`memory.profile`, cached on disk) and the link (all-gathers timed on the run's
group). A declared rank is a card of the table (`memory.analytic`: shapes and the datasheet, no
timing) or a CPU, whose figures are this machine's, or its declared speed.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable

import torch

from hetforge.cluster.balance import fit_link
from hetforge.cluster.dist import DistContext, all_gather_object
from hetforge.cluster.layouts import Links
from hetforge.cluster.probe import proxy_model, time_all_gathers, time_steps
from hetforge.cluster.run_plan import Link, RankFacts, RankView
from hetforge.cluster.spec import Slowdown, device_memory_bytes, device_name, rank_device
from hetforge.config import ConfigError, DeviceSpec, NodeSpec, RunConfig
from hetforge.core.console import console
from hetforge.core.errors import HetforgeError
from hetforge.core.hardware import DEVICES, Capability, DeviceInfo, detect, lookup
from hetforge.core.precision import Precision
from hetforge.memory.analytic import analytic_profile, usable_bytes
from hetforge.memory.device_plan import profile_cache
from hetforge.memory.plan import ModelProfile, Plan, simulate
from hetforge.memory.profile import profile_model
from hetforge.model.accounting import ShardLayout, flops_per_token
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig, set_head_padding

LINK_PROBE_BYTES = (4096, 16 << 20)  # the all-gathers that time the link: latency, and bandwidth
CPU = Capability("cpu", "cpu", None, None, bf16=False, fast_fp16=False)


class LocalView:
    """This process's own rank: its figures measured on its device. `sharding(layout, precision)`: a context
    giving a function that shards a model as the run will, on a mesh of this rank alone (the train
    layer's `local_sharding`), so that a sharded run's proxy is timed under FSDP2's hooks."""

    estimates = False

    def __init__(self, facts: RankFacts, cfg: RunConfig, shape: GPTNeoXConfig, device: torch.device,
                 slowdown: Slowdown | None = None, sharding: Callable[[ShardLayout, str], Any] | None = None):
        self.facts, self.cfg, self.shape, self.device = facts, cfg, shape, device
        self.slowdown = slowdown or Slowdown(None)
        self.sharding = sharding
        self.cache: dict = {}

    def profile(self, micro_batch: int, precision: str, head_dim: int, compiled: bool) -> ModelProfile:
        mem, tc = self.cfg.memory, self.cfg.train
        link = mem.link_gbps * 1e9 if mem.link_gbps else None
        return profile_model(self.shape, micro_batch, tc.seq_len, precision, self.device, link, tc.optimizer,
                             profile_cache(), compiled=compiled, note=console.print if self.facts.rank == 0 else None)

    def step_times(self, sizes: list[int], precision: str, layout: ShardLayout, plans: dict[int, Plan],
                   head_dim: int) -> dict[int, float]:
        """Median seconds of a micro-step at each size: the model itself, or under a sharded layout a
        local proxy of it timed under FSDP2's hooks (a sharded model is never whole on one rank, and
        its collectives would time the slowest rank), scaled by FLOPs."""
        tc, shape = self.cfg.train, self.shape
        proxy = layout.sharded
        model = proxy_model(shape, self.device) if proxy else GPTNeoX.build(shape, self.device, seed=0)
        if head_dim != shape.head_dim:
            set_head_padding(model, head_dim)
        factor = flops_per_token(shape, tc.seq_len) / flops_per_token(model.cfg, tc.seq_len) if proxy else 1.0
        hooks = self.sharding(layout, precision) if proxy and self.sharding is not None and not plans else contextlib.nullcontext()
        autocast = Precision(precision, self.device).autocast
        with hooks as wrap:
            timed = wrap(model) if wrap is not None else model
            measured = time_steps(timed, sizes, tc.seq_len, shape.vocab_size, self.device, autocast, self.slowdown,
                                  self.cfg.cluster.probe_steps, plans)
        del model, timed
        return {b: t * factor for b, t in measured.items()}


class CardView:
    """A card of the table that is not here: its profile and step times estimated from shapes and
    its datasheet (`memory.analytic`)."""

    estimates = True

    def __init__(self, facts: RankFacts, card: DeviceInfo, cfg: RunConfig, shape: GPTNeoXConfig,
                 cache: dict | None = None):
        self.facts, self.card, self.cfg, self.shape = facts, card, cfg, shape
        self.cache = {} if cache is None else cache

    def profile(self, micro_batch: int, precision: str, head_dim: int, compiled: bool) -> ModelProfile:
        return analytic_profile(self.shape, micro_batch, self.cfg.train.seq_len, self.card, self.cfg.train.optimizer,
                                pad_head_dim=self.cfg.model.pad_head_dim, precision=precision)

    def step_times(self, sizes: list[int], precision: str, layout: ShardLayout, plans: dict[int, Plan],
                   head_dim: int) -> dict[int, float]:
        keep = Plan(["keep"] * self.shape.n_layers)
        return {b: simulate(self.profile(b, precision, head_dim, False), plans.get(b, keep)).time_s for b in sizes}


def _fail(err: HetforgeError) -> dict:
    return {"__error__": str(err)}


class LaunchedFacts:
    """The ranks of this run: each evaluates a question on its own view, the answers all-gathered
    (every rank runs the planner alike, collective for collective); an error on any rank is raised
    on every rank, so none is left waiting in a collective."""

    def __init__(self, ctx: DistContext, ranks: list[RankFacts], view: LocalView, cfg: RunConfig):
        self.ctx, self.ranks, self.view, self.cfg = ctx, ranks, view, cfg
        self._links: dict = {}

    def gather(self, fn: Callable[[RankView], Any]) -> list[Any]:
        try:
            mine = fn(self.view)
        except HetforgeError as err:
            mine = _fail(err)
        rows = all_gather_object(self.ctx, mine)
        for row in rows:
            if isinstance(row, dict) and "__error__" in row:
                raise ConfigError(row["__error__"])
        return rows

    def link(self, layout: ShardLayout) -> Link:
        """Latency and bandwidth from all-gathers timed on the run's group (the slowest rank's),
        or as declared (`parallel.link_gbps`)."""
        pc = self.cfg.parallel
        if pc.link_gbps:
            return Link(pc.link_latency_us * 1e-6, pc.link_gbps * 1e9, "declared")
        if not self.ctx.distributed:
            return Link(0.0, float("inf"), "one process")
        if "measured" not in self._links:
            device = self.view.device
            timed = time_all_gathers(device, list(LINK_PROBE_BYTES))
            slowest = {n: max(r[str(n)] for r in all_gather_object(self.ctx, {str(k): v for k, v in timed.items()}))
                       for n in LINK_PROBE_BYTES}
            latency, bandwidth = fit_link(slowest, self.ctx.world_size)
            self._links["measured"] = Link(latency, bandwidth, "measured")
        return self._links["measured"]


class DeclaredFacts:
    """Ranks described, not launched: every rank's question evaluated here."""

    def __init__(self, views: list, link: Link):
        self.views, self.ranks, self._link = views, [v.facts for v in views], link

    def gather(self, fn: Callable[[RankView], Any]) -> list[Any]:
        return [fn(v) for v in self.views]

    def link(self, layout: ShardLayout) -> Link:
        return self._link


def declared_link(cfg: RunConfig) -> Link:
    links = Links.declared(cfg)
    return Link(links.latency_s, links.intra_bytes_per_s, "declared" if cfg.parallel.link_gbps else "assumed")


# ------------------------------------------------------------------------------------------- ranks
def local_rank_facts(cfg: RunConfig, ctx: DistContext, device: torch.device) -> RankFacts:
    """This rank as it is: the device the driver reports, its declared entry, the memory a plan may use."""
    spec = rank_device(cfg.cluster, ctx)
    nodes = cluster_nodes_or_none(cfg)
    host = nodes[ctx.node_rank].host if nodes else ctx.host
    declared = nodes[ctx.node_rank].memory_gb if nodes else None
    return RankFacts(ctx.rank, ctx.node_rank, host, device_name(spec, device), detect(device),
                     device_memory_bytes(spec, device), spec.speed if spec else None,
                     declared * 2**30 if declared else None)


def cluster_nodes_or_none(cfg: RunConfig) -> list[NodeSpec]:
    from hetforge.cluster.spec import cluster_nodes

    return cluster_nodes(cfg.cluster)


def declared_rank_facts(nodes: list[NodeSpec], where: str) -> list[tuple[RankFacts, DeviceInfo | None]]:
    """Every declared device, one rank each in node order (as a launch numbers them), with its card."""
    out = []
    for n, node in enumerate(nodes):
        host_memory = node.memory_gb * 2**30 if node.memory_gb else None
        for spec in (d for d in node.devices for _ in range(d.count)):
            facts = replace(_declared(len(out), n, node.host, spec, where), host_memory_bytes=host_memory)
            out.append((facts, _card(spec)))
    return out


def _card(spec: DeviceSpec) -> DeviceInfo | None:
    return None if spec.type.strip().lower() == "cpu" else lookup(spec.type, spec.memory_gb)


def _declared(rank: int, node: int, host: str, spec: DeviceSpec, where: str) -> RankFacts:
    card = _card(spec)
    if card is None:
        return RankFacts(rank, node, host, "cpu", CPU, spec.memory_gb * 2**30 if spec.memory_gb else None, spec.speed)
    memory = spec.memory_gb * 2**30 if spec.memory_gb else usable_bytes(card)
    return RankFacts(rank, node, host, card.name, card.caps(), memory, spec.speed)


def declared_facts(cfg: RunConfig, shape: GPTNeoXConfig, nodes: list[NodeSpec], where: str) -> DeclaredFacts:
    """A cluster file's ranks: cards estimated, CPUs measured on this machine (or their declared
    speed); ranks of one kind share their solved plans."""
    caches: dict = {}
    views = []
    for facts, card in declared_rank_facts(nodes, where):
        cache = caches.setdefault((facts.device, facts.memory_bytes, facts.speed), {})
        if card is not None:
            views.append(CardView(facts, card, cfg, shape, cache))
        else:
            view = LocalView(facts, cfg, shape, torch.device("cpu"))
            view.cache = cache
            views.append(view)
    return DeclaredFacts(views, declared_link(cfg))


def card_facts(cfg: RunConfig, shape: GPTNeoXConfig, name: str) -> DeclaredFacts:
    """One card of the table, alone (`hetforge plan --card`)."""
    card = lookup(name)
    if card is None:
        raise ConfigError(f"--card {name!r}: not in the device table ({', '.join(d.name for d in DEVICES)})")
    facts = RankFacts(0, 0, "localhost", card.name, card.caps(), usable_bytes(card))
    return DeclaredFacts([CardView(facts, card, cfg, shape)], declared_link(cfg))


def device_facts(cfg: RunConfig, shape: GPTNeoXConfig, device: torch.device) -> DeclaredFacts:
    """This machine's device, alone (`hetforge plan`): what a one-process `train` would decide."""
    ctx = DistContext(host="localhost")
    facts = replace(local_rank_facts(cfg, ctx, device), host="localhost")
    return DeclaredFacts([LocalView(facts, cfg, shape, device)], declared_link(cfg))
