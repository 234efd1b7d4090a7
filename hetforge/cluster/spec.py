"""Which declared device each rank is, and the slow-device simulation knob."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import yaml
from pydantic import BaseModel, ConfigDict

from hetforge.config import ClusterConfig, ConfigError, DeviceSpec, NodeSpec, blank_values, validate_file, yaml_error
from hetforge.cluster.dist import DistContext


def cluster_nodes(cfg: ClusterConfig) -> list[NodeSpec]:
    """The declared nodes. A cluster file must hold a non-empty `nodes:` list and nothing else: an
    empty or misspelt one would otherwise mean "no cluster" and the declared memory be ignored."""
    if not cfg.file:
        return cfg.nodes
    return read_cluster_file(cfg.file)


def read_cluster_file(file: str | Path) -> list[NodeSpec]:
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"cluster file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {yaml_error(err)}") from None
    blank = blank_values(text)
    if blank:
        raise ConfigError(f"{path}:{blank[0][1]}: {blank[0][0]} has no value; write the value or remove the key")
    if raw is None:
        raise ConfigError(f"{path}: the cluster file is empty; it needs `nodes:`, a list of nodes with their devices")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with `nodes:` (got a {type(raw).__name__})")
    if "nodes" not in raw:
        found = ", ".join(map(str, raw)) or "nothing"
        raise ConfigError(f"{path}: no `nodes:` key (found: {found}); a cluster file lists its nodes under `nodes:`")
    extra = [str(k) for k in raw if k != "nodes"]
    if extra:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(extra)}; a cluster file holds only `nodes:`")
    if not isinstance(raw["nodes"], list) or not raw["nodes"]:
        raise ConfigError(f"{path}: `nodes:` must be a non-empty list of nodes (got {raw['nodes']!r})")
    return validate_file(_ClusterFile, raw, text, path).nodes


class _ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: list[NodeSpec]


def declared_devices(nodes: list[NodeSpec]) -> int:
    return sum(d.count for node in nodes for d in node.devices)


def check_launch(cfg: ClusterConfig, world_size: int, layout: list[tuple[int, int]] | None = None,
                 stages: int = 1) -> None:
    """The launch against the declaration, before any collective, the same on every rank: as many
    ranks as declared devices, fixed assignments one per rank (per pipeline replica, where each
    pipeline has `stages` ranks), and (given every rank's (node rank, local rank)) each node launched
    with as many ranks as it declares devices."""
    if world_size <= 1:
        return
    if stages > 1 and world_size % stages:
        raise ConfigError(f"parallel.pipeline.stages={stages} does not divide the {world_size} ranks of this job; "
                          f"launch a multiple of {stages} ranks")
    per = "pipeline replica" if stages > 1 else "rank"
    if cfg.balance == "fixed" and len(cfg.assignments) != world_size // stages:
        raise ConfigError(f"cluster.assignments has {len(cfg.assignments)} entries for {world_size // stages} "
                          f"{per}s; give one per {per}")
    nodes = cluster_nodes(cfg)
    if not nodes:
        return
    where = cfg.file or "cluster.nodes"
    n = declared_devices(nodes)
    if n != world_size:
        raise ConfigError(f"{where} declares {n} device(s) on {len(nodes)} node(s) but {world_size} ranks were "
                          f"launched; launch one rank per declared device (torchrun --nnodes / --nproc-per-node)")
    if layout is None:
        return
    for node_rank in sorted({nr for nr, _ in layout}):
        launched = sum(1 for nr, _ in layout if nr == node_rank)
        if node_rank >= len(nodes):
            raise ConfigError(f"{where} describes {len(nodes)} node(s) but ranks run on node {node_rank}")
        want = sum(d.count for d in nodes[node_rank].devices)
        if launched != want:
            raise ConfigError(f"{where}: node {node_rank} ({nodes[node_rank].host}) declares {want} device(s) but "
                              f"{launched} rank(s) were launched there (check --nproc-per-node)")


def rank_device(cfg: ClusterConfig, ctx: DistContext) -> DeviceSpec | None:
    """The declared device of this rank: node `node_rank`, device number `local_rank` (devices of
    a node listed in order, `count` expanded). None when the cluster is not described."""
    nodes = cluster_nodes(cfg)
    if not nodes:
        return None
    if ctx.node_rank >= len(nodes):
        raise ConfigError(
            f"cluster.nodes describes {len(nodes)} node(s) but this rank runs on node {ctx.node_rank}"
        )
    devices = [d for d in nodes[ctx.node_rank].devices for _ in range(d.count)]
    if ctx.local_rank >= len(devices):
        raise ConfigError(
            f"cluster.nodes[{ctx.node_rank}] declares {len(devices)} device(s) but local rank "
            f"{ctx.local_rank} was launched there (check --nproc-per-node)"
        )
    return devices[ctx.local_rank]


# Datasheets print nominal sizes; the driver reports less (a V100 "16 GB" shows 15.8 GiB, a T4
# "16 GB" 14.6 GiB after ECC): declared figures up to this far above the reported one are taken as
# that card's datasheet figure.
DATASHEET_SLACK = 0.12


def usable_memory(declared_bytes: float | None, reported_bytes: float | None, name: str) -> float | None:
    """What a rank may plan for: the smaller of what was declared and what the device reports; a
    declaration far above the device's is a mistake (the wrong card, or MB for GB)."""
    if reported_bytes is None:
        return declared_bytes
    if declared_bytes is None:
        return reported_bytes
    if declared_bytes > reported_bytes * (1 + DATASHEET_SLACK):
        raise ConfigError(f"cluster: {name} is declared with memory_gb={declared_bytes / 2**30:g} (GiB) but reports "
                          f"{reported_bytes / 2**30:.1f} GiB; declare at most its datasheet size")
    return min(declared_bytes, reported_bytes)


def device_memory_bytes(spec: DeviceSpec | None, device: torch.device) -> float | None:
    """Usable memory: the declared figure, capped by what a GPU really has; None = unbounded."""
    declared = spec.memory_gb * 2**30 if spec and spec.memory_gb else None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return usable_memory(declared, total, torch.cuda.get_device_name(device))
    return declared


def device_name(spec: DeviceSpec | None, device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return spec.type if spec else "cpu"


class Slowdown:
    """Makes this rank behave like a device `factor` times slower (simulation only).

    Under DDP (collectives only after the backward) the sleep comes right after each forward pass
    (the loss included) and lasts (factor - 1) x (the forward's time + the backward's), the backward's taken as the
    last one measured relative to its forward (2x until one is): it lands before the gradients are synchronised, where a slower device's extra
    time would be, and the probe and the loop apply the same rule. The whole compute is slowed,
    not a multiple of the forward: under FSDP the backward (reduce-scatters, hooks) costs far more
    than twice the forward on a small model, and a device k times slower is slower at all of it.
    Under FSDP, where the ranks meet at every unit, each unit, and the loss, is slowed where it
    runs (`install_per_module`)."""

    def __init__(self, spec: DeviceSpec | None):
        self.factor = spec.slowdown if spec else 1.0
        self.from_step = spec.slowdown_from_step if spec else 0
        self.backward_ratio = 2.0
        self._forward = 0.0

    @property
    def active(self) -> bool:
        """Whether it sleeps at all: when not, nothing needs the forward's time (on a GPU that
        would cost a synchronisation per micro-batch)."""
        return self.factor > 1.0

    @staticmethod
    def clock() -> float:
        """What the forward's time is read on. With one compute thread on a CPU: that thread's CPU
        time, which stops while a collective waits for a peer (FSDP gathers each block's weights
        inside the forward, so a rank with a smaller share would otherwise be charged its faster
        peer's time and sleep for it). Otherwise wall time."""
        if torch.get_num_threads() == 1 and not torch.cuda.is_available():
            return time.thread_time()
        return time.perf_counter()

    def after_forward(self, forward_seconds: float, step: int) -> None:
        self._forward = forward_seconds
        if self.factor > 1.0 and step >= self.from_step:
            time.sleep((self.factor - 1.0) * (1.0 + self.backward_ratio) * forward_seconds)

    def after_backward(self, backward_seconds: float) -> None:
        if self._forward > 0:
            self.backward_ratio = min(max(backward_seconds / self._forward, 0.5), 20.0)

    def install_per_module(self, modules: list[torch.nn.Module], step_of) -> list:
        """Slow each of `modules` (the model's FSDP units) where its own compute runs: after its
        forward, (factor - 1) x that forward's time; after its backward (the gradient of its input
        is made), (factor - 1) x that backward's. Under FSDP the ranks meet at every unit (its
        all-gather, its reduce-scatter), so a slower device is late at each of them; one sleep after
        the whole forward would hold the faster ranks at the next collective while doing nothing of
        theirs, and no share of the batch could then hide the slowness. `step_of()`: the step now
        (no sleep before `slowdown_from_step`). Returns the hooks' handles."""
        if not self.active:
            return []
        handles = []
        for mod in modules:
            marks: dict[str, float] = {}

            def pre(module, args, marks=marks):
                marks["forward"] = self.clock()
                if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    # the gradient of the input is the last thing this module's backward makes
                    return (_Mark.apply(lambda m=marks: self._sleep_since(m.pop("backward", None), step_of()), args[0]),
                            *args[1:])
                return None

            def post(module, args, out, marks=marks):
                self._sleep_since(marks.pop("forward", None), step_of())
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    # its gradient arriving starts this module's backward
                    return _Mark.apply(lambda m=marks: m.__setitem__("backward", self.clock()), out)
                return None

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return handles

    def _sleep_since(self, start: float | None, step: int) -> None:
        if start is not None and step >= self.from_step:
            time.sleep((self.factor - 1.0) * max(self.clock() - start, 0.0))


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `fn` when the gradient passes: a point in the backward to
    time from, or to sleep at."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return None, grad


# --- which declared node each launched rank runs on ---------------------------------------------
NODE_ENV = "HETFORGE_NODE"  # names the cluster file's node a launcher's ranks run on: its host, or its index


def rank_identity(ctx: DistContext, device: torch.device) -> dict:
    """What a launched rank is, to match it to a declared node: its host, the node it is told it
    runs on (`HETFORGE_NODE`), the launcher's node rank, its local rank and the device it has."""
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return {"rank": ctx.rank, "host": ctx.host, "node": os.environ.get(NODE_ENV) or None, "launch_node": ctx.node_rank,
            "local_rank": ctx.local_rank, "device": device_name(None, device), "memory": memory}


def same_host(declared: str, actual: str) -> bool:
    """Whether a declared host is this one: by name, short or full; `localhost` is any host (a
    cluster file standing for nodes on one machine)."""
    a, b = declared.strip().lower(), actual.strip().lower()
    return a in ("localhost", "127.0.0.1") or a == b or a.split(".")[0] == b.split(".")[0]


def named_node(nodes: list[NodeSpec], name: str, where: str) -> int:
    """The node `HETFORGE_NODE` names: by index, or by host."""
    if name.isdigit() and int(name) < len(nodes):
        return int(name)
    found = [i for i, n in enumerate(nodes) if same_host(n.host, name)]
    if len(found) != 1:
        known = ", ".join(f"{i}: {n.host}" for i, n in enumerate(nodes))
        what = "names no node" if not found else "names several nodes (name one by its index)"
        raise ConfigError(f"{NODE_ENV}={name} {what} of {where} (nodes {known})")
    return found[0]


def _node_of(nodes: list[NodeSpec], group: list[dict], taken: set[int], where: str) -> int:
    """The declared node a launched node (its ranks) runs on: the one it is told, else the one its
    host is; where several nodes share that host (one machine standing for many), the launcher's
    node rank among them."""
    first = group[0]
    if first["node"] is not None:
        return named_node(nodes, first["node"], where)
    hosts = [i for i, n in enumerate(nodes) if same_host(n.host, first["host"])]
    free = [i for i in hosts if i not in taken]
    if len(free) == 1:
        return free[0]
    if first["launch_node"] in free:
        return first["launch_node"]
    known = ", ".join(f"{i}: {n.host}" for i, n in enumerate(nodes))
    if not hosts:
        raise ConfigError(f"ranks {_ranks(group)} run on host {first['host']}, which is no node of {where} (nodes "
                          f"{known}); fix the node's host, or set {NODE_ENV} to the node they run on")
    raise ConfigError(f"ranks {_ranks(group)} on host {first['host']}: {len(hosts)} nodes of {where} are on that host "
                      f"({known}); set {NODE_ENV} to the node each launcher runs (its index)")


def _ranks(group: list[dict]) -> str:
    ids = [g["rank"] for g in group]
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def match_nodes(nodes: list[NodeSpec], identities: list[dict], where: str) -> list[int]:
    """The declared node of every launched rank (in rank order), by identity, not by launch order:
    ranks are grouped by the node they are told (`HETFORGE_NODE`) or else their host, each group
    matched to one declared node, which must declare as many devices as the group has ranks, each
    of the card the rank has (a GPU's name and memory). Any mismatch is one line naming both sides."""
    groups: dict[tuple, list[dict]] = {}  # a launcher's ranks: one launched node
    for ident in sorted(identities, key=lambda i: i["rank"]):
        key = (ident["node"],) if ident["node"] else (ident["host"].lower().split(".")[0], ident["launch_node"])
        groups.setdefault(key, []).append(ident)
    taken: dict[int, list[dict]] = {}
    for group in groups.values():
        i = _node_of(nodes, group, set(taken), where)
        if i in taken:
            raise ConfigError(f"ranks {_ranks(taken[i])} and {_ranks(group)} (hosts {taken[i][0]['host']}, "
                              f"{group[0]['host']}) both run as node {i} ({nodes[i].host}) of {where}; set "
                              f"{NODE_ENV} per launcher")
        taken[i] = group
    short = [f"node {i} ({nodes[i].host}) declares {_count(nodes[i])} device(s) but {len(g)} rank(s) run there "
             f"(ranks {_ranks(g)} on host {g[0]['host']})" for i, g in sorted(taken.items()) if len(g) != _count(nodes[i])]
    if short:
        raise ConfigError(f"{where}: {'; '.join(short)}; check --nproc-per-node and which node runs where")
    out = [0] * len(identities)
    for i, group in taken.items():
        declared = [d for d in nodes[i].devices for _ in range(d.count)]
        for ident in group:
            _check_device(declared[ident["local_rank"] % len(declared)], ident, i, nodes[i], where)
            out[ident["rank"]] = i
    return out


def _count(node: NodeSpec) -> int:
    return sum(d.count for d in node.devices)


def _check_device(spec: DeviceSpec, ident: dict, index: int, node: NodeSpec, where: str) -> None:
    """A GPU rank's card against its declared one (a CPU rank runs wherever a CPU is declared)."""
    from hetforge.core.hardware import lookup

    has = ident["device"]
    if ident["memory"] is None:
        if spec.type.strip().lower() != "cpu":
            raise ConfigError(f"rank {ident['rank']} on host {ident['host']} has no GPU but {where} declares "
                              f"{spec.type} for node {index} ({node.host}), local rank {ident['local_rank']}")
        return
    declared, actual = lookup(spec.type, spec.memory_gb), lookup(has, ident["memory"] / 2**30)
    if declared is None or actual is None or declared.name.split("-")[0] != actual.name.split("-")[0]:
        raise ConfigError(f"rank {ident['rank']} on host {ident['host']} has a {has} but {where} declares "
                          f"{spec.type} for node {index} ({node.host}), local rank {ident['local_rank']}")


def assign_nodes(cfg: ClusterConfig, ctx: DistContext, device: torch.device) -> None:
    """Every rank's declared node, by identity (`match_nodes`), into `ctx.node_rank` (the launcher's
    node rank follows join order under a c10d rendezvous, not the file)."""
    from hetforge.cluster.dist import all_gather_object

    nodes = cluster_nodes(cfg)
    identities = all_gather_object(ctx, rank_identity(ctx, device))
    if nodes:
        ctx.node_rank = match_nodes(nodes, identities, cfg.file or "cluster.nodes")[ctx.rank]
