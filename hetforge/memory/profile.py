"""Measuring what the planner prices: per block its forward/backward time, its own peak memory, and
its units (`hetforge.memory.units`): the bytes of each saved unit on the device and as copied to the
host, and the bytes and forward time of each op unit; the head (final norm, logits, loss) likewise;
and the host link.

Blocks of a GPT-NeoX are identical, so one block's memory is measured (through the real executor)
and repeated n times: profiling forge-l needs one block's memory, not 22B parameters. Its times are
taken over copies of it run in a row, as the model runs them, as many as the model has and a quarter
of the free memory holds (`timing_depth`): a block timed alone runs from a warm cache. Saved bytes
come from the executor's ledger (saved-tensor hooks, per storage) and op outputs from a dispatch
mode, so both are exact; peaks come from `PeakMeter` (the CUDA allocator's statistics, or the
profiler's allocation events on the CPU). An op unit's time is the branch's measured forward time
shared out over its ops in proportion to their clocked times; a recomputed branch's fixed costs
(the checkpoint, selective checkpointing's per-op dispatch) are measured by running it, and so is
a block recomputing both branches (not the sum of the two). A compiled run's profile times
compiled branches and measures each kept branch at the compile budgets (`memory.compiled`).
Profiles are cached per (model, micro-batch, seq, precision, machine, link, optimizer, the timing
chain where it is set, and compilation).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.memory.compiled import COMPILED_BUDGETS, compile_branches
from hetforge.memory.executor import ActivationLedger, PlanRunner, input_users, parameter_storages
from hetforge.memory.measure import PeakMeter
from hetforge.memory.plan import (BRANCHES, BlockProfile, BranchPlan, Decision, ModelProfile, Plan, Unit,
                                  budget_key, resolve_option)
from hetforge.memory.units import Labeller, is_view_op, rebuilds, storage_key, tensor_bytes
from hetforge.model.gpt_neox import Block, GPTNeoXConfig, RotaryEmbedding, set_head_padding
from hetforge.model.accounting import static_bytes
from hetforge.core.precision import DTYPES, Precision

PROFILE_VERSION = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _more(done: int, at_least: int, start: float, min_seconds: float) -> bool:
    """Whether a measurement loop that began at `start` runs once more: a warm-up and `at_least`
    timed runs, then on until `min_seconds` have passed (at most 8x `at_least`)."""
    return done <= at_least or (time.perf_counter() - start < min_seconds and done <= 8 * at_least)


def _timed(fn, device, repeats: int, min_seconds: float = 0.0) -> float:
    """Median time of `fn` over at least `repeats` calls (after a warm-up) and `min_seconds`."""
    times = []
    start, i = time.perf_counter(), 0
    while _more(i, repeats, start, min_seconds):
        i += 1
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i > 1:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_link(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """Host<->device bandwidth (bytes/s, the slower direction) with pinned memory; on the CPU the
    rate of the executor's own copy out of PyTorch's allocator and back."""
    if device.type != "cuda":
        from hetforge.memory.executor import _HostCopy

        t = torch.ones(nbytes // 16 // 4, dtype=torch.float32)  # 16 MiB: past the caches
        copies = [_HostCopy(t, None)]  # the process's first large copies fault their pages in: not timed
        copies.pop().fetch(None)
        out = _timed(lambda: copies.append(_HostCopy(t, None)), device, 7)
        back = _timed(lambda: copies.pop().fetch(None), device, 6)
        return t.numel() * 4 / max(out, back)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device, 3)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device, 3)
    return nbytes / max(d2h, h2d)


_HOST_STEP: list[float] = []


def host_optimizer_seconds_per_param() -> float:
    """This host's AdamW step time per parameter (once per process): the cost of optimizer offload."""
    if not _HOST_STEP:
        p = torch.zeros(2**21, requires_grad=True)
        p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)  # the kernel the host optimizer runs (train.optim)
        _HOST_STEP.append(_timed(opt.step, torch.device("cpu"), 3) / p.numel())
    return _HOST_STEP[0]


def measuring_machine(device: torch.device) -> str:
    """What changes a measurement besides the work itself: the GPU model; on the CPU its vector ISA,
    whether 16-bit matmuls go to oneDNN (whose scratch buffers the CPU meter sees) and the threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"cpu-{torch.backends.cpu.get_cpu_capability()}-onednn_bf16={bf16}-threads={torch.get_num_threads()}"


def _cache_key(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
               link: float | None, optimizer: str, fp32_matmul: bool = False, chain: int | None = None,
               compiled: bool = False) -> str:
    fields = [PROFILE_VERSION, cfg.to_dict(), micro_batch, seq, precision, measuring_machine(device), link, optimizer,
              torch.__version__]
    if fp32_matmul:  # only then, so that measured profiles keep their keys
        fields.append("fp32-matmul")
    if chain is not None:
        fields.append(f"chain-{chain}")
    if compiled:
        fields.append(f"compiled-{list(COMPILED_BUDGETS)}")
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _autocast(precision: str, device: torch.device):
    return Precision(precision, device).autocast()


class _OpClock(TorchDispatchMode):
    """Times every op of a forward and names its op unit; records the bytes of what each op that
    selective checkpointing could cache produces."""

    def __init__(self, labeller: Labeller, params: set[int], device: torch.device):
        super().__init__()
        self.labeller, self.params, self.device = labeller, params, device
        self.time: dict[str, float] = {}  # unit (or "" for the rest) -> seconds
        self.bytes: dict[str, int] = {}  # unit -> bytes its ops produce

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        unit = self.labeller.op_unit(func)
        _sync(self.device)
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        _sync(self.device)
        self.time[unit or ""] = self.time.get(unit or "", 0.0) + time.perf_counter() - t0
        made = made_bytes(args, kwargs or {}, out, self.params) if unit is not None and not is_view_op(func) else None
        if made is not None:
            self.bytes[unit] = self.bytes.get(unit, 0) + made
        return out


def made_bytes(args, kwargs, out, params: set[int]) -> int | None:
    """The bytes of what an op (not a view) produced, which selective checkpointing could cache;
    None for an op on weights alone (a cast of a weight is made again whatever the plan). Counted
    per op, not per storage: an intermediate's storage is reused by the next one."""
    ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if ins and all(storage_key(a) in params for a in ins):
        return None
    made = {storage_key(o): o.untyped_storage().nbytes() for o in tree_leaves(out) if isinstance(o, torch.Tensor)}
    return sum(made.values())


class Fp32Matmul(TorchDispatchMode):
    """16-bit matmuls computed in fp32, tile by tile, and cast back to their dtype.

    A CPU without 16-bit matmul kernels (AVX2 only) runs a bf16 matmul ~300x slower than an fp32
    one (0.19 against 63 GFLOP/s here), which makes the analytic model's 16-bit proxy of a large
    block take hours. The proxy needs the dtypes and bytes that autocast saves, not 16-bit
    arithmetic: autograd sees the same bf16 inputs and outputs. The fp32 tiles live in buffers made
    when the mode is entered, before any measurement starts, so the op allocates only its 16-bit
    output, as the native one does, and the peaks the profile measures are unchanged. CPU tensors
    only: a GPU has fast 16-bit matmuls."""

    TILE = 256

    def __enter__(self):
        n = self.TILE * self.TILE
        self._a, self._b, self._bias, self._acc = (torch.empty(n) for _ in range(4))
        return super().__enter__()

    @staticmethod
    def _tile(buf: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        view = buf[:src.numel()].view(src.shape)
        return view.copy_(src)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.mm.default:
            bias, (a, b), beta, alpha = None, args, 1, 1
        elif func is aten.addmm.default:
            bias, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        else:
            return func(*args, **kwargs)
        if a.dtype not in (torch.bfloat16, torch.float16) or a.dtype != b.dtype or a.device.type != "cpu":
            return func(*args, **kwargs)
        (m, k), n, t = a.shape, b.shape[1], self.TILE
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
        full_bias = bias.expand(m, n) if bias is not None else None
        for i in range(0, m, t):
            for j in range(0, n, t):
                rows, cols = min(t, m - i), min(t, n - j)
                acc = self._acc[:rows * cols].view(rows, cols).zero_()
                for p in range(0, k, t):
                    acc.addmm_(self._tile(self._a, a[i:i + t, p:p + t]), self._tile(self._b, b[p:p + t, j:j + t]))
                if alpha != 1:
                    acc.mul_(alpha)
                if full_bias is not None:
                    acc.add_(self._tile(self._bias, full_bias[i:i + t, j:j + t]), alpha=beta)
                out[i:i + t, j:j + t].copy_(acc)
        return out


def _saved_units(tensors: list[dict], users: dict[str, tuple[str, ...]], rebuilt: list[dict]) -> list[Unit]:
    """Saved and input units from one recorded keep-all forward: device bytes per storage, host
    bytes per distinct view (what offloading copies); and for a rebuildable unit the bytes that
    rebuilding frees, from a recorded forward that rebuilds every unit it can (the executor's own
    judgement: a weight's autocast cast in the unit, or a source the kernel did not save, stays)."""
    dev: dict[str, dict] = {}
    host: dict[str, dict] = {}
    made: dict[str, dict] = {}
    for r in tensors:
        dev.setdefault(r["unit"], {})[r["key"]] = r["bytes"]
        host.setdefault(r["unit"], {})[tuple(r["view"])] = r["view_bytes"]
    for r in rebuilt:
        if r.get("rebuilt"):
            made.setdefault(r["unit"], {})[r["key"]] = r["bytes"]
    out = []
    for name in dev:
        kind = "input" if name in users else "saved"
        out.append(Unit(name, kind, float(sum(dev[name].values())), float(sum(host[name].values())),
                        users=users.get(name, ()), rebuild_bytes=float(sum(made.get(name, {}).values()))))
    return out


def one_branch(branch: str, plan: BranchPlan, other: BranchPlan = BranchPlan("keep")) -> str:
    """A block option (encoded) that does `plan` in `branch` and `other` in the other branch: how
    the profile isolates one branch's price or bytes."""
    return (Decision(plan, other) if branch == "attn" else Decision(other, plan)).encode()


def _on(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`module` on `device`; built there already on the CPU (fake tensors cannot be moved in place)."""
    return module if device.type == "cpu" else module.to(device)


class BlockBench:
    """One block of `cfg` with its input and incoming gradient, run under named options: what
    `profile_block` measures, and what `memory.analytic` traces on fake tensors (no memory, no
    compute) for a card that is not here. `meter` makes the peak meter (`PeakMeter`, or the fake
    trace's own); `head_dim`: the head size attention runs at (`model.pad_head_dim`)."""

    def __init__(self, cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
                 meter: Callable[[torch.device], PeakMeter] = PeakMeter, head_dim: int | None = None):
        torch.manual_seed(0)
        self.cfg, self.device, self.precision, self.meter = cfg, device, precision, meter
        self.block = _on(Block(cfg), device)
        if head_dim is not None and head_dim != cfg.head_dim:
            set_head_padding(self.block, head_dim)
        rot = _on(RotaryEmbedding(cfg.rotary_dims, cfg.rotary_base), device)
        self.cos, self.sin = rot.cos_sin(seq, device)
        self.params = parameter_storages(self.block)
        self.x0 = torch.randn(micro_batch, seq, cfg.d_model, device=device, dtype=DTYPES[precision])
        self.grad = torch.randn_like(self.x0)
        self.input_bytes = tensor_bytes(self.x0)
        self.users = input_users(cfg.parallel_residual)

    def autocast(self):
        return _autocast(self.precision, self.device)

    def run(self, option: str, record: bool = False) -> tuple[float, float, list[dict]]:
        """The block's own peaks in forward and backward under `option`, and what it saved."""
        cfg, block, a = self.cfg, self.block, self.input_bytes
        runner = PlanRunner(Plan([option]), self.params, cfg.parallel_residual, random=cfg.dropout > 0)
        runner.ledger.record = record
        handles = runner.install_labels([block])
        x = self.x0.detach().requires_grad_(True)
        with self.meter(self.device) as fwd_meter, self.autocast():
            out = runner([block], x, self.cos, self.sin)
        with self.meter(self.device) as bwd_meter:
            out.backward(self.grad)
        for hd in handles:
            hd.remove()
        block.zero_grad(set_to_none=False)
        # forward: the input and all the block makes; backward: the incoming gradient and the input,
        # what the forward left held (not its output: the next block has consumed it), and the rest
        fwd = a + fwd_meter.peak
        bwd = 2 * a + fwd_meter.net - tensor_bytes(out) + bwd_meter.peak
        return float(fwd), float(bwd), runner.ledger.tensors

    def record(self, compiled: bool = False) -> tuple[list[Unit], dict[str, list[float]], list[dict], dict]:
        """The block's saved and input units, its own peaks per pair of branch modes, the saved
        tensors, and (`compiled`) the bytes each kept branch saves at each compile budget."""
        self.run("keep")  # gradients allocated, so no later measure counts them
        # Per (attention, MLP) mode: offloaded tensors are back on the device in the block's backward,
        # so only recomputation changes the block's own peaks.
        peaks = {}
        for o in ("keep", "recompute-attn", "recompute-mlp", "recompute"):
            fwd, bwd, saved = self.run(o, record=o == "keep")
            d = resolve_option(o, self.users)
            peaks[f"{d.attn.mode}/{d.mlp.mode}"] = [fwd, bwd]
            if o == "keep":
                kept = saved
                tensors = [{k: r[k] for k in ("unit", "shape", "dtype", "bytes")} for r in saved]
        table = rebuilds(self.cfg.parallel_residual)
        every = {br: frozenset(n for n in table if n.startswith(br + ".")) for br in BRANCHES}
        _, _, rebuilt = self.run(Decision(BranchPlan("keep", frozenset(), every["attn"]),
                                          BranchPlan("keep", frozenset(), every["mlp"])).encode(), record=True)
        units = _saved_units(kept, self.users, rebuilt)
        budget_held = {}
        if compiled:
            for br in BRANCHES:
                for b in COMPILED_BUDGETS:
                    # the other branch recomputed: it saves nothing but the block's input, an input unit
                    option = one_branch(br, BranchPlan("keep", budget=b), BranchPlan("recompute"))
                    _, _, saved_at = self.run(option, record=True)
                    held = {r["key"]: r["bytes"] for r in saved_at if r["unit"] not in self.users}
                    budget_held[(br, b)] = float(sum(held.values()))
        return units, peaks, tensors, budget_held

    def branch_forward(self, name: str) -> Callable[[], None]:
        def go():
            x = self.x0.detach().requires_grad_(True)
            with self.autocast():
                self.block.attn_branch(x, self.cos, self.sin) if name == "attn" else self.block.mlp_branch(x)
        return go


def profile_block(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
                  repeats: int = 3, min_seconds: float = 0.0, chain: int = 1, compiled: bool = False) -> BlockProfile:
    """One block measured (see the module's docstring). `compiled`: a compiled run's profile. Its
    times are taken on compiled branches, as such a run keeps or recomputes them (a branch whose plan
    caches, offloads or rebuilds units runs eager there too, `executor.per_op_decisions`, and is
    timed so); its saved units are still recorded eager, where they have names; and every kept
    branch is also measured compiled at each budget of `compiled.COMPILED_BUDGETS`: the bytes its
    graph saves and the time it adds over the branch compiled plainly."""
    bench = BlockBench(cfg, micro_batch, seq, precision, device)
    block, params, x0, grad, cos, sin = bench.block, bench.params, bench.x0, bench.grad, bench.cos, bench.sin
    ac, a = bench.autocast, bench.input_bytes
    units, peaks, tensors, budget_held = bench.record(compiled)
    table = rebuilds(cfg.parallel_residual)

    # Op units: what each op group produces, and its share of its branch's forward time.
    labeller = Labeller()
    handles = labeller.install(block)
    clocks = []
    for _ in range(repeats):
        clock = _OpClock(labeller, params, device)
        for br in BRANCHES:
            labeller.set("")
            with clock:
                bench.branch_forward(br)()
        clocks.append(clock)
    for hd in handles:
        hd.remove()

    remade = {n: rb for n, rb in table.items() if any(u.name == n and u.rebuild_bytes > 0 for u in units)}
    variants = _variants(set(clocks[0].bytes), remade, budget_held, device, compiled)
    # per copy in the timing chain: its weights and gradients, and what its forward saves
    saved = sum(u.bytes for u in units if u.kind in ("saved", "input"))
    copy_bytes = 2 * sum(tensor_bytes(p) for p in block.parameters()) + saved
    depth = timing_depth(chain, copy_bytes, free_memory_bytes(device))
    extra, fwd_s, bwd_s = _step_times(block, variants, params, cfg, x0, grad, cos, sin, ac, device,
                                      max(2 * repeats, 7), min_seconds, depth, compiled)
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for (br, b), held in budget_held.items():
        figures.setdefault(br, {})[budget_key(b)] = {"held": held,
                                                     "time_s": max(0.0, extra[f"{br}/compiled@{budget_key(b)}"])}
    recompute = _prices(extra, clocks, units, remade)
    return BlockProfile(fwd_s, bwd_s, float(a), units, peaks, tensors, recompute, depth, figures)


def _variants(op_units: set[str], remade: dict, budget_held: dict, device: torch.device,
              compiled: bool) -> dict[str, str]:
    """The block options the profile times beside keep-all, by what each prices.

    Recomputation as it runs, overheads included: per branch the step's extra time over keep-all
    when a plain checkpoint recomputes it, when selective checkpointing caches nothing, and when it
    caches every op unit (its dispatch overhead alone); the unit shares split the difference. Both
    branches recomputed at once, which is not the sum of the two. The saved-tensor hooks alone; on
    the CPU the host copies as the model runs them; in a compiled run each kept branch eager and at
    each compile budget; and per branch, rebuilding every unit it can (under the hooks it needs)."""
    variants = {"keep": "keep"}
    for br in BRANCHES:
        names = frozenset(n for n in op_units if n.startswith(br + "."))
        for kind, cached in (("plain", frozenset()), ("sac_all", names), ("sac", frozenset({f"{br}.-"}))):
            # "-" names no op: selective checkpointing caching nothing
            variants[f"{br}/{kind}"] = one_branch(br, BranchPlan("recompute", cached))
    variants["both/plain"] = Decision(BranchPlan("recompute"), BranchPlan("recompute")).encode()
    # the saved-tensor hooks alone: the block runs under them, nothing moves ("-" names no input)
    variants["hooks"] = Decision(BranchPlan("keep"), BranchPlan("keep"), frozenset({"-"})).encode()
    if device.type != "cuda":  # the host copies as the model runs them (`BlockProfile.copy_rate`)
        variants["offload"] = "offload"
    if compiled:
        for br in BRANCHES:  # kept, run eager as per-unit choices make it ("-" names no unit)
            variants[f"{br}/eager"] = one_branch(br, BranchPlan("keep", frozenset({f"{br}.-"})))
    for br, b in budget_held:
        variants[f"{br}/compiled@{budget_key(b)}"] = one_branch(br, BranchPlan("keep", budget=b))
    for br in BRANCHES:
        names = frozenset(n for n in remade if n.startswith(br + "."))
        if names:
            variants[f"{br}/rebuild"] = one_branch(br, BranchPlan("keep", frozenset(), names))
    return variants


def _prices(extra: dict[str, float], clocks: list, units: list[Unit], remade: dict) -> dict[str, dict[str, float]]:
    """The recomputation figures from the timed variants' extra times (`BlockProfile.recompute`);
    appends each op unit to `units`, its time a share of its branch's price by its clocked ops, and
    prices each rebuildable unit by its producer's share of its branch's rebuilding."""
    hooks = max(0.0, extra["hooks"])
    recompute: dict[str, dict[str, float]] = {"block": {"hooks": hooks}}
    for br in BRANCHES:
        names = [n for n in clocks[0].bytes if n.startswith(br + ".")]
        plain, sac_all, sac = (max(0.0, extra[f"{br}/{k}"]) for k in ("plain", "sac_all", "sac"))
        sac = max(sac, sac_all)
        recompute[br] = {"plain": plain, "sac": sac, "sac_all": sac_all}
        if f"{br}/eager" in extra:
            recompute[br]["eager"] = max(0.0, extra[f"{br}/eager"] - hooks)  # the branch run eager alone
        weights = {n: statistics.median(c.time.get(n, 0.0) for c in clocks) for n in names}
        total = sum(weights.values()) or 1.0
        for n in names:
            units.append(Unit(n, "op", float(clocks[0].bytes[n]), time_s=(sac - sac_all) * weights[n] / total))
    recompute["both"] = {"plain": max(0.0, extra["both/plain"])}
    if "offload" in extra:  # the copies alone: beside the hooks, and the branches run eager in a compiled run
        recompute["block"]["copy"] = extra["offload"] - hooks - sum(recompute[br].get("eager", 0.0) for br in BRANCHES)
    for br in BRANCHES:
        if f"{br}/rebuild" not in extra:
            continue
        price = max(0.0, extra[f"{br}/rebuild"] - hooks - recompute[br].get("eager", 0.0))  # rebuilding alone
        recompute[br]["rebuild"] = price
        names = [n for n in remade if n.startswith(br + ".")]
        weights = {n: statistics.median(c.time.get(remade[n].op_unit, 0.0) for c in clocks) for n in names}
        total = sum(weights.values())
        for k, u in enumerate(units):
            if u.name in weights:
                share = weights[u.name] / total if total > 0 else 1.0 / len(names)
                units[k] = replace(u, time_s=price * share, rebuild_from=remade[u.name].source)
    return recompute


def free_memory_bytes(device: torch.device) -> int:
    """Memory the profile may still take: free on the card plus what PyTorch holds cached unused;
    on the host what the kernel calls available, within the process's cgroup limit if it has one."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                   - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:  # cgroup v2: a container's limit, less what it already uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(int(free), 0)


def timing_depth(n_layers: int, copy_bytes: float, free_bytes: float) -> int:
    """How many copies of the block the profile times in a row: the model's depth, as far as a
    quarter of the free memory holds their weights, gradients and saved activations (`copy_bytes`
    each). A block timed alone finds its weights and what its forward saved still in the cache
    when its backward reads them; inside the model the other blocks have passed through the cache
    in between, so keeping costs more there and recomputing (which makes its activations afresh)
    relatively less: copies in a row come closest to the block's times in the model, and the
    price of recomputing it (`bench/memory_plans.py` checks the profile against the model).
    Profiling time grows with the depth (a GPU block takes milliseconds; profiles are cached)."""
    if n_layers <= 1 or copy_bytes <= 0:
        return max(n_layers, 1)
    return int(max(1, min(n_layers, free_bytes // 4 // copy_bytes)))


def _step_times(block, variants: dict[str, str], params, cfg, x0, grad, cos, sin, ac, device,
                rounds: int, min_seconds: float = 0.0, depth: int = 1,
                compiled: bool = False) -> tuple[dict[str, float], float, float]:
    """Per option (but "keep"), the median over rounds of its forward + backward time less that of
    the keep runs beside it (`sandwiched`); and the plain block's forward and backward (what keep-all
    runs); all per block, timed over `depth` blocks in a row (`timing_depth`). Differences of
    neighbouring runs, because a shared machine's drift moves every option alike and the prices of
    recomputation are a few percent of a block: a median of whole times, each off by the drift,
    would bury them. Rounds go on until `min_seconds` have passed: a CPU measured for a few
    milliseconds is measured in a burst (turbo, an idle neighbour) that the minutes of a training
    run do not keep. `compiled`: the blocks' branches run compiled, as `compile_branches` makes
    them; each option runs once before the clock starts, so that compiling is not timed."""
    # copies of the block, each with its own weights and gradients, as in the model (one module run
    # `depth` times would keep its weights in the cache)
    layers = [block] + [copy.deepcopy(block) for _ in range(depth - 1)]
    params = params | {s for layer in layers[1:] for s in parameter_storages(layer)}
    if compiled:
        compile_branches(layers)
    runners = {}
    for k, option in variants.items():
        runners[k] = PlanRunner(Plan([option] * depth), params, cfg.parallel_residual, random=cfg.dropout > 0)
        runners[k].measure = False

    def run_plain() -> tuple[float, float]:
        x = x0.detach().requires_grad_(True)
        _sync(device)
        t0 = time.perf_counter()
        with ac():
            out = x
            for layer in layers:
                out = layer(out, cos, sin)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        return (t1 - t0) / depth, (time.perf_counter() - t1) / depth

    def run_option(k: str) -> float:
        runner = runners[k]
        handles = runner.install_labels(layers)
        x = x0.detach().requires_grad_(True)
        _sync(device)
        t0 = time.perf_counter()
        with ac():
            out = runner(layers, x, cos, sin)
        out.backward(grad)
        _sync(device)
        took = (time.perf_counter() - t0) / depth
        for hd in handles:
            hd.remove()
        return took

    plain: list[tuple[float, float]] = []

    def round_done(r: int) -> None:
        fb = run_plain()  # the bare block's forward and backward, what keep-all runs
        if r:
            plain.append(fb)

    if compiled:
        run_plain()
        for k in variants:
            run_option(k)
    start = time.perf_counter()
    extras = sandwiched(run_option, [k for k in variants if k != "keep"], "keep",
                        lambda r: _more(r, rounds, start, min_seconds), round_done)
    block.zero_grad(set_to_none=False)
    if compiled:  # the block itself runs eager again (its branches were instance attributes)
        for name in ("attn_branch", "mlp_branch"):
            block.__dict__.pop(name, None)
    del layers[1:], runners
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copies' memory goes back to the card
    extra = {k: statistics.median(v) for k, v in extras.items()}
    return extra, statistics.median(f for f, _ in plain), statistics.median(b for _, b in plain)


def sandwiched(run: Callable[[str], float], options: list[str], base: str, more: Callable[[int], bool],
               after_round: Callable[[int], None] = lambda r: None) -> dict[str, list[float]]:
    """Per option, one time per round (the first round warms up and is dropped) less the mean of
    `base` timed just before it and just after it; every timed run follows an untimed run of the
    same option.

    Neighbours, because a drift linear over those runs cancels out of the difference: on a shared
    CPU the step time wanders by tens of percent over tens of seconds, and neighbouring steps
    correlate far better than distant ones, so an option priced against one run of `base` per
    round, up to ten runs away, carried that wander into prices of a few percent of a step.
    Warmed up, because a step that follows a different option is not the step a run repeats: on
    the CPU, a recomputing step right after a keep step finds the heap that keep's larger
    activations left, and costs about half what it does after a step of its own. The options'
    order is shuffled per round (seeded), so none always follows the same one. Rounds go on while
    `more(round)`; `run(option)` times one run."""
    order = list(options)
    extras: dict[str, list[float]] = {k: [] for k in order}

    def warm(k: str) -> float:
        run(k)
        return run(k)

    r = 0
    while more(r):
        random.Random(r).shuffle(order)
        before = warm(base)
        for k in order:
            took = warm(k)
            after = warm(base)
            if r:
                extras[k].append(took - (before + after) / 2)
            before = after
        after_round(r)
        r += 1
    return extras


class HeadBench:
    """The embedding, final norm, logits and loss of `cfg` for one micro-batch: what the head stage
    holds for its backward and its own peak (as `BlockBench`, also traced on fake tensors)."""

    def __init__(self, cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
                 meter: Callable[[torch.device], PeakMeter] = PeakMeter):
        torch.manual_seed(0)
        self.precision, self.device, self.meter = precision, device, meter
        self.norm = _on(torch.nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), device)
        self.out = _on(torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False), device)
        self.emb = _on(torch.nn.Embedding(cfg.vocab_size, cfg.d_model), device)
        self.params = parameter_storages(self.norm) | parameter_storages(self.out) | parameter_storages(self.emb)
        self.idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), device=device)
        self.x0 = torch.randn(micro_batch, seq, cfg.d_model, device=device, dtype=DTYPES[precision])

    def step(self, ledger: ActivationLedger | None = None):
        def pack(t):
            ledger.hold_device(t)
            return t

        x = self.x0.detach().requires_grad_(True)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if ledger else contextlib.nullcontext()
        with hooks:
            with _autocast(self.precision, self.device):
                e = self.emb(self.idx[:, :-1])
                logits = self.out(self.norm(x + e.to(x.dtype)))
            loss = F.cross_entropy(logits.float().flatten(0, 1), self.idx[:, 1:].flatten())
        return x, logits, loss

    def held_and_peak(self) -> tuple[float, float]:
        ledger = ActivationLedger(params=self.params)
        with self.meter(self.device) as meter:
            x, logits, loss = self.step(ledger)
            held = float(ledger.device_bytes)
            del logits
            loss.backward()
        return held, float(meter.peak + tensor_bytes(self.x0))  # the last block's output is live throughout


def profile_head(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
                 repeats: int = 3, min_seconds: float = 0.0) -> tuple[float, float, float, float]:
    bench = HeadBench(cfg, micro_batch, seq, precision, device)
    held, peak = bench.held_and_peak()

    def fwd():
        return bench.step()[2]

    fwd_s = _timed(fwd, device, repeats, min_seconds / 2)
    total = _timed(lambda: fwd().backward(), device, repeats, min_seconds / 2)
    return fwd_s, max(total - fwd_s, 0.0), held, peak


def profile_model(
    cfg: GPTNeoXConfig,
    micro_batch: int,
    seq: int,
    precision: str = "fp32",
    device: torch.device | str = "cpu",
    link_bytes_per_s: float | None = None,
    optimizer: str = "adamw",
    cache_dir: str | Path | None = None,
    repeats: int = 3,
    fp32_matmul: bool = False,
    min_seconds: float | None = None,
    chain: int | None = None,
    compiled: bool = False,
    note: Callable[[str], None] | None = None,
) -> ModelProfile:
    """The profile the planner needs; cached as JSON under `cache_dir` when given. `fp32_matmul`
    runs 16-bit matmuls in fp32 (`Fp32Matmul`): bytes as measured, times not those of the device.
    The block's times are measured over at least `min_seconds` (default 0.4 s per repeat) with up
    to `chain` copies of it in a row (default the model's depth; `timing_depth`; a profile whose
    times are not used takes 1), the head's over a quarter of that. `compiled`: for a run that
    compiles its blocks (`profile_block`). `note` is told when a profile is measured, not read from
    the cache (it may take minutes on a CPU)."""
    if min_seconds is None:
        min_seconds = 0.4 * repeats
    device = torch.device(device)
    path = None
    if cache_dir is not None:
        key = _cache_key(cfg, micro_batch, seq, precision, device, link_bytes_per_s, optimizer, fp32_matmul, chain,
                         compiled)
        path = Path(cache_dir) / f"profile-{key}.json"
        if path.exists():
            return ModelProfile.from_dict(json.loads(path.read_text()))
    if note is not None:
        note(f"profiling one block of d={cfg.d_model} at micro-batch {micro_batch} x {seq} tokens, {precision} on "
             f"{device}{' (compiled)' if compiled else ''}: once, then cached" + (f" in {cache_dir}" if cache_dir else ""))
    link_source = "configured" if link_bytes_per_s is not None else "on one copy"
    if link_bytes_per_s is None and device.type == "cuda":
        link_bytes_per_s = measure_link(device)
    # the profile seeds its own random block: the run's random stream must not notice
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            (Fp32Matmul() if fp32_matmul else contextlib.nullcontext()):
        block = profile_block(cfg, micro_batch, seq, precision, device, repeats, min_seconds,
                              cfg.n_layers if chain is None else chain, compiled)
        hf, hb, hheld, hpeak = profile_head(cfg, micro_batch, seq, precision, device, repeats, min_seconds / 4)
    if link_bytes_per_s is None:  # the CPU: the copies as the model made them, where they were measurable
        in_model = block.copy_rate()
        link_bytes_per_s, link_source = ((in_model, "in the model") if in_model is not None
                                         else (measure_link(device), "on one copy"))
    prof = ModelProfile(
        blocks=[block] * cfg.n_layers,
        static=static_bytes(cfg, optimizer),
        head_fwd_s=hf, head_bwd_s=hb, head_held=hheld, head_peak=hpeak,
        link_bytes_per_s=float(link_bytes_per_s),
        shared_bytes=float(2 * seq * cfg.rotary_dims * 4),  # cos and sin, fp32, made once per forward
        overlap=device.type == "cuda",  # a copy stream beside compute; the CPU copies on its own cores
        meta={"compiled": compiled, "micro_batch": micro_batch, "seq_len": seq, "precision": precision, "device": str(device), "machine": measuring_machine(device),
              "n_layers": cfg.n_layers, "d_model": cfg.d_model, "optimizer": optimizer,
              "link_measured": link_source != "configured", "link_source": link_source,
              "host_step_s_per_param": host_optimizer_seconds_per_param()},  # the price of optimizer offload
    )
    if path is not None:
        write_text_atomic(path, json.dumps(prof.to_dict()))  # every rank on a host may write it
    return prof
