"""Data parallelism applied to a plain model from outside (torchtitan's `parallelize`): the training
loop calls one function and steps whatever it returns.

Today: DistributedDataParallel with gradients as views of its buckets (one copy of them, not two)
and a communication hook that notes when each bucket is ready, i.e. when this rank's own backward
compute ended, before any waiting for slower ranks (the balancer needs each rank's own speed; on a
GPU the note is a CUDA event, see `ComputeTimer`). One process: the model itself.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetforge.cluster.dist import DistContext
from hetforge.core.errors import ConfigError


class BucketClock:
    """A DDP communication hook that notes when each gradient bucket is ready, then all-reduces it
    as DDP would: the last note is the end of this rank's backward compute, before any waiting for
    slower ranks, while keeping DDP's overlap of communication with the backward pass. On a GPU the
    host time runs ahead of the kernels, so the note is also a CUDA event on the compute stream."""

    def __init__(self, event_factory: Callable[[], object] | None = None):
        self.last: float | None = None
        self.last_event = None
        self.event_factory = event_factory

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.last = time.perf_counter()
        if self.event_factory is not None:
            self.last_event = self.event_factory()
            self.last_event.record()
        return allreduce_hook(state, bucket)

    def reset(self) -> None:
        self.last = self.last_event = None


def cuda_event():
    return torch.cuda.Event(enable_timing=True)


class ComputeTimer:
    """This rank's own compute seconds per step (forward and backward of its micro-batches, up to
    its last gradient bucket: waits for slower ranks excluded), what the balancer, the drift
    monitor and the memory plan's check compare.

    On the CPU from the host clock. On a GPU from CUDA events on the compute stream, and read one
    step late: by then the events are long done, so timing costs no synchronisation and the host
    keeps running ahead (`step_seconds(wait=True)` reads this step's, synchronising, for the
    occasional check that needs it)."""

    def __init__(self, device: torch.device, clock: BucketClock | None = None,
                 event_factory: Callable[[], object] | None = None):
        self.events = event_factory or (cuda_event if device.type == "cuda" else None)
        self.clock = clock
        self._seconds = 0.0
        self._pairs: list[tuple[object, object]] = []
        self._previous: list[tuple[object, object]] = []

    def start(self) -> None:
        if self.clock is not None:
            self.clock.reset()
        if self.events is not None:
            self._start = self.events()
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, synced: bool) -> None:
        """After a micro-batch's backward; `synced`: its gradients were all-reduced (the clock's
        last bucket marks the end of the compute)."""
        use_clock = synced and self.clock is not None
        if self.events is not None:
            end = self.clock.last_event if use_clock and self.clock.last_event is not None else None
            if end is None:
                end = self.events()
                end.record()
            self._pairs.append((self._start, end))
        else:
            end = self.clock.last if use_clock and self.clock.last is not None else time.perf_counter()
            self._seconds += end - self._t0

    def step_seconds(self, wait: bool = False) -> float:
        if self.events is None:
            seconds, self._seconds = self._seconds, 0.0
            return seconds
        if wait:
            pairs, self._previous = self._pairs, []
        else:
            pairs, self._previous = self._previous, self._pairs
        self._pairs = []
        if pairs:
            pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in pairs) / 1e3


def parallelize(model: nn.Module, ctx: DistContext, device: torch.device) -> tuple[nn.Module, BucketClock | None]:
    """(the module to run forward/backward on, the clock of this rank's backward or None)."""
    if not ctx.distributed:
        return model, None
    net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)
    clock = BucketClock(cuda_event if device.type == "cuda" else None)
    net.register_comm_hook(None, clock.hook)
    return net, clock


def is_data_parallel(net: nn.Module) -> bool:
    return isinstance(net, DistributedDataParallel)


def compile_decision(mode: str, device: torch.device, memory_plan: bool) -> tuple[bool, str]:
    """(compile?, why). A memory plan's per-tensor hooks and recompute wrappers see the eager
    block's saved tensors, which a compiled graph replaces with its own, so the two do not mix yet."""
    if mode == "off":
        return False, "train.compile=off"
    if memory_plan:
        if mode == "on":
            raise ConfigError("train.compile=on cannot run under an activation memory plan yet (the plan's "
                              "per-tensor decisions need the eager block's saved tensors); use train.compile=auto "
                              "or off, or no memory.budget")
        return False, "an activation memory plan is active (compile and plans do not mix yet)"
    if mode == "on":
        return True, "train.compile=on"
    if device.type == "cuda":
        return True, "auto: on a GPU, compiled blocks are typically 1.2-1.5x faster"
    return False, "auto: off on a CPU, where compiling gains little and costs a cold start"


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache, one per ATen CPU capability. Its key misses the capability: with
    one shared cache, kernels built under AVX-512 were reused by a process running with
    `ATEN_CPU_CAPABILITY=avx2` and trained to NaN (seen here). An explicit
    TORCHINDUCTOR_CACHE_DIR is kept."""
    if not _USER_INDUCTOR_CACHE:  # (Inductor writes its default into the variable once it has used it)
        cap = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"hetforge_inductor_{os.getuid()}_{cap}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


_USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ


def compile_blocks(model: nn.Module) -> None:
    """Regional compilation: each block's two branches compiled on their own (what the block's
    forward and a memory plan both call). Identical blocks share one compiled graph, as parameters
    are graph inputs, so the cold start is one block's, not the model's."""
    inductor_cache_dir()
    for block in getattr(model, "module", model).layers:
        block.attn_branch = torch.compile(block.attn_branch)
        block.mlp_branch = torch.compile(block.mlp_branch)
