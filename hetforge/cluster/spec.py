"""Which declared device each rank is, and the slow-device simulation knob."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import yaml

from hetforge.config import ClusterConfig, ConfigError, DeviceSpec, NodeSpec
from hetforge.cluster.dist import DistContext


def cluster_nodes(cfg: ClusterConfig) -> list[NodeSpec]:
    if not cfg.file:
        return cfg.nodes
    path = Path(cfg.file)
    if not path.is_file():
        raise ConfigError(f"cluster.file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    try:
        return ClusterConfig(nodes=raw.get("nodes", [])).nodes
    except Exception as err:  # pydantic ValidationError, reported with the file's name
        raise ConfigError(f"{path}: invalid cluster description: {err}") from None


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


def device_memory_bytes(spec: DeviceSpec | None, device: torch.device) -> float | None:
    """Usable memory: the declared figure, capped by what a GPU really has; None = unbounded."""
    declared = spec.memory_gb * 2**30 if spec and spec.memory_gb else None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if declared is not None and declared > total:
            raise ConfigError(
                f"cluster: device {torch.cuda.get_device_name(device)} is declared with "
                f"{spec.memory_gb:g} GB but has {total / 2**30:.1f} GiB"
            )
        return declared or total
    return declared


def device_name(spec: DeviceSpec | None, device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return spec.type if spec else "cpu"


class Slowdown:
    """Makes this rank behave like a device `factor` times slower (simulation only).

    The sleep comes right after each forward pass and lasts (factor - 1) x 3 x the forward time
    (backward ~ 2 x forward): it lands before the gradients are synchronised, where a slower
    device's extra time would be, and the probe and the loop apply the same rule."""

    def __init__(self, spec: DeviceSpec | None):
        self.factor = spec.slowdown if spec else 1.0
        self.from_step = spec.slowdown_from_step if spec else 0

    def after_forward(self, forward_seconds: float, step: int) -> None:
        if self.factor > 1.0 and step >= self.from_step:
            time.sleep((self.factor - 1.0) * 3.0 * forward_seconds)
