"""One optimizer step, read top to bottom: this rank's micro-batches forward and backward, then the
update.

Exact update on unequal ranks: every micro-batch's loss is its *sum* of token losses divided by the
number of tokens in the whole global batch, so after the all-reduce the gradient is that of the mean
loss over the global batch, whatever share and micro-batch split each rank has (DDP averages over
ranks, so each rank multiplies by the world size; FSDP here sums). A rank with no samples in a step
runs one dummy micro-batch with weight zero, so it still takes part in every collective (HetSeq's
dummy batch; under FSDP each micro-batch is one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hetforge.core.precision import Precision
from hetforge.data.loader import Prefetcher
from hetforge.data.shards import PackedSamples, SampleOrder, batch_from_numpy
from hetforge.train.parallel import ComputeTimer, Parallel
from hetforge.train.pipeline import Pipeline, clip_over_stages


class TokenLoss(torch.nn.Module):
    """Summed next-token cross-entropy, in fp32. A module, so that hooks run around it as around the
    model's units (a simulated slow device is slow at the loss as a real one is)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


_TOKEN_LOSS = TokenLoss()


def backward_share(
    par: Parallel,
    samples: PackedSamples,
    order: SampleOrder,
    micro_batches: list[tuple[int, int]],
    consumed: int,
    tokens_per_step: int,
    precision: Precision,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    loader: Prefetcher | None = None,
    timer: ComputeTimer | None = None,
    loss_fn: torch.nn.Module = _TOKEN_LOSS,
) -> tuple[torch.Tensor, ComputeTimer]:
    """Forward and backward of this rank's micro-batches, given as (global position, count), with
    the gradient sync on the last one only. Returns this rank's part of the step loss (float64, on
    the device) and the timer of its compute (waits for other ranks excluded where the strategy
    lets them be seen: `timer.step_seconds()`)."""
    work = micro_batches or [(consumed, 0)]
    step_loss = torch.zeros((), device=device, dtype=torch.float64)
    timer = timer or ComputeTimer(device, par.clock)
    for j, (start, count) in enumerate(work):
        last = j == len(work) - 1
        with par.sync(last):
            timer.start()
            n = max(count, 1)
            x, y = (loader.get(start, n) if loader is not None
                    else batch_from_numpy(samples.batch(order.indices(start, n)), device))
            with precision.autocast():
                logits = par.net(x)
            token_loss = loss_fn(logits, y)
            del logits  # nothing saved for the backward refers to the logits: at a 50k vocabulary, GBs
            weight = par.grad_weight if count else 0.0
            scaler.scale(token_loss * weight / tokens_per_step).backward()
            timer.stop(last and par.clock is not None)  # with the sync: when the last gradient bucket was ready
        if count:
            step_loss += token_loss.detach() / tokens_per_step
    return step_loss, timer


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's part of the global loss, on the device
    grad_norm: torch.Tensor
    compute_s: float  # this rank's own compute (on a GPU: the previous step's, read without a sync)
    samples: int


def pipeline_share(pipe: Pipeline, micro_batches: list[tuple[int, int]], consumed: int, tokens_per_step: int,
                   params: list[torch.nn.Parameter], precision: Precision, scaler: torch.amp.GradScaler,
                   loader: Prefetcher, timer: ComputeTimer) -> torch.Tensor:
    """This replica's micro-batches through its pipeline (one call of its schedule, which cuts
    them), then the stage's gradients summed over the replicas. A replica with no samples runs
    one micro-batch at weight zero. Returns this rank's part of the step loss."""
    count = sum(n for _, n in micro_batches)
    start = micro_batches[0][0] if micro_batches else consumed
    x, y = loader.get(start, count or pipe.plan.micro_batch_size)
    # every stage's scaler scales once (the last stage's loss is multiplied by it), so that each
    # can unscale its own gradients
    scale = float(scaler.scale(torch.ones((), device=y.device)))
    timer.start()
    with precision.autocast():
        loss = pipe.run(x, y, 1.0 if count else 0.0, tokens_per_step, scale=scale)
    pipe.sync_gradients(params)
    timer.stop(False)
    return loss


def optimizer_step(optimizer, scaler: torch.amp.GradScaler, params: list[torch.nn.Parameter],
                   grad_clip: float, stages: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Unscale, clip, step (skipped, and the scale halved, if fp16 gradients overflowed); the norm
    (over the whole model: with `stages`, a pipeline's group, summed over its stages)."""
    scaler.unscale_(optimizer)
    if stages is not None:
        grad_norm = clip_over_stages(params, grad_clip if grad_clip > 0 else float("inf"), stages)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm is reduced over the shards
        grad_norm = grad_norm.full_tensor()
    scaler.step(optimizer)
    scaler.update()
    return grad_norm
