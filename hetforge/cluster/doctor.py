"""What a run will see on this node (`hetforge doctor`): PyTorch and its CUDA and NCCL, every device
with its memory, capability, 16-bit arithmetic and the attention kernel it will run, the network
interface the collectives use, and which node of a cluster file this host is."""

from __future__ import annotations

import os
import socket

import torch

from hetforge.cluster.spec import NODE_ENV, named_node, same_host
from hetforge.config import ConfigError, NodeSpec
from hetforge.core.hardware import from_compute_capability, lookup, padded_head_dim, sdpa_backend

TESTED_TORCH = "2.13"  # what the suite runs on (pyproject's pin)
OLDEST_TORCH = (2, 6)  # FSDP2's fully_shard, DCP's state-dict helpers and torch.distributed.pipelining


def torch_version_problem(version: str) -> str | None:
    """Why this torch cannot run hetforge (None: it can)."""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"torch {version}: unreadable version"
    if (major, minor) < OLDEST_TORCH:
        return (f"torch {version} is older than {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}, which hetforge needs (FSDP2, "
                f"distributed checkpoints); install a newer CUDA build of torch")
    return None


def report(nodes: list[NodeSpec] | None = None, where: str = "", head_dim: int = 64) -> list[tuple[str, str]]:
    """(item, what was found) rows, in the order a reader checks them."""
    rows = [("torch", f"{torch.__version__} (hetforge is tested on {TESTED_TORCH}; "
                      + (torch_version_problem(torch.__version__) or "supported") + ")")]
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, no device visible"
        rows.append(("CUDA", f"none: {build}; runs train on the CPU (gloo between processes)"))
    else:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        rows.append(("CUDA", f"{torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} device(s)"))
        for i in range(torch.cuda.device_count()):
            rows.append((f"cuda:{i}", _device(i, head_dim)))
    rows.append(("interface", _interface()))
    if nodes:
        rows.append(("cluster node", _node(nodes, where)))
    return rows


def _device(index: int, head_dim: int) -> str:
    props = torch.cuda.get_device_properties(index)
    cap = from_compute_capability(props.name, (props.major, props.minor), float(props.total_memory))
    precision = "bf16" if cap.bf16 else "fp16 with loss scaling" if cap.fast_fp16 else "fp32"
    card = lookup(props.name) or cap
    dtype = "bf16" if cap.bf16 else "fp16" if cap.fast_fp16 else "fp32"
    head = padded_head_dim(cap, dtype, head_dim)
    kernel = sdpa_backend(card, dtype, head)
    return (f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}, "
            f"trains in {precision}, attention {kernel} at head size {head}"
            + (f" (padded from {head_dim})" if head != head_dim else ""))


def _interface() -> str:
    chosen = {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if os.environ.get(k)}
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "does not resolve"
    set_ = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unset"
    return f"host {host} ({address}); {set_}" + ("" if chosen else ": the interface the host name resolves to")


def _node(nodes: list[NodeSpec], where: str) -> str:
    name = os.environ.get(NODE_ENV)
    try:
        if name:
            i = named_node(nodes, name, where)
            return f"node {i} ({nodes[i].host}) of {where}, named by {NODE_ENV}={name}"
    except ConfigError as err:
        return str(err)
    host = socket.gethostname()
    found = [i for i, n in enumerate(nodes) if same_host(n.host, host)]
    if len(found) == 1:
        i = found[0]
        devices = ", ".join(f"{d.count} x {d.type}" for d in nodes[i].devices)
        return f"node {found[0]} ({nodes[i].host}) of {where}: {devices}"
    if not found:
        return f"this host ({host}) is no node of {where}; fix a node's host or set {NODE_ENV}"
    return f"this host ({host}) is {len(found)} nodes of {where}: set {NODE_ENV} to the one each launcher runs"
