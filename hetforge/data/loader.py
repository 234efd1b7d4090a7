"""Micro-batches built one step ahead, off the training thread.

Building a batch (gathering `seq_len + 1` windows from the memory map, stacking them) takes host
time the device would otherwise wait for. The loop asks for the next step's micro-batches while the
current one runs; a worker thread builds them (numpy releases the GIL while it copies) into pinned
memory on a GPU, so the copy to the device is truly asynchronous. A batch is named by its global
sample position and count, and its sample indices are taken from `SampleOrder` on the caller's
thread, so what is trained on stays a pure function of the position: resume, re-balancing and
world-size changes see exactly the batches they would without prefetching (a request that turns
out unneeded is dropped; one that was not made is built on the spot).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hetforge.data.shards import MixedOrder, PackedSamples, SampleOrder


class Prefetcher:
    def __init__(self, samples: PackedSamples, order: SampleOrder | MixedOrder, device: torch.device,
                 pin_memory: bool | None = None, depth: int = 64):
        self.samples, self.order, self.device = samples, order, device
        self.pin = device.type == "cuda" if pin_memory is None else pin_memory
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetforge-batches")
        self._pending: dict[tuple[int, int], Future] = {}
        self.hits = self.misses = 0

    def _build(self, indices: list[int]) -> torch.Tensor:
        t = torch.from_numpy(self.samples.batch(indices))
        return t.pin_memory() if self.pin else t

    def request(self, micro_batches: list[tuple[int, int]]) -> None:
        """Start building these (global position, count) micro-batches."""
        for key in micro_batches:
            if key not in self._pending and len(self._pending) < self.depth:
                self._pending[key] = self._pool.submit(self._build, self.order.indices(*key))

    def get(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of one micro-batch, on the device. One contiguous copy
        (asynchronous from pinned memory), then views: slicing first would copy from pageable memory."""
        fut = self._pending.pop((start, count), None)
        if fut is not None:
            self.hits += 1
            host = fut.result()
        else:
            self.misses += 1
            host = self._build(self.order.indices(start, count))
        # requests for positions behind this one will never be asked for (a re-balanced step)
        for key in [k for k in self._pending if k[0] < start]:
            self._pending.pop(key).cancel()
        windows = host.to(self.device, non_blocking=self.pin)
        return windows[:, :-1], windows[:, 1:]

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)
