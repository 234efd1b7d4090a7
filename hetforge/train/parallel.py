"""Data parallelism applied to a plain model from outside (torchtitan's `parallelize`): the training
loop calls one function and steps whatever it returns.

Today: DistributedDataParallel with gradients as views of its buckets (one copy of them, not two)
and, on the CPU, a communication hook that notes when each bucket is ready, i.e. when this rank's
own backward compute ended, before any waiting for slower ranks (the balancer needs each rank's own
speed). One process: the model itself.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetforge.cluster.dist import DistContext


class BucketClock:
    """A DDP communication hook that notes when each gradient bucket is ready, then all-reduces it
    as DDP would: the last note is the end of this rank's backward compute, before any waiting for
    slower ranks, while keeping DDP's overlap of communication with the backward pass."""

    def __init__(self):
        self.last: float | None = None

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.last = time.perf_counter()
        return allreduce_hook(state, bucket)


def parallelize(model: nn.Module, ctx: DistContext, device: torch.device) -> tuple[nn.Module, BucketClock | None]:
    """(the module to run forward/backward on, the clock of this rank's backward or None)."""
    if not ctx.distributed:
        return model, None
    net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)
    clock = None
    if device.type == "cpu":  # on a GPU the host-side note would run ahead of the kernels
        clock = BucketClock()
        net.register_comm_hook(None, clock.hook)
    return net, clock


def is_data_parallel(net: nn.Module) -> bool:
    return isinstance(net, DistributedDataParallel)
