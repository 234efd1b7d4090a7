"""The matmul peak that MFU is measured against (the FLOPs themselves are counted in
`hetforge.model.accounting`)."""

from __future__ import annotations

import time

import torch


def measure_matmul_peak(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, size: int | None = None,
    seconds: float = 1.0,
) -> float:
    """Achievable dense-matmul FLOP/s on this device and dtype (best of repeated square matmuls).

    A measured peak, not the datasheet one: on a shared CPU the datasheet number is meaningless,
    and MFU against what the hardware can really do is what tells whether the loop is efficient.
    """
    device = torch.device(device)
    if size is None:
        size = 2048 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):  # warm-up: thread pools, kernels, clocks
        torch.mm(a, b)
    sync()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best
