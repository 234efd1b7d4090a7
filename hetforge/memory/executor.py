"""Running a plan: per block and branch, keep, offload or rebuild each saved unit (saved-tensor
hooks that copy to the host after the forward and prefetch one block ahead of the backward, or that
store nothing and run the op that made the unit again when the backward unpacks it), or recompute the
branch (non-reentrant `torch.utils.checkpoint`) caching the op units the plan names (selective
activation checkpointing), or run a kept branch compiled at a partitioner budget under 1
(`memory.compiled`). Numerics are unchanged: the same ops run on the same values (a compiled branch
up to its kernels' rounding).

One `saved_tensors_hooks` pair wraps the block loop. Only the innermost hook fires, so inside a
checkpointed branch it sees just the checkpoint's saved inputs, which is what that branch keeps on
the device besides the outputs its policy caches. Every saved tensor and every cached output passes
through `ActivationLedger`, which counts device and host bytes (per storage on the device, per view
on the host: two saves of one view share one copy) and so measures what the plan holds.

On the CPU an offloaded tensor's copy is held in NumPy memory, outside PyTorch's allocator, so the
memory meter sees it leave as it would leave a GPU; the link itself is modelled by the planner.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hetforge.memory.compiled import compiled_at
from hetforge.memory.plan import ALL, BRANCHES, BranchPlan, Decision, Plan, resolve_option
from hetforge.memory.units import (Labeller, is_view_op, rebuild_fn, rebuilds, remade_by_op, storage_key, tensor_bytes,
                                   view_key)
from hetforge.model.gpt_neox import Blocks


def dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of a tensor that covers its elements without gaps or overlap (contiguous, or a
    permutation of it), else None."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return None
        expected *= size
    return tuple(t.stride())


class _HostCopy:
    """One offloaded view: its host copy and, once prefetched, the device tensor. Only the saved
    tensors that use it hold it, so it (and the fetched tensor) goes when their backward is done.
    A dense tensor comes back with its own strides: a compiled backward checks the layout of what
    its forward saved (a transposed attention tensor, say)."""

    __slots__ = ("host", "shape", "stride", "dtype", "device", "tensor", "event", "nbytes", "serial", "__weakref__")
    _serials = itertools.count()

    def __init__(self, t: torch.Tensor, stream):
        self.serial = next(self._serials)  # storage addresses are reused once freed; this is not
        self.shape, self.dtype, self.device, self.nbytes = t.shape, t.dtype, t.device, tensor_bytes(t)
        self.stride = dense_strides(t)
        self.tensor, self.event = None, None
        if t.device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(t.device))
            self.host = self._empty(pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)
        else:
            self.host = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()

    def fetch(self, stream) -> None:
        if self.tensor is not None:
            return
        if self.device.type == "cuda":
            with torch.cuda.stream(stream):
                self.tensor = self.host.to(self.device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        else:
            src = torch.from_numpy(self.host).view(self.dtype).view(self.shape)
            self.tensor = self._empty().copy_(src)

    def _empty(self, pin_memory: bool = False) -> torch.Tensor:
        if self.stride is None:
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=pin_memory)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, pin_memory=pin_memory)

    def get(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.tensor.record_stream(torch.cuda.current_stream(self.device))
            self.event = None
        return self.tensor


@dataclass
class _Remake:
    """How a rebuilt saved tensor is made again: the op that made it, applied to its source (held as
    the source's own `_Saved`, so an offloaded source comes back from the host as usual), in the
    forward's autocast state, cast to the dtype that was saved and laid out as the saved view."""

    source: "_Saved"
    fn: object
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int
    autocast: tuple  # (device type, enabled, dtype)

    def make(self, source: torch.Tensor) -> torch.Tensor:
        device_type, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            out = self.fn(source)
        return out.to(self.dtype).contiguous().as_strided(self.shape, self.stride, self.offset)


class _Saved:
    """What autograd stores instead of a tensor; its release (end of that node's backward) is what
    frees the bytes in the ledger."""

    __slots__ = ("ledger", "key", "hkey", "tensor", "copy", "remake", "__weakref__")

    def __init__(self, ledger: "ActivationLedger"):
        self.ledger, self.key, self.hkey, self.tensor, self.copy, self.remake = ledger, None, None, None, None, None

    def __del__(self):
        try:
            self.ledger._release(self)
        except Exception:  # interpreter shutdown
            pass


@dataclass
class ActivationLedger:
    """Counts bytes of saved activations alive on the device and on the host; `peak_device` is
    the high-water mark of device bytes held for backward (what the planner predicts as held)."""

    params: set[int] = field(default_factory=set)
    device_bytes: int = 0
    host_bytes: int = 0
    peak_device: int = 0
    peak_host: int = 0
    _refs: dict = field(default_factory=dict)
    _host_refs: dict = field(default_factory=dict)
    tensors: list[dict] = field(default_factory=list)  # filled when `record` is on
    record: bool = False

    def reset_peaks(self) -> None:
        self.peak_device, self.peak_host = self.device_bytes, self.host_bytes

    def hold_device(self, t: torch.Tensor) -> int | None:
        key = storage_key(t)
        if key in self.params:
            return None
        cnt, nb = self._refs.get(key, (0, t.untyped_storage().nbytes()))
        if cnt == 0:
            self.device_bytes += nb
            self.peak_device = max(self.peak_device, self.device_bytes)
        self._refs[key] = (cnt + 1, nb)
        return key

    def release_device(self, key: int) -> None:
        cnt, nb = self._refs[key]
        if cnt == 1:
            del self._refs[key]
            self.device_bytes -= nb
        else:
            self._refs[key] = (cnt - 1, nb)

    def hold_host(self, hkey: int, nbytes: int) -> None:
        cnt, _ = self._host_refs.get(hkey, (0, nbytes))
        if cnt == 0:
            self.host_bytes += nbytes
            self.peak_host = max(self.peak_host, self.host_bytes)
        self._host_refs[hkey] = (cnt + 1, nbytes)

    def _release(self, s: _Saved) -> None:
        if s.key is not None:
            self.release_device(s.key)
            s.key = None
        if s.hkey is not None:
            cnt, nb = self._host_refs[s.hkey]
            if cnt == 1:
                del self._host_refs[s.hkey]
                self.host_bytes -= nb
            else:
                self._host_refs[s.hkey] = (cnt - 1, nb)
            s.hkey = None


def input_users(parallel_residual: bool) -> dict[str, tuple[str, ...]]:
    """The input units of a block and the branches that save them."""
    return {"x": ("attn", "mlp")} if parallel_residual else {"x": ("attn",), "mlp.input": ("mlp",)}


class _BlockState:
    """Per block, per step: who owns each saved storage (its first saver decides for all), the
    block's input storages, its host copies and the outputs its selective checkpoints cache.

    Storages are known by address, and a freed address is soon reused: the offloaded tensors are
    held (`alive`) until the block's forward ends, so no address changes hands while these maps are
    read; the block's own forward peak includes them anyway."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.inputs: dict[int, str] = {}
        self.copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.alive: list[torch.Tensor] = []
        self.cached: list[int] = []
        # per unit, its latest save in a kept branch (a rebuild's source); weak, or it would hold the
        # tensor past the backward that releases it
        self.last: dict[str, weakref.ref] = {}
        self.views: dict[tuple, weakref.ref] = {}  # saves of a unit that a rebuild finds by the view a module read
        self.block: torch.nn.Module | None = None
        self.autocast: tuple = ("cpu", False, torch.bfloat16)  # the forward's (device type, enabled, dtype)


class PlanRunner:
    """Runs a chain of blocks under a plan (what `PlannedBlocks` calls)."""

    def __init__(self, plan: Plan, params: set[int], parallel_residual: bool = True, random: bool = True):
        self.plan = plan
        self.random = random  # the blocks draw random numbers (dropout): recomputation must replay them
        self.ledger = ActivationLedger(params=params)
        self.labeller = Labeller()
        users = input_users(parallel_residual)
        self.decisions: list[Decision] = [resolve_option(o, users) for o in plan.options]
        self.rebuilds = rebuilds(parallel_residual)
        self._by_view = {rb.source for rb in self.rebuilds.values() if rb.by_input}
        self.segments = {s: e for s, e in (plan.segments or [])}
        self.copy_stream = None
        self._branch = None  # (block, branch name, mode) while a branch runs
        self._state: dict[int, _BlockState] = {}
        self._in_segment: set[int] = set()
        self._handles: list = []  # the labeller's module hooks, removed when the plan is replaced
        self._budgeted: dict[tuple, object] = {}  # (block, branch, budget) -> the branch compiled at it
        # Count every saved byte in the ledger. Off, blocks that only keep or recompute run without
        # the saved-tensor hooks (their Python cost per tensor); the training loop measures one step.
        self.measure = True
        # nothing to do per block (keep-all): unmeasured steps run the plain chain, compiled whole
        # where the run compiles it (`compiled.compile_chain`)
        self.plain_keep = not plan.segments and all(d == Decision(BranchPlan("keep"), BranchPlan("keep"))
                                                    for d in self.decisions)

    # --- saved-tensor hooks ---------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        s = _Saved(self.ledger)
        key = storage_key(t)
        if key in self.ledger.params or self._branch is None or isinstance(t, torch.nn.Parameter):
            s.tensor = t
            return s
        block, branch, mode = self._branch
        st = self._state[block]
        unit = st.owner.setdefault(key, st.inputs.get(key) or self.labeller.saved_unit())
        d = self.decisions[block]
        if mode == "keep" and block not in self._in_segment:
            bp = d.branch(branch)
            offload = unit in d.offload_inputs if unit in st.inputs.values() else (ALL in bp.units or unit in bp.units)
        else:
            offload = False  # a checkpoint's own inputs stay: its recomputation starts from them
        if self.ledger.record:
            self.ledger.tensors.append({"unit": unit, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                        "key": key, "bytes": t.untyped_storage().nbytes(), "view": view_key(t),
                                        "view_bytes": tensor_bytes(t)})
        if mode == "keep" and block not in self._in_segment:
            if not offload and unit in d.branch(branch).rebuilt:
                s.remake = self._remake(st, unit, t)
                if s.remake is not None:
                    st.alive.append(t)  # its address must not change hands before the forward ends
                    if self.ledger.record:
                        self.ledger.tensors[-1]["rebuilt"] = True
                    return s
            st.last[unit] = weakref.ref(s)
            if unit in self._by_view:
                st.views[view_key(t)] = st.last[unit]
        if offload:
            vk = view_key(t)
            copy = st.copies.get(vk)
            if copy is None:
                if t.device.type == "cuda" and self.copy_stream is None:
                    self.copy_stream = torch.cuda.Stream(t.device)
                copy = st.copies[vk] = _HostCopy(t, self.copy_stream)
                st.alive.append(t)
            s.copy, s.hkey = copy, copy.serial
            self.ledger.hold_host(copy.serial, copy.nbytes)
            return s
        s.key = self.ledger.hold_device(t)
        s.tensor = t
        return s

    def _unpack(self, s: _Saved) -> torch.Tensor:
        if s.tensor is not None:
            return s.tensor
        if s.remake is not None:
            return s.remake.make(self._unpack(s.remake.source))
        s.copy.fetch(self._stream(s.copy.device))
        return s.copy.get()

    def _remake(self, st: _BlockState, unit: str, t: torch.Tensor) -> _Remake | None:
        """How to make `t` again from its source unit's save in this branch; None (it is kept) where
        the source was not saved or its size does not give `t`'s storage."""
        rb = self.rebuilds.get(unit)
        if rb is None:
            return None
        ref = st.views.get(self.labeller.read.get(rb.module)) if rb.by_input else st.last.get(rb.source)
        source = ref() if ref is not None else None
        if source is None:
            return None
        like = source.tensor if source.tensor is not None else source.copy
        if like is None or not remade_by_op(t, tuple(like.shape), rb.same_last_dim):
            return None
        fn = rebuild_fn(st.block, rb)
        if isinstance(fn, torch.nn.Module):
            fn = fn.forward  # not its hooks (a label, a simulated slowdown): they belong to the forward
        return _Remake(source, fn, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), st.autocast)

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        return self.copy_stream or torch.cuda.current_stream(device)

    # The backward's hooks take the block state of the forward that registered them, not the
    # latest: under a pipeline schedule another micro-batch's forward runs between the two.
    def _prefetch(self, st: _BlockState) -> None:
        for copy in list(st.copies.values()):
            copy.fetch(self._stream(copy.device))

    def _release_cached(self, st: _BlockState) -> None:
        while st.cached:
            self.ledger.release_device(st.cached.pop())

    # --- selective checkpointing: which op outputs a recomputed branch caches ----------------
    def _policy(self, st: _BlockState, cached: frozenset, ctx, op, *args, **kwargs):
        unit = self.labeller.op_unit(op)  # advances the labeller on every op, views included
        if unit is None or unit not in cached or is_view_op(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and all(storage_key(a) in self.ledger.params for a in tensors):
            return CheckpointPolicy.PREFER_RECOMPUTE  # a weight cast: cheap, and not an activation
        for out in tree_leaves(ctx.op_output):
            if isinstance(out, torch.Tensor):
                if self.ledger.record:
                    self.ledger.tensors.append({"unit": unit, "shape": list(out.shape), "cached": True,
                                                "key": storage_key(out), "bytes": out.untyped_storage().nbytes()})
                key = self.ledger.hold_device(out)
                if key is not None:
                    st.cached.append(key)
        return CheckpointPolicy.MUST_SAVE

    # --- the block loop --------------------------------------------------------------------
    def _run_branch(self, block: int, name: str, fn, *args):
        bp = self.decisions[block].branch(name)
        mode = "keep" if block in self._in_segment else bp.mode
        if per_op_decisions(bp):
            fn = eager(fn)
        elif mode == "keep" and bp.budget < 1:
            key = (block, name, bp.budget)
            if key not in self._budgeted:
                self._budgeted[key] = compiled_at(eager(fn), bp.budget)
            fn = self._budgeted[key]
        st = self._state[block]
        if name == "mlp" and storage_key(args[0]) not in st.inputs:
            st.inputs[storage_key(args[0])] = "mlp.input"  # sequential residual: x + attention
        prev = self._branch
        self._branch = (block, name, mode)
        try:
            if mode == "recompute" and torch.is_grad_enabled():
                # The RNG state (5 KB on the CPU, per region) is kept only where something random runs.
                kw = {"use_reentrant": False, "preserve_rng_state": self.random}
                if bp.units:
                    kw["context_fn"] = partial(create_selective_checkpoint_contexts,
                                               partial(self._policy, st, bp.units))
                return checkpoint(fn, *args, **kw)
            return fn(*args)
        finally:
            self._branch = prev

    def _block(self, layers, i: int, x, cos, sin):
        st = self._state[i] = _BlockState()
        st.inputs[storage_key(x)] = "x"
        st.block = layers[i]
        # read here: inside an op (where the saved-tensor hooks run) autocast reads as off
        dev = x.device.type
        st.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        d = self.decisions[i]
        if x.requires_grad and any(d.branch(b).mode == "recompute" and d.branch(b).units for b in BRANCHES):
            # the gradient of the block's input is complete once the block's backward is done
            x.register_hook(lambda g, st=st: (self._release_cached(st), g)[1])
        out = layers[i](x, cos, sin, run=lambda nm, f, *a, i=i: self._run_branch(i, nm, f, *a))
        st.alive.clear()
        return out

    def _hooked(self, i: int) -> bool:
        """Whether block i runs under the saved-tensor hooks: to offload, or to count its bytes."""
        d = self.decisions[i]
        hooked = d.offload_inputs or any(d.branch(b).mode == "keep" and (d.branch(b).units or d.branch(b).rebuilt)
                                         for b in BRANCHES)
        return self.measure or bool(hooked)

    def __call__(self, layers, x, cos, sin):
        self._state = {}
        self._in_segment = set()
        i, n = 0, len(layers)
        while i < n:
            if i in self.segments:
                s, e = i, self.segments[i]
                self._in_segment = set(range(s, e))

                def seg(h, s=s, e=e):
                    for j in range(s, e):
                        h = self._block(layers, j, h, cos, sin)
                    return h

                with self._hooks(s):
                    x = (checkpoint(seg, x, use_reentrant=False, preserve_rng_state=self.random)
                         if torch.is_grad_enabled() else seg(x))
                self._in_segment = set()
                i = e
                continue
            with self._hooks(i):
                x = self._block(layers, i, x, cos, sin)
            if i > 0 and len(self._state[i - 1].copies) and x.requires_grad:
                # B_i is about to start when this gradient arrives: bring block i-1 back now
                x.register_hook(lambda g, st=self._state[i - 1]: (self._prefetch(st), g)[1])
            i += 1
        self._branch = None
        return x

    def _hooks(self, i: int):
        if self._hooked(i):
            return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        return contextlib.nullcontext()

    def labelled(self, i: int) -> bool:
        """Whether block i carries the labeller's module hooks: to name its saved tensors and op
        outputs, which only a branch that treats its units one by one needs, or a ledger recording
        them. A block that keeps, recomputes or offloads its input whole counts its bytes by storage
        without them; their Python calls cost about a percent of a small block, which no price
        carried: an option's price is the difference of two labelled runs, and keep-all runs bare."""
        d = self.decisions[i]
        return self.ledger.record or any(per_op_decisions(d.branch(b)) for b in BRANCHES)

    def install_labels(self, layers) -> list:
        return [h for i, block in enumerate(layers) if self.labelled(i) for h in self.labeller.install(block)]


def per_op_decisions(bp) -> bool:
    """Whether a branch's plan treats its saved units one by one: outputs cached in a selective
    recomputation, units offloaded or rebuilt. Those choices are made on the eager ops and their saved
    tensors, which a compiled branch replaces with its own: views into its fused buffers (q, k and
    v of one projection), which only the whole buffer could bring back at the strides its backward
    checks. Such a branch runs eager. Keeping a branch, recomputing it whole and offloading the
    block's input need no op's name and run compiled where the model is (`train.compile`)."""
    return bool(bp.units or bp.rebuilt)


def eager(fn):
    """The function a `torch.compile` wrapper compiles (itself if it is not one)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def parameter_storages(model: torch.nn.Module) -> set[int]:
    """Storages of the weights (a sharded model's local shards; its gathered weights are
    recognised as parameters when saved, see `PlanRunner._pack`)."""
    return {storage_key(p.to_local() if isinstance(p, DTensor) else p) for p in model.parameters()}


class PlannedBlocks(Blocks):
    """The model's blocks, run under a plan: the same modules (and parameter names) as the
    `Blocks` it replaces, so the weights, the optimizer and DDP are untouched by a plan change."""

    def __init__(self, blocks: Blocks, runner: PlanRunner):
        super().__init__(list(blocks))
        self.runner = runner
        self.__dict__["plain"] = blocks  # the chain it wraps (not a submodule: its blocks are these)

    def forward(self, x, cos, sin):
        if self.runner.plain_keep and not self.runner.measure:
            return self.plain(x, cos, sin)
        return self.runner(self, x, cos, sin)


def runner_of(model: torch.nn.Module) -> PlanRunner | None:
    layers = getattr(model, "module", model).layers
    return layers.runner if isinstance(layers, PlannedBlocks) else None


def apply_plan(model: torch.nn.Module, plan: Plan | None, measure: bool = True) -> PlanRunner | None:
    """Wrap a hetforge GPTNeoX's blocks in `plan` from outside (or unwrap them with None). Returns
    the runner, whose ledger measures the saved-activation bytes of each step while
    `runner.measure` is on."""
    core = getattr(model, "module", model)
    old = runner_of(core)
    for h in getattr(old, "_handles", []):
        h.remove()
    plain = core.layers.plain if isinstance(core.layers, PlannedBlocks) else core.layers
    if plan is None:
        core.layers = plain
        return None
    if len(plan.options) != len(core.layers):
        raise ValueError(f"plan is for {len(plan.options)} blocks, the model has {len(core.layers)}")
    runner = PlanRunner(plan, parameter_storages(core), core.cfg.parallel_residual, random=core.cfg.dropout > 0)
    runner._handles = runner.install_labels(core.layers)
    runner.measure = measure
    core.layers = PlannedBlocks(plain, runner)
    return runner
