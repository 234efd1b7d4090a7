"""Measuring a rank on the real model: time per micro-step at a few micro-batch sizes, and how many
samples fit in its memory.

Memory per micro-batch b is estimated as the static part (fp32 weights, gradients and two optimizer
moments: 16 bytes per parameter) plus b times the activation bytes saved for backward per sample,
counted exactly with `saved_tensors_hooks` on a one-sample step, plus a 20% workspace margin. On a
GPU the peak allocated memory of the timed steps is measured and used where it is larger.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from hetforge.cluster.balance import BalanceError, TimeModel
from hetforge.cluster.spec import Slowdown

WORKSPACE_MARGIN = 1.2
STATIC_BYTES_PER_PARAM = 16  # fp32 weight + gradient + Adam/LAMB exp_avg and exp_avg_sq


def saved_bytes_per_sample(model: nn.Module, seq_len: int, vocab: int, device: torch.device, autocast) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            pass
        return t

    x = torch.zeros(1, seq_len + 1, dtype=torch.long, device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast():
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)  # weights are counted as static


def candidate_sizes(cap: int) -> list[int]:
    sizes, b = [], 1
    while b < cap:
        sizes.append(b)
        b *= 2
    return sizes + [cap]


def probe(
    model: nn.Module,
    seq_len: int,
    vocab: int,
    device: torch.device,
    autocast,
    max_micro: int,
    memory_bytes: float | None,
    slowdown: Slowdown,
    steps: int = 2,
    declared_speed: float | None = None,
    device_label: str = "device",
    memory_plans=None,
) -> tuple[TimeModel, dict]:
    """Time model and memory facts of this rank. The model's parameters are left unchanged.

    With `memory_plans` (micro-batch -> DevicePlan, or the PlanError saying why none fits), a
    micro-batch fits when the memory planner finds a plan for it, and it is timed with that plan
    applied: a device short of memory gets a smaller share and pays its recomputation in the
    balanced step time."""
    n_params = sum(p.numel() for p in model.parameters())
    static = STATIC_BYTES_PER_PARAM * n_params
    act = saved_bytes_per_sample(model, seq_len, vocab, device, autocast)
    plans: dict = {}

    def plan_at(b: int):
        if b not in plans:
            plans[b] = memory_plans(b)
        return plans[b]

    def fits(b: int) -> bool:
        if memory_plans is not None:
            return not isinstance(plan_at(b), Exception)
        return memory_bytes is None or static + WORKSPACE_MARGIN * act * b <= memory_bytes

    if memory_plans is not None and not fits(1):
        raise BalanceError(f"{device_label}: {plan_at(1)}")
    if not fits(1):
        need = (static + WORKSPACE_MARGIN * act) / 2**30
        raise BalanceError(
            f"{device_label} has {memory_bytes / 2**30:.2f} GiB but the model needs about {need:.2f} GiB "
            f"at micro-batch 1 ({static / 2**30:.2f} GiB weights+gradients+optimizer state, "
            f"{act * WORKSPACE_MARGIN / 2**30:.2f} GiB activations); use a smaller model or more memory"
        )
    if memory_plans is not None:  # planning is a solve per size: search the powers of two, then bisect
        limit, hi = 1, 2
        while hi <= max_micro and fits(hi):
            limit, hi = hi, hi * 2
        hi = min(hi, max_micro + 1)
        while hi - limit > 1:
            mid = (limit + hi) // 2
            limit, hi = (mid, hi) if fits(mid) else (limit, mid)
    else:
        limit = max(b for b in range(1, max_micro + 1) if fits(b)) if max_micro > 1 else 1
    facts = {"static_bytes": static, "activation_bytes_per_sample": act, "max_micro": limit}
    sizes = [b for b in candidate_sizes(max_micro) if b <= limit]
    if limit not in sizes:
        sizes.append(limit)
    if declared_speed is not None:  # declared relative speed: no timing needed
        return TimeModel([(b, b / declared_speed) for b in sizes], limit), facts

    gen = torch.Generator(device="cpu").manual_seed(0)  # leaves the global RNG stream untouched
    was_training = model.training
    model.eval()  # same compute; no dropout draws
    points = []
    peak = 0
    for b in sizes:
        x = torch.randint(0, vocab, (b, seq_len + 1), generator=gen).to(device)
        times = []
        if memory_plans is not None:
            from hetforge.memory.executor import apply_plan

            apply_plan(model, plan_at(b).plan, measure=False)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(steps + 1):  # first is warm-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with autocast():
                logits = model(x[:, :-1])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            slowdown.after_forward(time.perf_counter() - t0, step=0)  # a later throttle is not probed
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        if memory_plans is not None:
            apply_plan(model, None)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        points.append((b, statistics.median(times)))
    model.train(was_training)
    facts["measured_peak_bytes"] = peak or None
    if memory_plans is not None:
        facts["memory_plans"] = {b: plan_at(b).plan.options for b in sizes}
    return TimeModel(points, limit), facts
