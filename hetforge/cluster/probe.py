"""Measuring a rank on the real model: time per micro-step at a few micro-batch sizes, and how many
samples fit in its memory. What the measurements mean for the balance is decided apart, by the pure
functions below (`largest_fitting`, `planned_points`), so that decisions can be tested on recorded
figures.

Memory per micro-batch b is estimated as the static part (`model.accounting.static_bytes`: fp32
weights, gradients and the optimizer's state) plus b times the activation bytes saved for backward
per sample, counted exactly with `saved_tensors_hooks` on a one-sample step, plus a 20% workspace
margin. With a memory plan, the planner decides what fits, and a planned micro-batch is priced at its
measured keep-all time times the planner's predicted slowdown (recomputation, transfers): the share
follows from the profile, not from the noise of timing a plan twice.
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

from hetforge.cluster.balance import BalanceError, TimeModel
from hetforge.cluster.spec import Slowdown
from hetforge.memory.executor import apply_plan
from hetforge.model.accounting import flops_per_token, static_bytes
from hetforge.model.gpt_neox import GPTNeoX

WORKSPACE_MARGIN = 1.2


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


PROXY_LAYERS = 2


def proxy_model(shape, device: torch.device) -> nn.Module:
    """A local model of the same width with at most PROXY_LAYERS blocks, to time and measure."""
    return GPTNeoX.build(replace(shape, n_layers=min(shape.n_layers, PROXY_LAYERS)), device, seed=0)


def scale_proxy(model: nn.Module, shape, act: int, seq_len: int, vocab: int, device: torch.device,
                autocast) -> tuple[float, float]:
    """(activation bytes per sample, time factor) of `shape` from its proxy `model`: the bytes a
    block adds are measured (the proxy less a one-block model), times scale with the FLOPs."""
    one = GPTNeoX.build(replace(shape, n_layers=1), device, seed=0)
    per_block = (act - saved_bytes_per_sample(one, seq_len, vocab, device, autocast)) / (model.cfg.n_layers - 1)
    del one
    full = act + per_block * (shape.n_layers - model.cfg.n_layers)
    return full, flops_per_token(shape, seq_len) / flops_per_token(model.cfg, seq_len)


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
# PROBE_MIN_S, up to PROBE_MAX_FACTOR x `steps`: on a CPU a median of two short steps put a single
# sample at 28 ms against 32 ms a sample in batches of 8, and the balance chose micro-batches of 1
# and 2, whose hooks and loader cost more in the loop than in a bare model's steps (a sharded run's
# proxy is now timed under FSDP2's hooks: `probe`'s `wrap`).
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
    optimizer: str = "adamw",
    static: float | None = None,
    full_shape=None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[TimeModel, dict]:
    """Time model and memory facts of this rank. The model's parameters are left unchanged.

    With `memory_plans` (micro-batch -> DevicePlan, or the PlanError saying why none fits), a
    micro-batch fits when the memory planner finds a plan for it: a device short of memory gets a
    smaller share and pays its planned recomputation in the balanced step time.

    `static`: the rank's bytes of weights, gradients and optimizer state under its data-parallel
    strategy (default: all of them, replicated). `full_shape`: `model` is a local proxy with fewer
    layers (a sharded model is never whole on one rank, and FSDP's collectives would time the
    slowest rank, not this one): activations are scaled per layer, times by FLOPs.

    `wrap`: makes the model the loop's kind of module before it is timed (its memory is measured
    bare, as `saved_bytes_per_sample` tells weights apart by storage). A sharded run's proxy is
    timed under FSDP2's hooks on a mesh of this rank alone, accumulating: a micro-step then costs
    what it does in the loop between collectives, hooks included (~3 ms a micro-batch of 1 or 2 for
    the tiny model on a CPU, a tenth of its compute), so that many small micro-batches are not
    priced as cheap as a few large ones."""
    shape = full_shape or model.cfg
    if static is None:
        static = sum(static_bytes(shape, optimizer).values())
    act = saved_bytes_per_sample(model, seq_len, vocab, device, autocast)
    time_factor = 1.0
    if full_shape is not None and full_shape.n_layers != model.cfg.n_layers:
        act, time_factor = scale_proxy(model, full_shape, act, seq_len, vocab, device, autocast)
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
    limit = largest_fitting(fits, max_micro, bisect=memory_plans is not None)
    facts = {"static_bytes": static, "activation_bytes_per_sample": act, "max_micro": limit}
    sizes = [b for b in candidate_sizes(max_micro) if b <= limit]
    if limit not in sizes:
        sizes.append(limit)
    slowdowns, run_planned = {}, {}
    if memory_plans is not None:
        slowdowns = {b: plan_at(b).prediction.time_s / plan_at(b).keep_all.time_s for b in sizes}
        facts["memory_plans"] = {b: plan_at(b).plan.options for b in sizes}
        facts["planned_slowdown"] = slowdowns
        if device.type == "cuda":
            # A GPU's memory is real: a size whose keep-all step would not fit is timed under its
            # plan (that measurement already includes the plan's cost). A CPU's budget is declared.
            run_planned = {b: plan_at(b).plan for b in sizes if not keep_all_fits(plan_at(b))}
    if declared_speed is not None:  # declared relative speed: no timing needed
        measured = {b: b / declared_speed for b in sizes}
    else:
        # a size run under its plan is timed bare: the plan's wrappers go on plain blocks
        timed = wrap(model) if wrap is not None and not run_planned else model
        measured = time_steps(timed, sizes, seq_len, vocab, device, autocast, slowdown, steps, run_planned)
        measured = {b: t * time_factor for b, t in measured.items()}
    facts["measured_s"] = measured
    points = planned_points(measured, {b: s for b, s in slowdowns.items() if b not in run_planned})
    step_costs = []
    if memory_plans is not None:
        step_costs = planned_step_costs(measured, {b: plan_at(b).keep_all.time_s for b in sizes},
                                        {b: plan_at(b).offload_s for b in sizes})
    return TimeModel(points, limit, step_costs), facts


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


def keep_all_fits(dp) -> bool:
    return dp.budget is None or dp.keep_all.peak_bytes <= dp.budget


def activation_need(shape, seq_len: int, vocab: int, device: torch.device, autocast, act_bytes: int,
                    floor: bool) -> float:
    """Activation bytes of one sample of `shape` on this rank (workspace margin included), measured
    on local proxies of one and two blocks: keep-all, or with `floor` an activation plan's least
    (every block's input kept, `act_bytes` per element, and one block's whole)."""
    one = GPTNeoX.build(replace(shape, n_layers=1), device, seed=0)
    a1 = saved_bytes_per_sample(one, seq_len, vocab, device, autocast)
    del one
    if shape.n_layers == 1:
        return WORKSPACE_MARGIN * a1
    two = GPTNeoX.build(replace(shape, n_layers=2), device, seed=0)
    a2 = saved_bytes_per_sample(two, seq_len, vocab, device, autocast)
    del two
    per_block = a2 - a1
    fixed = a1 - per_block
    if floor:
        return WORKSPACE_MARGIN * (fixed + per_block + (shape.n_layers - 1) * seq_len * shape.d_model * act_bytes)
    return WORKSPACE_MARGIN * (fixed + shape.n_layers * per_block)
