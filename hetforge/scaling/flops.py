"""FLOPs accounting and the matmul peak that MFU is measured against.

Training FLOPs per token = 6·N + 12·L·d·s (PaLM, appendix B): 6 FLOPs per weight per token for the
forward and backward matmuls, plus the attention score/value products that no weight accounts for.
N here is the non-embedding parameter count *plus the output projection* (V·d): the input
embedding is a table lookup and costs nothing, but the logits are a real V×d matmul on every token,
and for the small models this project trains on CPUs it is a third of all the work. MFU excludes
recomputation (model FLOPs); HFU includes it (hardware FLOPs).
"""

from __future__ import annotations

import time

import torch


def matmul_params(n_layers: int, d_model: int, d_ff: int, vocab_size: int) -> int:
    """Weights that take part in a matmul for every token (biases and norms are negligible)."""
    return n_layers * (4 * d_model * d_model + 2 * d_model * d_ff) + vocab_size * d_model


def flops_per_token(n_layers: int, d_model: int, d_ff: int, vocab_size: int, seq_len: int) -> float:
    """Model FLOPs for one trained token (forward + backward), attention included."""
    return 6.0 * matmul_params(n_layers, d_model, d_ff, vocab_size) + 12.0 * n_layers * d_model * seq_len


def block_forward_flops_per_token(n_layers: int, d_model: int, d_ff: int, seq_len: int) -> float:
    """The transformer blocks' share of one token's forward: what recomputation repeats."""
    return 2.0 * n_layers * (4 * d_model * d_model + 2 * d_model * d_ff) + 4.0 * n_layers * d_model * seq_len


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
