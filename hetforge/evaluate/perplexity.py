"""Held-out loss, perplexity and bits per byte.

Bits per byte divides the summed negative log-likelihood by the UTF-8 bytes the predicted tokens
stand for, so models with different tokenizers (or vocabularies) can be compared; perplexity cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetforge.data.shards import PackedSamples, batch_from_numpy


@dataclass
class EvalResult:
    loss: float  # mean nats per token
    perplexity: float
    bits_per_byte: float | None
    tokens: int

    def to_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte,
                "tokens": self.tokens}

    @classmethod
    def from_sums(cls, nll_sum: float, tokens: float, nbytes: float) -> "EvalResult":
        """From the summed NLL (nats), the tokens and the UTF-8 bytes they stand for."""
        loss = nll_sum / max(int(tokens), 1)
        bpb = nll_sum / math.log(2) / nbytes if nbytes > 0 else None
        return cls(loss, math.exp(min(loss, 700.0)), bpb, int(tokens))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    samples: PackedSamples,
    batch_size: int,
    device: torch.device,
    max_batches: int | None = None,
    byte_lengths: list[int] | None = None,
    autocast=None,
    rank: int = 0,
    world_size: int = 1,
    reduce=None,
    lockstep: bool = False,
) -> EvalResult:
    """Evaluate on the first samples of the split, in order: the same tokens every time it runs.
    With several ranks, rank r takes batches r, r + world, ...; `reduce` sums the (nll, tokens,
    bytes) totals over ranks, so every rank returns the same global result. `lockstep`: every
    rank runs as many forwards (a sharded model's forward is a collective); a rank past the end
    runs the first batch again and counts nothing."""
    was_training = model.training
    model.eval()
    n = len(samples) if max_batches is None else min(len(samples), max_batches * batch_size)
    lengths = torch.tensor(byte_lengths, dtype=torch.float64) if byte_lengths else None
    nll_sum, tokens, nbytes = 0.0, 0, 0.0
    starts = list(range(rank * batch_size, n, world_size * batch_size))
    rounds = math.ceil(n / (world_size * batch_size)) if lockstep else len(starts)
    for i in range(rounds):
        start = starts[i] if i < len(starts) else None
        first = 0 if start is None else start
        x, y = batch_from_numpy(samples.batch(list(range(first, min(first + batch_size, n)))), device)
        if autocast is not None:
            with autocast():
                logits = model(x)
        else:
            logits = model(x)
        if start is None:
            continue
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        nll_sum += float(nll)
        tokens += y.numel()
        if lengths is not None:
            nbytes += float(lengths[y.flatten().cpu().clamp_max(len(lengths) - 1)].sum())
    model.train(was_training)
    if reduce is not None:
        nll_sum, tokens, nbytes = (float(v) for v in reduce(torch.tensor([nll_sum, tokens, nbytes], dtype=torch.float64)))
        tokens = int(tokens)
    return EvalResult.from_sums(nll_sum, tokens, nbytes)
