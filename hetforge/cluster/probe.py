"""Measuring a rank: time per micro-step at a few micro-batch sizes (`time_steps`), and the link
(`time_all_gathers`); and the pure rules the run's plan applies to such figures (`cluster.run_plan`):
which micro-batches fit (`micro_batches_within`, `largest_fitting`) and what a size costs under an
activation plan (`planned_points`: its measured keep-all time times the planner's predicted
slowdown, so the share follows from the profile, not from the noise of timing a plan twice).

Without an activation plan a micro-batch b fits when the static bytes (weights, gradients and
optimizer state under the run's layout) plus b times the activation bytes of a sample (from the
model's shape, `memory.analytic`), with a 20% workspace margin, are within the rank's memory.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetforge.cluster.spec import Slowdown
from hetforge.memory.executor import apply_plan
from hetforge.model.gpt_neox import GPTNeoX

WORKSPACE_MARGIN = 1.2


PROXY_LAYERS = 2


def proxy_model(shape, device: torch.device) -> nn.Module:
    """A local model of the same width with at most PROXY_LAYERS blocks, to time and measure."""
    return GPTNeoX.build(replace(shape, n_layers=min(shape.n_layers, PROXY_LAYERS)), device, seed=0)


def candidate_sizes(cap: int) -> list[int]:
    sizes, b = [], 1
    while b < cap:
        sizes.append(b)
        b *= 2
    return sizes + [cap]


def largest_fitting(fits: Callable[[int], bool], max_micro: int, bisect: bool) -> int:
    """The largest micro-batch <= max_micro that fits (1 must fit). With `bisect` (each test is a
    planner solve) powers of two, then bisection; else every size is tried."""
    if not bisect:
        return max(b for b in range(1, max_micro + 1) if fits(b)) if max_micro > 1 else 1
    limit, hi = 1, 2
    while hi <= max_micro and fits(hi):
        limit, hi = hi, hi * 2
    hi = min(hi, max_micro + 1)
    while hi - limit > 1:
        mid = (limit + hi) // 2
        limit, hi = (mid, hi) if fits(mid) else (limit, mid)
    return limit


def micro_batches_within(memory_bytes: float | None, static: float, act_per_sample: float, cap: int) -> int:
    """The largest micro-batch (at most `cap`) whose activations, with the workspace margin, fit
    beside `static` bytes; 0 when not even one does. Unknown memory bounds nothing."""
    if memory_bytes is None:
        return cap
    if act_per_sample <= 0:
        return cap if static <= memory_bytes else 0
    return max(0, min(cap, int((memory_bytes - static) // (WORKSPACE_MARGIN * act_per_sample))))


def planned_points(keep_all_s: dict[int, float], slowdown: dict[int, float]) -> list[tuple[int, float]]:
    """(micro-batch, seconds) under each size's plan: the measured keep-all time times the plan's
    predicted time over keep-all's (1 where no plan is needed)."""
    return [(b, t * slowdown.get(b, 1.0)) for b, t in sorted(keep_all_s.items())]


def planned_step_costs(keep_all_s: dict[int, float], predicted_keep_all_s: dict[int, float],
                       predicted_step_s: dict[int, float]) -> list[tuple[int, float]]:
    """(micro-batch, seconds per optimizer step) a plan adds once a step (its optimizer on the host),
    in the measured time's scale: predicted seconds x measured / predicted keep-all micro-step."""
    return [(b, predicted_step_s[b] * keep_all_s[b] / predicted_keep_all_s[b])
            for b in sorted(keep_all_s) if predicted_step_s.get(b, 0.0) > 0 and predicted_keep_all_s.get(b, 0.0) > 0]


# A size is timed `steps` times at least, and while its timed steps add up to less than
# PROBE_MIN_S, up to PROBE_MAX_FACTOR x `steps`: on a CPU the median of two short steps can price a
# small micro-batch cheaper per sample than a large one, and the balance would then choose micro-
# batches whose hooks and loader cost more in the loop than in a bare model's steps.
PROBE_MIN_S = 0.3
PROBE_MAX_FACTOR = 5


def timed_enough(times: list[float], steps: int) -> bool:
    """Whether a size's timed steps (warm-up excluded) suffice: `steps` of them at least, then until
    they add up to PROBE_MIN_S or there are PROBE_MAX_FACTOR x `steps`."""
    return len(times) >= steps and (sum(times) >= PROBE_MIN_S or len(times) >= PROBE_MAX_FACTOR * steps)


def time_steps(model: nn.Module, sizes: list[int], seq_len: int, vocab: int, device: torch.device, autocast,
               slowdown: Slowdown, steps: int, plans: dict | None = None) -> dict[int, float]:
    """Median seconds of a forward+backward micro-step at each size, keep-all unless `plans` gives
    the size a plan to run under. The parameters are left unchanged.

    The sizes are timed in rounds, one step of each a round after a warm-up round, while a size has
    too few (`timed_enough`): a slow spell of the machine then lands on every size, not on whichever
    was being timed. Timed one size after another, a CPU probe's per-sample times jumped 5-45%
    from one size to the next and back, and the balance chose the sizes that happened to be timed
    in a quiet spell."""
    gen = torch.Generator(device="cpu").manual_seed(0)  # leaves the global RNG stream untouched
    was_training = model.training
    model.eval()  # same compute; no dropout draws
    inputs = {b: torch.randint(0, vocab, (b, seq_len + 1), generator=gen).to(device) for b in sizes}
    times: dict[int, list[float]] = {b: [] for b in sizes}
    warm = False
    while True:
        due = [b for b in sizes if not warm or not timed_enough(times[b], steps)]
        if not due:
            break
        for b in due:
            x = inputs[b]
            if plans and b in plans:
                apply_plan(model, plans[b], measure=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, c0 = time.perf_counter(), slowdown.clock()
            with autocast():
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            # the forward's time includes the loss's, as in the loop; a later throttle is not probed
            slowdown.after_forward(slowdown.clock() - c0, step=0)
            c1 = slowdown.clock()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            slowdown.after_backward(slowdown.clock() - c1)
            if warm:
                times[b].append(time.perf_counter() - t0)
            del logits, loss
            if plans and b in plans:
                apply_plan(model, None)
        warm = True
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return {b: statistics.median(times[b]) for b in sizes}


def time_all_gathers(device: torch.device, sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """Median seconds of an all-gather on the run's default group for each size (bytes each rank
    contributes), after one warm-up each. Every rank must call it with the same sizes: the
    collectives pace each other, so the ranks time the same events."""
    world = dist.get_world_size()
    out = {}
    for n in sizes:
        x = torch.ones(max(n // 4, 1), dtype=torch.float32, device=device)
        y = torch.empty(world * x.numel(), dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            dist.all_gather_single(y, x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    return out
