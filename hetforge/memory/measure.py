"""Measuring the memory a piece of work really allocates, on a GPU and on the CPU.

On CUDA the caching allocator keeps statistics (`max_memory_allocated`). On the CPU the process RSS
is useless (freed memory stays mapped), but the profiler with `profile_memory=True` records every
allocation and free of PyTorch's CPU allocator; their running sum in time order is the exact bytes
allocated at each moment, and deterministic for the same work. That makes the planner's predictions
checkable here, with no GPU.
"""

from __future__ import annotations

import os

import torch

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
