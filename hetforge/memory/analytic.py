"""A memory profile for a card that is not here (`hetforge plan --card/--cluster`, the legacy table).

Bytes from shapes: the real block and head are traced at the run's micro-batch and sequence on fake
tensors (`FakeTensorMode`: shapes, dtypes and storages, no memory and no arithmetic), through the
same executor, labels and options as a measured profile (`profile.BlockBench`), so every saved unit,
op unit and peak is the one the real block makes, in a fraction of a second and whatever the model's
size. Autocast runs in the card's 16-bit type (or fp32), and the head size is padded as a run on
that card would pad it (`core.hardware.padded_head_dim`). Where the card's attention kernel is
PyTorch's math fallback (`core.hardware.sdpa_backend`), the attention probabilities, micro-batch x
heads x sequence^2, are added to what the attention keeps and to the block's peaks (the trace runs
the CPU's flash kernel).

Times from the card's datasheet: each op of the traced forward and backward is priced on a
roofline, its FLOPs (matmuls and attention) at `EFFICIENCY` of the card's peak in the run's
precision, or the bytes it reads and writes at `BANDWIDTH_EFFICIENCY` of the card's memory
bandwidth, whichever takes longer. A unit's recomputation is its ops' forward time; rebuilding a
unit is its producing op's. The host link is the card's PCIe generation. An estimate, to be held
against a real profile when the card is at hand (`bench/gpu_check.sh` does so on a lent GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hetforge.core.hardware import DeviceInfo, padded_head_dim, run_precision, sdpa_backend
from hetforge.memory.measure import TracedMemory
from hetforge.memory.plan import BRANCHES, BlockProfile, ModelProfile, Unit
from hetforge.memory.profile import BlockBench, HeadBench, made_bytes
from hetforge.memory.units import Labeller, is_view_op, rebuilds, tensor_bytes
from hetforge.model.accounting import head_forward_flops, static_bytes
from hetforge.model.gpt_neox import GPTNeoXConfig

EFFICIENCY = 0.45  # the share of the datasheet peak a training step's matmuls reach
BANDWIDTH_EFFICIENCY = 0.7  # the share of the datasheet memory bandwidth elementwise kernels reach
CONTEXT_BYTES = 0.75 * 2**30  # CUDA context, cuBLAS workspace and allocator slack
# A host's fused AdamW step per parameter (the price of optimizer offload, with the copies): the
# hosts of a cluster that is not here are not measured either.
HOST_STEP_S_PER_PARAM = 2e-9


def usable_bytes(card: DeviceInfo) -> float:
    """What a plan may use of the card: its memory less the context and 5% for fragmentation."""
    return card.memory_gb * 2**30 * 0.95 - CONTEXT_BYTES


def card_precision(card: DeviceInfo) -> str:
    return run_precision([card.caps()])[0]


def _attention_flops(func, args, out) -> float:
    """Forward (QK^T and PV) or backward (twice that) FLOPs of a fused attention op, from q and v."""
    q, v = args[0], args[2]
    b, h, s_q, d = q.shape
    forward = 2.0 * b * h * s_q * v.shape[-2] * (d + v.shape[-1])
    return 2.0 * forward if "backward" in str(func) else forward


@dataclass
class OpCosts:
    """What a traced pass did, per op unit ("" for ops of no unit): FLOPs, and bytes read and written."""

    flops: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)

    def add(self, unit: str, flops: float, nbytes: float) -> None:
        self.flops[unit] = self.flops.get(unit, 0.0) + flops
        self.bytes[unit] = self.bytes.get(unit, 0.0) + nbytes

    def seconds(self, unit: str, flops_per_s: float, bytes_per_s: float) -> float:
        return max(self.flops.get(unit, 0.0) / flops_per_s, self.bytes.get(unit, 0.0) / bytes_per_s)

    def total_s(self, flops_per_s: float, bytes_per_s: float) -> float:
        return sum(self.seconds(u, flops_per_s, bytes_per_s) for u in self.flops)


class _OpCounter(TorchDispatchMode):
    """Per op unit of a block's forward (`Labeller`), the FLOPs and bytes of its ops, and the bytes
    that selective checkpointing could cache (`profile.made_bytes`); the backward's ops go to
    `backward`, unlabelled. Views move nothing and cost nothing."""

    def __init__(self, labeller: Labeller, params: set[int]):
        super().__init__()
        self.labeller, self.params = labeller, params
        self.forward, self.backward = OpCosts(), OpCosts()
        self.made: dict[str, int] = {}
        self.in_backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_view_op(func):
            return out
        unit = None if self.in_backward else self.labeller.op_unit(func)
        if "scaled_dot_product" in str(func):
            flops = _attention_flops(func, args, out)
        elif func._overloadpacket in flop_registry:
            flops = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        else:
            flops = 0.0
        moved = sum(tensor_bytes(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        (self.backward if self.in_backward else self.forward).add(unit or "", flops, float(moved))
        if unit is not None:
            made = made_bytes(args, kwargs, out, self.params)
            if made is not None:
                self.made[unit] = self.made.get(unit, 0) + made
        return out


@dataclass
class Trace:
    """What the fake trace of one block and the head gives, before any card's prices."""

    input_bytes: float
    units: list[Unit]  # saved and input units
    peaks: dict[str, list[float]]
    made: dict[str, int]  # op unit -> bytes its ops make
    forward: OpCosts
    backward: OpCosts
    head_held: float
    head_peak: float


@lru_cache(maxsize=64)
def trace(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, head_dim: int) -> Trace:
    """One block and the head of `cfg` at this micro-batch and sequence, on fake tensors."""
    cpu = torch.device("cpu")
    with torch.random.fork_rng(devices=[]), FakeTensorMode(), TracedMemory() as memory:
        bench = BlockBench(cfg, micro_batch, seq, precision, cpu, memory.meter, head_dim)
        units, peaks, _, _ = bench.record()
        labeller = Labeller()
        handles = labeller.install(bench.block)
        counter = _OpCounter(labeller, bench.params)
        x = bench.x0.detach().requires_grad_(True)
        with counter, bench.autocast():
            out = bench.block(x, bench.cos, bench.sin)
        counter.in_backward = True
        with counter:
            out.backward(bench.grad)
        for hd in handles:
            hd.remove()
        head_held, head_peak = HeadBench(cfg, micro_batch, seq, precision, cpu, memory.meter).held_and_peak()
    return Trace(float(bench.input_bytes), units, peaks, counter.made, counter.forward, counter.backward,
                 head_held, head_peak)


def activation_bytes_per_sample(cfg: GPTNeoXConfig, seq: int, precision: str, head_dim: int | None = None,
                                 floor: bool = False) -> float:
    """What one sample saves for the backward, from the model's shape: every block keeping all it
    saves, and the head's; or with `floor` an activation plan's least (every block's input kept,
    and one block's whole)."""
    t = trace(cfg, 1, seq, precision, head_dim or cfg.head_dim)
    block = sum(u.bytes for u in t.units)
    if floor:
        return t.head_held + block + (cfg.n_layers - 1) * t.input_bytes
    return t.head_held + cfg.n_layers * block


def analytic_profile(cfg: GPTNeoXConfig, micro_batch: int, seq: int, card: DeviceInfo, optimizer: str = "adamw",
                     efficiency: float = EFFICIENCY, pad_head_dim: str | int = "auto",
                     precision: str | None = None) -> ModelProfile:
    """The profile of `cfg` on `card` at this micro-batch and sequence, in the card's own precision
    or the run's (`precision`: a mixed cluster trains in one)."""
    precision = precision or card_precision(card)
    head = padded_head_dim(card, precision, cfg.head_dim, pad_head_dim)
    backend = sdpa_backend(card, precision, head)
    t = trace(cfg, micro_batch, seq, precision, head)
    flops_per_s = card.peak_tflops(precision) * 1e12 * efficiency
    bytes_per_s = card.memory_gbps * 1e9 * BANDWIDTH_EFFICIENCY
    elt = 4 if precision == "fp32" else 2
    probs = float(micro_batch * cfg.n_heads * seq * seq * elt) if backend == "math" else 0.0

    def op_s(unit: str) -> float:
        return t.forward.seconds(unit, flops_per_s, bytes_per_s)

    units = []
    for u in t.units:
        if u.name == "attn.core" and probs:
            u = Unit(u.name, u.kind, u.bytes + probs, u.host_bytes + probs, u.time_s, u.users, u.rebuild_from,
                     u.rebuild_bytes)
        units.append(u)
    # op units: what they make (the probabilities too, under the math kernel) and their forward time
    for name, made in t.made.items():
        units.append(Unit(name, "op", float(made) + (probs if name == "attn.sdpa" else 0.0), time_s=op_s(name)))
    # a kept branch rebuilds a saved unit by running its producing op again
    table = rebuilds(cfg.parallel_residual)
    units = [Unit(u.name, u.kind, u.bytes, u.host_bytes, op_s(table[u.name].op_unit), u.users,
                  table[u.name].source, u.rebuild_bytes)
             if u.kind == "saved" and u.name in table and u.rebuild_bytes > 0 else u for u in units]
    recompute: dict[str, dict[str, float]] = {"block": {"hooks": 0.0}}
    for br in BRANCHES:  # recomputing a branch runs its units' ops again (not its final projection)
        again = sum(op_s(n) for n in t.made if n.startswith(br + "."))
        recompute[br] = {"plain": again, "sac": again, "sac_all": 0.0}
        rebuilt = [u.time_s for u in units if u.kind == "saved" and u.branch == br and u.rebuild_from]
        if rebuilt:
            recompute[br]["rebuild"] = sum(rebuilt)
    recompute["both"] = {"plain": sum(recompute[br]["plain"] for br in BRANCHES)}
    peaks = {k: [v + 2 * probs for v in pair] for k, pair in t.peaks.items()}
    block = BlockProfile(t.forward.total_s(flops_per_s, bytes_per_s), t.backward.total_s(flops_per_s, bytes_per_s),
                         t.input_bytes, units, peaks, [], recompute)
    head_fwd = head_forward_flops(cfg, micro_batch * seq) / flops_per_s
    return ModelProfile(
        blocks=[block] * cfg.n_layers, static=static_bytes(cfg, optimizer), head_fwd_s=head_fwd,
        head_bwd_s=2 * head_fwd, head_held=t.head_held, head_peak=t.head_peak,
        link_bytes_per_s=card.link_gbps * 1e9, shared_bytes=float(2 * seq * cfg.rotary_dims * 4), overlap=True,
        meta={"analytic": True, "card": card.name, "precision": precision, "attention": backend, "head_dim": head,
              "micro_batch": micro_batch, "seq_len": seq, "n_layers": cfg.n_layers, "d_model": cfg.d_model,
              "efficiency": efficiency, "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
              "host_step_s_per_param": HOST_STEP_S_PER_PARAM},
    )


def block_summary(profile: ModelProfile, options: list[str]) -> str:
    """How many blocks keep, recompute, offload, or mix the two."""
    counts: dict[str, int] = {}
    for blk, o in zip(profile.blocks, options):
        d = blk.decision(o)
        modes = {d.attn.mode, d.mlp.mode}
        offloads = bool(d.offload_inputs) or any(d.branch(b).mode == "keep" and d.branch(b).units
                                                 for b in ("attn", "mlp"))
        recomputes = "recompute" in modes or any(d.branch(b).rebuilt for b in ("attn", "mlp"))
        kind = ("mixed" if offloads and recomputes else "offload" if offloads
                else "recompute" if recomputes else "keep")
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())
