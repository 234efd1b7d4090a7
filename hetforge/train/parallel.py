"""Data parallelism applied to a plain model from outside (torchtitan's `parallelize`), as the run's
plan says: the training loop calls one function and steps whatever it returns.

Replicated (ddp, and zero1 with `ZeroRedundancyOptimizer` from `train.optim`): DistributedDataParallel
with gradients as views of its buckets (one copy of them, not two) and a communication hook that
notes when each bucket is ready, i.e. when this rank's own backward compute ended, before any waiting
for slower ranks (the balancer needs each rank's own speed; on a GPU the note is a CUDA event, see
`ComputeTimer`). Sharded (zero2, fsdp): FSDP2's `fully_shard` per unit of blocks, applied on the meta
device before the weights exist (`shard_model`, `init_sharded`), with HSDP over a 2-D mesh
(`device_mesh`). One process: the model itself. Regional compilation of the blocks is here too.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from hetforge.cluster.dist import DistContext
from hetforge.core.errors import ConfigError
from hetforge.memory.compiled import compile_chain
from hetforge.model.accounting import MIN_UNIT_PARAMS, block_groups
from hetforge.model.gpt_neox import initial_value


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


@dataclass
class Parallel:
    """What `parallelize` made of the model, and what the loop must know of it."""

    net: nn.Module  # forward/backward run on this
    strategy: str  # ddp | zero1 | zero2 | fsdp (single: one process)
    clock: BucketClock | None = None
    # each micro-batch's loss is multiplied by this: DDP averages gradients over the ranks (undone
    # by the world size); FSDP here sums them (see `shard_model`), so 1
    grad_weight: float = 1.0
    sharded: bool = False  # parameters are DTensor shards (state goes through DCP)
    # FSDP2 accumulating unsharded (`model.accounting.ACCUMULATIONS`): the step's first micro-batch
    # gathers the weights, its last reduce-scatters the gradients, none between
    accumulate_unsharded: bool = False

    def sync(self, last: bool):
        """The context of one micro-batch's forward/backward: DDP all-reduces on the last only, and
        so does FSDP2 accumulating unsharded, whose weights also stay gathered until then."""
        if isinstance(self.net, DistributedDataParallel) and not last:
            return self.net.no_sync()
        if self.accumulate_unsharded:
            self.net.set_requires_gradient_sync(last)
            self.net.set_reshard_after_backward(last)
        return contextlib.nullcontext()


def shard_model(model: nn.Module, mesh, strategy: str, reshard_after_forward: bool | None, offload: str,
                param_dtype: torch.dtype | None, unit_params: int = MIN_UNIT_PARAMS) -> None:
    """FSDP2 (`fully_shard`) from outside: the input embedding, each group of blocks
    (`model.accounting.block_groups`: one block, or consecutive small ones together), and the final
    norm with the output projection each become a unit gathered on its own (tied embeddings stay in
    the root, as a weight must live in one unit), then the root.

    Gradients are *summed* over ranks, not averaged: the loop's loss is already divided by the
    global token count, which is what makes unequal shares exact. FSDP2 would otherwise divide by
    the world size, and on gloo its averaging reduction is not supported; both are switched off
    (`set_gradient_divide_factor(1)` with sum-only collectives), checked by the tests against DDP."""
    reshard = (strategy == "fsdp") if reshard_after_forward is None else reshard_after_forward
    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
              offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload == "params"
              else OffloadPolicy())
    tied = model.embed_out.weight is model.embed_in.weight
    if not tied:
        fully_shard(model.embed_in, reshard_after_forward=reshard, **kw)
    blocks = list(model.layers)
    for group in block_groups(model.cfg, unit_params):
        members = [blocks[i] for i in group]
        fully_shard(members if len(members) > 1 else members[0], reshard_after_forward=reshard, **kw)
    if not tied:
        fully_shard([model.final_layer_norm, model.embed_out], reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    sum_gradients(model)


def sum_gradients(root: nn.Module) -> None:
    """Every FSDP2 unit under `root` sums its gradients over its ranks, with sum-only collectives
    (see `shard_model`: the loss is already over the global batch's tokens)."""
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def local_sharding(device: torch.device, strategy: str, param_dtype: torch.dtype | None, unit_params: int):
    """A function that shards a model into the units `shard_model` makes, on a mesh of the calling
    rank alone, accumulating (after the first micro-step's gather, none runs a collective): the
    probe times its proxy under it, so that a micro-batch costs FSDP2's hooks as it does in the
    loop, with no wait for another rank. The one-rank group is made by this rank alone (ranks probe
    different sizes, so no collective may pace them), only when a model is wrapped (a reused
    balance or declared speeds time nothing), and destroyed on exit."""
    groups = []

    def wrap(model: nn.Module) -> nn.Module:
        groups.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))
        mesh = DeviceMesh.from_group(groups[-1], device.type, mesh_dim_names=("shard",))
        shard_model(model, mesh, strategy, False, "none", param_dtype, unit_params)
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        return model

    try:
        yield wrap
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def device_mesh(ctx: DistContext, device: torch.device, replicate: int | None, shard: int | None):
    """1-D over all ranks, or (replicate, shard) for hybrid sharding; a shape that does not cover
    the world is the user's error, said before anything is built."""
    world = ctx.world_size
    if replicate is None and shard is None:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    r = replicate or world // (shard or world)
    s = shard or world // r
    if r * s != world:
        raise ConfigError(f"parallel.mesh replicate={replicate} x shard={shard} does not cover the "
                          f"{world} ranks of this job (replicate x shard must equal the world size)")
    if r == 1:
        return init_device_mesh(device.type, (s,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (r, s), mesh_dim_names=("replicate", "shard"))


def shard_group_size(mesh) -> int:
    return mesh.size(mesh.ndim - 1)


@torch.no_grad()
def init_sharded(model: nn.Module, device: torch.device, seed: int) -> None:
    """Give a model built on the meta device and sharded its storage, and initialise it shard by
    shard: each rank draws each parameter's full initial value (one tensor at a time, on the
    host) and keeps its slice, so the weights equal an unsharded model's with the same seed."""
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        full = initial_value(model.cfg, name, tuple(p.shape), seed)
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
    model.rotary.reset_buffers()


def parallelize(model: nn.Module, ctx: DistContext, device: torch.device, strategy: str,
                mesh=None, accumulation: str = "sharded") -> Parallel:
    """Wrap the model for data parallelism. Sharded strategies are applied earlier, on the meta
    device (`shard_model`, before the weights exist); here DDP wraps the replicated ones, and a
    sharded model accumulating unsharded keeps its gathered weights from forward to backward (so
    that no micro-batch but the first gathers)."""
    if not ctx.distributed:
        return Parallel(model, "single")
    if strategy in ("zero2", "fsdp"):
        unsharded = accumulation == "unsharded"
        if unsharded:
            model.set_reshard_after_forward(False)
        return Parallel(model, strategy, sharded=True, accumulate_unsharded=unsharded)
    net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)
    clock = BucketClock(cuda_event if device.type == "cuda" else None)
    net.register_comm_hook(None, clock.hook)
    return Parallel(net, strategy, clock, grad_weight=float(ctx.world_size))


def compile_blocks(model: nn.Module, whole_chain: bool = False) -> None:
    """Regional compilation of the model's blocks (`memory.compiled.compile_chain`); `whole_chain`
    where the run is one process."""
    compile_chain(getattr(model, "module", model).layers, whole_chain)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds of weights, gradients and optimizer state (its shards, under FSDP or
    ZeRO-1): what the planner's static bytes predict, measured on the tensors themselves."""
    params = [p for p in model.parameters()]
    seen, weights, grads = set(), 0, 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        weights += _local(p).numel() * p.element_size()
        if p.grad is not None:
            grads += _local(p.grad).numel() * p.grad.element_size()
    if hasattr(optimizer, "inner"):  # HostOffloadOptimizer: its state is in host memory
        return {"weights": weights, "gradients": grads, "optimizer state": 0}
    inner = getattr(optimizer, "optim", None) or optimizer  # ZeroRedundancyOptimizer: this rank's part
    state = 0
    for st in inner.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                state += _local(v).numel() * v.element_size()
    return {"weights": weights, "gradients": grads, "optimizer state": state}
