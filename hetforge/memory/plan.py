"""What a memory plan is and what it costs: the option menu, the profile it is priced from, and the
reference simulator of one training step.

Every planner (the MILP, the baselines, the brute-force check in the tests) is judged by
`simulate`, which walks the step's schedule stage by stage:

    F_1 .. F_n  (block forwards)   H (head: final norm, logits, loss, and its backward)   B_n .. B_1

Memory at a stage = static (weights, grads, optimizer state) + embedding/head bytes held + bytes
held by earlier blocks + the neighbour's transfer buffer + the current block's own peak. A block's
offloaded tensors are still on the device while they are copied out during the next block's
forward, and are already back (prefetched) during the next block's backward; a copy longer than the
stage it overlaps stalls the step by the difference. This is the schedule the executor runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MODES = ("keep", "recompute", "offload")
BRANCHES = ("attn", "mlp")

# Option name -> mode of the attention branch and of the MLP branch. The first three are the
# block-level menu; the rest decide per branch (the tensors each sub-layer saves).
OPTIONS: dict[str, tuple[str, str]] = {
    "keep": ("keep", "keep"),
    "recompute": ("recompute", "recompute"),
    "offload": ("offload", "offload"),
    "recompute-mlp": ("keep", "recompute"),
    "recompute-attn": ("recompute", "keep"),
    "offload-mlp": ("keep", "offload"),
    "offload-attn": ("offload", "keep"),
    "offload-attn+recompute-mlp": ("offload", "recompute"),
    "recompute-attn+offload-mlp": ("recompute", "offload"),
}
MENUS = {
    "block": ("keep", "recompute", "offload"),
    "sublayer": tuple(OPTIONS),
}
RECOMPUTE_ONLY = ("keep", "recompute", "recompute-mlp", "recompute-attn")


@dataclass(frozen=True)
class OptionCost:
    """One block under one option, as measured by the profiler."""

    held: float  # device bytes kept from the end of the block's forward to its backward
    host: float  # bytes copied to host (and back)
    fwd_peak: float  # the block's own peak bytes during its forward
    bwd_peak: float  # the block's own peak bytes during its backward (rematerialised tensors too)
    recompute_s: float  # forward work repeated in backward


@dataclass
class BlockProfile:
    fwd_s: float
    bwd_s: float
    input_bytes: float
    options: dict[str, OptionCost]
    tensors: list[dict] = field(default_factory=list)  # per saved tensor: module, shape, bytes


@dataclass
class ModelProfile:
    blocks: list[BlockProfile]
    static: dict[str, float]  # weights, gradients, optimizer state
    head_fwd_s: float
    head_bwd_s: float
    head_held: float  # embedding + final norm + logits + loss tensors kept for backward
    head_peak: float  # the head stage's own peak (held tensors plus logits gradient)
    link_bytes_per_s: float  # host <-> device copy bandwidth (measured on GPU, configured on CPU)
    meta: dict = field(default_factory=dict)

    @property
    def static_bytes(self) -> float:
        return sum(self.static.values())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        blocks = [
            BlockProfile(
                b["fwd_s"], b["bwd_s"], b["input_bytes"],
                {k: OptionCost(**v) for k, v in b["options"].items()}, b.get("tensors", []),
            )
            for b in d["blocks"]
        ]
        rest = {k: v for k, v in d.items() if k != "blocks"}
        return cls(blocks=blocks, **rest)


@dataclass
class Plan:
    """Per block an option name; `segments` (sqrt(n) baseline only) checkpoints runs of blocks as
    one unit, so only each segment's input is held and the whole segment is rematerialised at once."""

    options: list[str]
    strategy: str = "milp"
    segments: list[tuple[int, int]] | None = None
    solve: dict = field(default_factory=dict)  # solver facts: time, gap, status

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Prediction:
    peak_bytes: float
    activation_peak: float  # peak minus static
    held_bytes: float  # Σ bytes held by blocks at the end of the forward (what the hooks count)
    host_bytes: float
    time_s: float
    breakdown_time: dict[str, float]
    breakdown_memory: dict[str, float]  # at the peak stage
    timeline: list[tuple[str, float, float]]  # (stage, duration s, bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def _seg_of(plan: Plan, n: int) -> list[tuple[int, int] | None]:
    seg: list[tuple[int, int] | None] = [None] * n
    for s, e in plan.segments or []:
        for i in range(s, e):
            seg[i] = (s, e)
    return seg


def simulate(profile: ModelProfile, plan: Plan) -> Prediction:
    """Peak memory and step time of `plan` on `profile` (the reference every planner is held to)."""
    blocks, n = profile.blocks, len(profile.blocks)
    if len(plan.options) != n:
        raise ValueError(f"plan has {len(plan.options)} options for {n} blocks")
    seg = _seg_of(plan, n)
    held, host, fpk, bpk, rec = [], [], [], [], []
    for i, (b, name) in enumerate(zip(blocks, plan.options)):
        if seg[i] is not None:  # inside a checkpointed segment
            s, e = seg[i]
            keep = b.options["keep"]
            held.append(b.input_bytes if i == s else 0.0)
            host.append(0.0)
            fpk.append(keep.fwd_peak)
            # the segment's backward rematerialises all of it first; blocks s..i-1 are live at B_i
            bpk.append(keep.bwd_peak + sum(blocks[j].options["keep"].held for j in range(s, i)))
            rec.append(b.fwd_s)
            continue
        c = b.options[name]
        held.append(c.held), host.append(c.host), fpk.append(c.fwd_peak), bpk.append(c.bwd_peak)
        rec.append(c.recompute_s)
    link = profile.link_bytes_per_s
    xfer = [h / link if h else 0.0 for h in host]
    static = profile.static_bytes
    timeline: list[tuple[str, float, float]] = []
    stall = 0.0
    peak, peak_at = -1.0, {}
    prefix = 0.0

    def record(stage: str, dur: float, own: float, neighbour: float, prefix_: float) -> None:
        nonlocal peak, peak_at
        mem = static + prefix_ + neighbour + own
        timeline.append((stage, dur, mem))
        if mem > peak:
            peak = mem
            peak_at = {**profile.static, "activations held": prefix_, "transfer buffers": neighbour,
                       f"{stage} working set": own}

    for k in range(n):
        prev = host[k - 1] if k else 0.0
        s_ = max(0.0, (xfer[k - 1] if k else 0.0) - blocks[k].fwd_s)
        stall += s_
        record(f"F{k}", blocks[k].fwd_s + s_, fpk[k], prev, prefix)
        prefix += held[k]
    s_ = max(0.0, (xfer[n - 1] if n else 0.0) - (profile.head_fwd_s + profile.head_bwd_s))
    stall += s_
    held_total = prefix
    record("H", profile.head_fwd_s + profile.head_bwd_s + s_, profile.head_peak, host[n - 1] if n else 0.0, prefix)
    for k in range(n - 1, -1, -1):
        prefix -= held[k]
        prev = host[k - 1] if k else 0.0
        s_ = max(0.0, (xfer[k - 1] if k else 0.0) - (blocks[k].bwd_s + rec[k]))
        stall += s_
        record(f"B{k}", blocks[k].bwd_s + rec[k] + s_, bpk[k], prev, prefix)
    fwd = sum(b.fwd_s for b in blocks) + profile.head_fwd_s
    bwd = sum(b.bwd_s for b in blocks) + profile.head_bwd_s
    return Prediction(
        peak_bytes=peak,
        activation_peak=peak - static,
        held_bytes=held_total,
        host_bytes=sum(host),
        time_s=fwd + bwd + sum(rec) + stall,
        breakdown_time={"forward": fwd, "backward": bwd, "recompute": sum(rec), "transfer stall": stall},
        breakdown_memory=peak_at,
        timeline=timeline,
    )


def sqrt_segments(n: int) -> list[tuple[int, int]]:
    """Chen et al. 2016: ⌈√n⌉ segments of about √n blocks, each checkpointed as one unit."""
    if n == 0:
        return []
    k = max(1, round(math.sqrt(n)))
    return [(s, min(n, s + k)) for s in range(0, n, k)]


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "b": 1}


def parse_size(text: str | float | int) -> float:
    """'10GiB', '512MiB', '1.5e9', 2e9 -> bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):] or "b"
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot read memory size {text!r}: use e.g. 10GiB, 512MiB, 8GB or a byte count")
    return float(num) * _UNITS[unit]
