"""Measuring the memory a piece of work really allocates, on a GPU and on the CPU.

On CUDA the caching allocator keeps statistics (`max_memory_allocated`). On the CPU the process RSS
is useless (freed memory stays mapped), but the profiler with `profile_memory=True` records every
allocation and free of PyTorch's CPU allocator; their running sum in time order is the exact bytes
allocated at each moment, and deterministic for the same work. That makes the planner's predictions
checkable here, with no GPU.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# kineto prints two lines per profiling session at its default level; the meter opens many.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class PeakMeter:
    """`with PeakMeter(device) as m: work()` -> `m.peak`: the most bytes allocated at any moment of
    the work, above what was allocated when it began; `m.net`: the change at its end."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak = 0
        self.net = 0
        self._prof = None
        self._base = 0

    def __enter__(self) -> "PeakMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.net = torch.cuda.memory_allocated(self.device) - self._base
            return
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        running = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            running += e.nbytes()
            peak = max(peak, running)
        self.peak, self.net = peak, running
        self._prof = None


class TracedMemory(TorchDispatchMode):
    """The bytes allocated at each moment of work on fake tensors (`FakeTensorMode`), where no
    allocator runs: every op output on a storage none of the op's inputs has is an allocation,
    freed when the storage is (a weak reference's callback). `meter()` gives `PeakMeter`'s figures
    over a piece of that work, frees of earlier allocations included, as the allocator's statistics
    count them. Sees what ops make, not the scratch buffers a kernel allocates and frees inside
    itself (a card's kernels have their own anyway). Enter it inside the fake mode, for the whole
    traced work."""

    def __init__(self):
        super().__init__()
        self.allocated = 0
        self._live: dict[int, int] = {}
        self._windows: list["_Window"] = []

    def meter(self, device: torch.device | str | None = None) -> "_Window":
        return _Window(self)

    def _free(self, key: int) -> None:
        self.allocated -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in given or key in self._live:
                continue
            self._live[key] = storage.nbytes()
            self.allocated += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            for w in self._windows:
                w.peak = max(w.peak, self.allocated - w.base)
        return out


class _Window:
    def __init__(self, memory: TracedMemory):
        self.memory, self.peak, self.net, self.base = memory, 0, 0, 0

    def __enter__(self) -> "_Window":
        self.base = self.memory.allocated
        self.memory._windows.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.memory._windows.remove(self)
        self.net = self.memory.allocated - self.base
