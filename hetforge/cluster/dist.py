"""Process-group set-up and the few collectives the loop needs.

Launchers: `torchrun` (its agent store does the rendezvous), Slurm `srun` (SLURM_* variables mapped
to RANK / WORLD_SIZE / LOCAL_RANK; MASTER_ADDR and MASTER_PORT from the job script), or the plain
environment variables. Without WORLD_SIZE > 1 everything here is a no-op and the run is one process.
NCCL on GPUs, gloo on CPUs. The rendezvous has its own, short, timeout so that an unreachable
endpoint is a clear error in seconds instead of a hang; collectives get a long one (a slow prepare
or checkpoint on rank 0 must not trip it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hetforge.core.errors import HetforgeError


class ClusterError(HetforgeError, RuntimeError):
    pass


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    host: str = "localhost"
    backend: str | None = None
    # Host values (step times, stop requests, plans) go over gloo even when gradients go over NCCL,
    # so that exchanging them never waits for the GPU's queue.
    host_group: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(*names: str, default: int | None = None) -> int | None:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return default


def init_distributed(device_type: str, rendezvous_timeout_s: float, collective_timeout_s: float) -> DistContext:
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    if world <= 1:
        return DistContext(host=os.uname().nodename)
    rank = _env_int("RANK", "SLURM_PROCID")
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    node_rank = _env_int("GROUP_RANK", "SLURM_NODEID", default=0)
    if rank is None:
        raise ClusterError("WORLD_SIZE > 1 but no RANK (launch with torchrun or srun)")
    backend = "nccl" if device_type == "cuda" else "gloo"
    ctx = DistContext(rank, world, local_rank, node_rank, os.uname().nodename, backend)
    if dist.is_initialized():
        return ctx
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=collective_timeout_s)
    # Under torchrun the agent did the rendezvous (bounded by its --rdzv-conf join_timeout) and
    # hosts the store; otherwise rank 0 hosts it. Keys are prefixed with the restart attempt: after
    # a rank failure and a torchrun restart, peers must not find the dead workers' addresses.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    addr = os.environ.get("MASTER_ADDR")
    port = _env_int("MASTER_PORT")
    if not addr or port is None:
        raise ClusterError(f"rank {rank} of {world}: set MASTER_ADDR and MASTER_PORT (or launch with torchrun)")
    try:
        store = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent_store,
                              timeout=timedelta(seconds=rendezvous_timeout_s), wait_for_workers=not agent_store)
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise ClusterError(
            f"rank {rank} of {world} could not reach the rendezvous at {addr}:{port} within "
            f"{rendezvous_timeout_s:g}s ({err.__class__.__name__}); check MASTER_ADDR/MASTER_PORT, "
            f"that rank 0 is running, and firewalls"
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"hetforge/attempt_{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)
    if backend == "nccl":
        ctx.host_group = dist.new_group(backend="gloo", timeout=timeout)
    return ctx


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_gather_rows(ctx: DistContext, row: torch.Tensor) -> torch.Tensor:
    """(world, len(row)) float64 tensor of every rank's row, on CPU, over the host group."""
    row = row.detach().to(torch.float64).flatten().cpu()
    if not ctx.distributed:
        return row.unsqueeze(0)
    out = [torch.empty_like(row) for _ in range(ctx.world_size)]
    dist.all_gather(out, row, group=ctx.host_group)
    return torch.stack(out)


def all_gather_object(ctx: DistContext, obj):
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.host_group)
    return out


def broadcast_object(ctx: DistContext, obj):
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.host_group)
    return box[0]
