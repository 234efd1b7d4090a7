"""Running a plan: each block branch is kept, recomputed (non-reentrant `torch.utils.checkpoint`) or
offloaded (saved-tensor hooks that copy to host after the forward and prefetch one block ahead of
the backward). Numerics are unchanged: the same ops run on the same values.

One `saved_tensors_hooks` pair wraps the block loop. Only the innermost hook fires, so inside a
checkpointed branch it sees just the checkpoint's saved input, which is exactly what that branch
keeps on the device. Every saved tensor passes through `ActivationLedger`, which counts device and
host bytes per storage (views share one) and so measures what the plan holds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from hetforge.memory.plan import OPTIONS, Plan


class _Saved:
    """What autograd stores instead of a tensor; its release (end of that node's backward) is what
    frees the bytes in the ledger."""

    __slots__ = ("ledger", "key", "tensor", "host", "device", "event", "nbytes", "__weakref__")

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
    tensors: list[dict] = field(default_factory=list)  # filled when `record` is on
    record: bool = False
    label: str = ""

    def reset_peaks(self) -> None:
        self.peak_device, self.peak_host = self.device_bytes, self.host_bytes

    def _hold_device(self, t: torch.Tensor) -> int | None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.params:
            return None
        cnt, nb = self._refs.get(key, (0, st.nbytes()))
        if cnt == 0:
            self.device_bytes += nb
            self.peak_device = max(self.peak_device, self.device_bytes)
            if self.record:
                self.tensors.append({"module": self.label, "shape": list(t.shape), "bytes": nb,
                                     "dtype": str(t.dtype).replace("torch.", "")})
        self._refs[key] = (cnt + 1, nb)
        return key

    def _release(self, s: _Saved) -> None:
        if s.key is not None:
            cnt, nb = self._refs[s.key]
            if cnt == 1:
                del self._refs[s.key]
                self.device_bytes -= nb
            else:
                self._refs[s.key] = (cnt - 1, nb)
        if s.host is not None:
            self.host_bytes -= s.nbytes
            s.host = None


class PlanRunner:
    """The model's `block_runner` under a plan (see `GPTNeoX.forward`)."""

    def __init__(self, plan: Plan, params: set[int]):
        self.plan = plan
        self.ledger = ActivationLedger(params=params)
        self.modes = [OPTIONS[o] for o in plan.options]
        self.segments = {s: e for s, e in (plan.segments or [])}
        self._mode = "keep"
        self._block = -1
        self._offloaded: dict[int, list[_Saved]] = {}
        self.copy_stream = None

    # --- saved-tensor hooks ---------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        s = _Saved()
        s.ledger, s.host, s.event, s.nbytes = self.ledger, None, None, 0
        s.device = t.device
        if self._mode == "offload" and t.untyped_storage().data_ptr() not in self.ledger.params:
            s.key = None
            s.tensor = None
            s.nbytes = t.numel() * t.element_size()
            if t.device.type == "cuda":
                if self.copy_stream is None:
                    self.copy_stream = torch.cuda.Stream(t.device)
                self.copy_stream.wait_stream(torch.cuda.current_stream(t.device))
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                with torch.cuda.stream(self.copy_stream):
                    host.copy_(t, non_blocking=True)
                t.record_stream(self.copy_stream)
            else:  # CPU: the "host" is a separate buffer; the link is modelled by the planner
                host = t.detach().clone()
            s.host = host
            self.ledger.host_bytes += s.nbytes
            self.ledger.peak_host = max(self.ledger.peak_host, self.ledger.host_bytes)
            self._offloaded.setdefault(self._block, []).append(weakref.ref(s))
            return s
        s.key = self.ledger._hold_device(t)
        s.tensor = t
        return s

    def _fetch(self, s: _Saved) -> None:
        if s.tensor is not None or s.host is None:
            return
        if s.device.type == "cuda":
            stream = self.copy_stream or torch.cuda.current_stream(s.device)
            with torch.cuda.stream(stream):
                s.tensor = s.host.to(s.device, non_blocking=True)
            s.event = torch.cuda.Event()
            s.event.record(stream)
        else:
            s.tensor = s.host

    def _unpack(self, s: _Saved) -> torch.Tensor:
        if s.tensor is None:
            self._fetch(s)
        if s.event is not None:
            torch.cuda.current_stream(s.device).wait_event(s.event)
            s.tensor.record_stream(torch.cuda.current_stream(s.device))
            s.event = None
        return s.tensor

    def _prefetch(self, block: int) -> None:
        for ref in self._offloaded.pop(block, []):
            s = ref()
            if s is not None:
                self._fetch(s)

    # --- the block loop --------------------------------------------------------------------
    def _run_branch(self, block: int, name: str, fn, *args):
        mode = self.modes[block][0 if name == "attn" else 1]
        if block in self._in_segment:
            mode = "keep"  # the segment's own checkpoint decides
        prev = self._mode
        self._mode, self._block = mode, block
        self.ledger.label = f"{name}"
        try:
            if mode == "recompute" and torch.is_grad_enabled():
                return checkpoint(fn, *args, use_reentrant=False)
            return fn(*args)
        finally:
            self._mode = prev

    def __call__(self, layers, x, cos, sin):
        self._in_segment: set[int] = set()
        self._offloaded = {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            i, n = 0, len(layers)
            while i < n:
                if i in self.segments:
                    s, e = i, self.segments[i]
                    self._in_segment = set(range(s, e))

                    def seg(h, s=s, e=e):
                        for j in range(s, e):
                            h = layers[j](h, cos, sin, run=lambda nm, f, *a, j=j: self._run_branch(j, nm, f, *a))
                        return h

                    self._mode, self._block = "keep", s
                    x = checkpoint(seg, x, use_reentrant=False) if torch.is_grad_enabled() else seg(x)
                    self._in_segment = set()
                    i = e
                    continue
                x = layers[i](x, cos, sin, run=lambda nm, f, *a, i=i: self._run_branch(i, nm, f, *a))
                if i > 0 and (i - 1) in self._offloaded and x.requires_grad:
                    # B_i is about to start when this gradient arrives: bring block i-1 back now
                    x.register_hook(lambda g, b=i - 1: (self._prefetch(b), g)[1])
                i += 1
        self._mode, self._block = "keep", -1
        return x


def parameter_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def apply_plan(model: torch.nn.Module, plan: Plan | None) -> PlanRunner | None:
    """Install `plan` on a hetforge GPTNeoX (or remove any plan with None). Returns the runner,
    whose ledger measures the saved-activation bytes of each step."""
    core = getattr(model, "module", model)
    if plan is None:
        core.block_runner = None
        return None
    if len(plan.options) != len(core.layers):
        raise ValueError(f"plan is for {len(plan.options)} blocks, the model has {len(core.layers)}")
    runner = PlanRunner(plan, parameter_storages(core))
    core.block_runner = runner
    return runner
