"""The commands that launch a run on a cluster file's nodes: one `torchrun` per node, and a Slurm
batch script (`hetforge launch`).

Every node's torchrun joins one c10d rendezvous on the first node's host, with as many processes as
the node declares devices, and names the node it runs (`HETFORGE_NODE`): ranks are matched to the
file's nodes by that name, not by the order the launchers joined in (`cluster.spec.match_nodes`).
A Slurm script runs the same as one job, as components of a heterogeneous job where the nodes'
shapes differ (`#SBATCH hetjob`), one task per device.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from hetforge.cluster.spec import NODE_ENV
from hetforge.config import NodeSpec


@dataclass
class NodeCommand:
    node: int
    host: str
    env: dict[str, str]
    argv: list[str]
    devices: int

    def shell(self) -> str:
        """As one line of a shell: the environment, then the command."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shlex.quote, self.argv)])


@dataclass
class LaunchOptions:
    port: int = 29500
    max_restarts: int = 3
    env: dict[str, str] = field(default_factory=dict)  # NCCL_*, GLOO_SOCKET_IFNAME, ...
    rdzv_timeout_s: float = 120.0
    job_id: str = "hetforge"
    torchrun: list[str] = field(default_factory=lambda: ["torchrun"])


def _gpus(node: NodeSpec) -> int:
    return sum(d.count for d in node.devices if d.type.strip().lower() != "cpu")


def _count(node: NodeSpec) -> int:
    return sum(d.count for d in node.devices)


def _endpoint_host(nodes: list[NodeSpec]) -> str:
    return nodes[0].host


def node_commands(nodes: list[NodeSpec], train_args: list[str], opts: LaunchOptions) -> list[NodeCommand]:
    """Per declared node, the torchrun that starts its ranks: `train_args` are what follows
    `hetforge` (e.g. ["train", "run.yaml"])."""
    out = []
    for i, node in enumerate(nodes):
        argv = [*opts.torchrun, "--nnodes", str(len(nodes)), "--nproc-per-node", str(_count(node)),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{_endpoint_host(nodes)}:{opts.port}",
                "--rdzv-id", opts.job_id, "--rdzv-conf", f"join_timeout={opts.rdzv_timeout_s:g}",
                "--max-restarts", str(opts.max_restarts), "-m", "hetforge", *train_args]
        out.append(NodeCommand(i, node.host, {NODE_ENV: str(i), **opts.env}, argv, _count(node)))
    return out


def sbatch_script(nodes: list[NodeSpec], train_args: list[str], opts: LaunchOptions, python: str = "hetforge") -> str:
    """A Slurm batch script: one component per shape of node (tasks and GPUs per node), a
    heterogeneous job where there are several, one task per device; the rendezvous on the job's
    first node. Slurm picks the hosts: each rank finds its node of the file by its host name."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, node in enumerate(nodes):
        shapes.setdefault((_count(node), _gpus(node)), []).append(i)
    groups = list(shapes.values())
    lines = ["#!/bin/bash", f"#SBATCH --job-name={opts.job_id}"]
    for k, group in enumerate(groups):
        if k:
            lines.append("#SBATCH hetjob")
        first = nodes[group[0]]
        gpus = f" --gpus-per-node={_gpus(first)}" if _gpus(first) else ""
        lines.append(f"# nodes {', '.join(f'{i} ({nodes[i].host})' for i in group)} of the cluster file")
        lines.append(f"#SBATCH --nodes={len(group)} --ntasks-per-node={_count(first)}{gpus}")
    het = "_HET_GROUP_0" if len(groups) > 1 else ""
    lines += ["", "# the rendezvous: the job's first node",
              f'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST{het}" | head -n 1)',
              f"export MASTER_PORT={opts.port}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in opts.env.items()]
    groups_arg = f" --het-group={','.join(str(k) for k in range(len(groups)))}" if len(groups) > 1 else ""
    lines += ["", "# one task per device; each rank finds its node of the cluster file by its host name (the",
              "# file's hosts must be the Slurm node names)",
              f"srun{groups_arg} {python} {' '.join(map(shlex.quote, train_args))}", ""]
    return "\n".join(lines)
