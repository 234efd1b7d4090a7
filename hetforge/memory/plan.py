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
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

BRANCHES = ("attn", "mlp")

# Named options: per branch (attention, MLP) keep everything, recompute it, or offload it. "block"
# decides a whole block at once, "sublayer" each branch; "tensor" (not a list: see `Decision`)
# decides every saved unit and every op unit on its own.
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
MENUS: dict[str, tuple[str, ...]] = {
    "block": ("keep", "recompute", "offload"),
    "sublayer": tuple(OPTIONS),
}
GRANULARITIES = ("block", "sublayer", "tensor")
RECOMPUTE_ONLY = ("keep", "recompute", "recompute-mlp", "recompute-attn")
ALL = "*"  # "every saved unit of the branch"


@dataclass(frozen=True)
class Unit:
    """One named piece of a block's activations (see `hetforge.memory.units`)."""

    name: str
    kind: str  # "saved" | "op" | "input"
    bytes: float  # device bytes while it is held
    host_bytes: float = 0.0  # saved / input units: bytes copied to the host when offloaded
    time_s: float = 0.0  # op units: forward time of its ops, i.e. what recomputing them costs;
    # rebuildable saved units: what rebuilding it in the backward adds to the step
    users: tuple[str, ...] = ()  # input units: the branches that save it or hold it
    rebuild_from: str = ""  # saved units a kept branch can rebuild: the unit it is made from
    rebuild_bytes: float = 0.0  # and the device bytes rebuilding frees (a weight's cast in it stays)

    @property
    def branch(self) -> str:
        return self.name.split(".", 1)[0] if self.kind != "input" else ""


@dataclass(frozen=True)
class BranchPlan:
    mode: str  # "keep" (saved units kept or offloaded) | "recompute" (op units cached or recomputed)
    units: frozenset = frozenset()  # keep: the saved units offloaded; recompute: the op units cached
    rebuilt: frozenset = frozenset()  # keep: the saved units rebuilt in the backward (`units.rebuilds`)
    # keep, under 1: the branch runs compiled with the partitioner's activation memory budget at this
    # value, recomputing in its backward what the partitioner chose not to save (`memory.compiled`);
    # its saved units are the compiled graph's, so none is offloaded or rebuilt one by one
    budget: float = 1.0


@dataclass(frozen=True)
class Decision:
    """What one block does with each of its units; every option, named or not, is one of these."""

    attn: BranchPlan
    mlp: BranchPlan
    offload_inputs: frozenset = frozenset()

    def branch(self, name: str) -> BranchPlan:
        return self.attn if name == "attn" else self.mlp

    def encode(self) -> str:
        parts = []
        for br in BRANCHES:
            bp = self.branch(br)
            names = sorted(u.split(".", 1)[1] if "." in u else u for u in bp.units)
            verb = "offload" if bp.mode == "keep" else "cache"
            rebuilt = sorted(u.split(".", 1)[1] for u in bp.rebuilt)
            parts.append(f"{br}:{bp.mode}" + (f"@{bp.budget:g}" if bp.budget < 1 else "")
                         + (f"-{verb}[{','.join(names)}]" if names else "")
                         + (f"-rebuild[{','.join(rebuilt)}]" if rebuilt else ""))
        if self.offload_inputs:
            parts.append(f"offload[{','.join(sorted(self.offload_inputs))}]")
        return " | ".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Decision":
        branches, inputs = {}, frozenset()
        for part in text.split(" | "):
            m = re.fullmatch(r"(attn|mlp):(keep|recompute)(?:@([0-9.]+))?(?:-(?:offload|cache)\[([^\]]*)\])?"
                             r"(?:-rebuild\[([^\]]*)\])?", part.strip())
            if m:
                br, mode, budget, names, rebuilt = m.groups()
                if rebuilt and mode != "keep":
                    raise ValueError(f"block decision {text!r}: only a kept branch rebuilds units")
                if budget is not None and (mode != "keep" or names or rebuilt or not 0 <= float(budget) < 1):
                    raise ValueError(f"block decision {text!r}: a compile budget (@b, 0 <= b < 1) is for a kept "
                                     "branch that offloads and rebuilds nothing")
                units = frozenset(n if n == ALL else f"{br}.{n}" for n in (names or "").split(",") if n)
                branches[br] = BranchPlan(mode, units, frozenset(f"{br}.{n}" for n in (rebuilt or "").split(",") if n),
                                          1.0 if budget is None else float(budget))
                continue
            m = re.fullmatch(r"offload\[([^\]]*)\]", part.strip())
            if not m:
                raise ValueError(f"cannot read the block decision {text!r}")
            inputs = frozenset(n for n in m.group(1).split(",") if n)
        if set(branches) != set(BRANCHES):
            raise ValueError(f"block decision {text!r} must name both branches (attn, mlp)")
        return cls(branches["attn"], branches["mlp"], inputs)


def resolve_option(option: str, input_users: dict[str, tuple[str, ...]]) -> Decision:
    """A named option as a decision (given the block's inputs and the branches that save them),
    or an encoded decision read back."""
    if option not in OPTIONS:
        return Decision.parse(option)
    modes = dict(zip(BRANCHES, OPTIONS[option]))
    plans = {br: BranchPlan("recompute") if m == "recompute" else
             BranchPlan("keep", frozenset({ALL}) if m == "offload" else frozenset()) for br, m in modes.items()}
    # a shared input goes to the host only when every branch that saves it offloads
    inputs = frozenset(n for n, users in input_users.items() if all(modes[b] == "offload" for b in users))
    return Decision(plans["attn"], plans["mlp"], inputs)


def budget_key(budget: float) -> str:
    """How a compile budget is written in a profile (JSON keys are strings)."""
    return f"{budget:g}"


@dataclass(frozen=True)
class OptionCost:
    """One block under one decision."""

    held: float  # device bytes kept from the end of the block's forward to its backward
    host: float  # bytes copied to host (and back)
    fwd_peak: float  # the block's own peak bytes during its forward
    bwd_peak: float  # the block's own peak bytes during its backward (rematerialised tensors too)
    recompute_s: float  # forward work repeated in backward


@dataclass
class BlockProfile:
    """One block as measured: times, its units (from which the cost of every decision follows) and
    its own peak bytes in forward and backward per pair of branch modes, "keep/recompute" etc.
    (offloaded tensors are back on the device for the block's backward, so only recomputation
    changes the peaks; outputs a recomputed branch caches are added on top, an upper bound)."""

    fwd_s: float
    bwd_s: float
    input_bytes: float
    units: list[Unit]
    peaks: dict[str, list[float]]  # "attn mode/mlp mode" -> [forward peak, backward peak]
    tensors: list[dict] = field(default_factory=list)  # per saved tensor: unit, shape, bytes
    # Per branch, seconds a recomputed branch adds to the step, as measured: by a plain checkpoint
    # ("plain"), by selective checkpointing caching nothing ("sac") or every op unit ("sac_all").
    # A branch caching units S costs sac_all + the time of the op units not in S (the units' times
    # add up to sac - sac_all). Without these figures a branch costs just its units' time.
    # "both": {"plain": seconds} with both branches recomputed by plain checkpoints, measured as a
    # whole: the two do not add up (on small blocks on the CPU the pair costs less than the sum).
    # `both_extra_s` is the difference. "block": {"hooks": seconds} is what running the block under
    # the saved-tensor hooks adds (`hooks_s`). A compiled run's profile adds per branch "eager": what
    # the kept branch adds run eager (to offload or rebuild units) over the branch compiled, the
    # hooks aside. A branch's "rebuild" is the rebuilding alone. A CPU profile adds to "block"
    # "copy": what offloading every unit and the input adds beside the hooks (`copy_rate`).
    recompute: dict[str, dict[str, float]] = field(default_factory=dict)
    timing_depth: int = 1  # copies of the block its times were taken over, in a row (`memory.profile`)
    # A compiled run's profile: per branch, per compile budget under 1 (`budget_key`), the bytes the
    # kept branch saves compiled at that budget (its input aside) and the seconds it adds to the step
    # over the branch compiled plainly: {"held": bytes, "time_s": seconds}
    compiled: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._costs: dict[str, OptionCost] = {}
        self._of: dict[tuple, list[Unit]] = {}

    def of(self, kind: str, branch: str | None = None) -> list[Unit]:
        got = self._of.get((kind, branch))
        if got is None:
            got = self._of[(kind, branch)] = [u for u in self.units
                                              if u.kind == kind and (branch is None or u.branch == branch)]
        return got

    @property
    def hooks_s(self) -> float:
        """What running the block under the saved-tensor hooks adds to the step (a Python call per
        saved tensor, each way): paid once by a block that offloads or rebuilds anything."""
        return max(0.0, self.recompute.get("block", {}).get("hooks", 0.0))

    def copy_rate(self) -> float | None:
        """Bytes a second of the host copies as the model ran them, each way (None unmeasured).

        On the CPU a copy to the host runs on the compute cores between the ops, with a cost per
        tensor (a NumPy buffer, its pages) beside the bytes, and its speed depends on the state of the
        allocator: a copy timed alone (`profile.measure_link`) runs an order of magnitude slower in a
        fresh process than later in the same one, which priced plans that offload far from what they
        measured. The profile instead times the block with everything offloaded, which pays every
        byte out in the forward and back in the backward, as the model does."""
        fig = self.recompute.get("block", {})
        copy_s, moved = fig.get("copy"), self.cost("offload").host
        if copy_s is None or copy_s <= 0 or moved <= 0:
            return None
        return 2 * moved / copy_s

    def eager_s(self, branch: str) -> float:
        """What a kept branch adds to the step when it runs eager to offload or rebuild units in a
        run that compiles its blocks (measured in a compiled profile; 0 in an eager one)."""
        return max(0.0, self.recompute.get(branch, {}).get("eager", 0.0))

    def budgets(self, branch: str) -> list[float]:
        """The compile budgets this profile has measured for a kept branch (none for eager runs)."""
        return sorted(float(b) for b in self.compiled.get(branch, {}))

    def decision(self, option: str) -> Decision:
        return resolve_option(option, {u.name: u.users for u in self.of("input")})

    def name(self, d: Decision) -> str:
        """The named option equal to `d` where there is one, else `d` encoded."""
        for o in OPTIONS:
            if self._normal(self.decision(o)) == self._normal(d):
                return o
        return d.encode()

    def _normal(self, d: Decision) -> tuple:
        out = []
        for br in BRANCHES:
            bp = d.branch(br)
            if bp.mode == "keep" and bp.budget < 1:
                out.append(("keep", frozenset(), frozenset(), bp.budget))
            elif bp.mode == "keep":
                names = {u.name for u in self.of("saved", br)}
                off = frozenset(names if ALL in bp.units else bp.units & names)
                out.append(("keep", off, frozenset(n for n in bp.rebuilt if n in self.rebuildable) - off, 1.0))
            else:
                out.append(("recompute", frozenset(bp.units & {u.name for u in self.of("op", br)})))
        keepers = {b for b in BRANCHES if d.branch(b).mode == "keep"}
        out.append(frozenset(u.name for u in self.of("input") if u.name in d.offload_inputs and keepers & set(u.users)))
        return tuple(out)

    @property
    def both_extra_s(self) -> float:
        """What recomputing both branches by plain checkpoints adds beyond the two branches' own
        prices (negative where the pair costs less than the sum). Only that case was measured: with
        selective checkpointing in either branch the two branches' prices stand (a negative
        correction added to a branch whose caching leaves little to recompute would price a step
        under keep-all's)."""
        both = self.recompute.get("both")
        if not both or any(br not in self.recompute for br in BRANCHES):
            return 0.0
        return both["plain"] - sum(self.recompute[br]["plain"] for br in BRANCHES)

    @cached_property
    def rebuildable(self) -> dict[str, "Unit"]:
        """Saved units a kept branch can rebuild, by name; a profile without their price has none."""
        return {u.name: u for u in self.of("saved") if u.rebuild_from}

    def cost(self, option: str) -> OptionCost:
        c = self._costs.get(option)
        if c is None:
            c = self._costs[option] = self._cost(self.decision(option))
        return c

    def _cost(self, d: Decision) -> OptionCost:
        held = host = rec = cached = 0.0
        plain = 0  # branches recomputed by a plain checkpoint
        hooked = False  # the block runs under the saved-tensor hooks
        for br in BRANCHES:
            bp = d.branch(br)
            if bp.mode == "keep" and bp.budget < 1:
                fig = self.compiled.get(br, {}).get(budget_key(bp.budget))
                if fig is None:
                    raise ValueError(f"the profile has no measurement of the {br} branch compiled at budget "
                                     f"{bp.budget:g} (measured: {self.budgets(br) or 'none, an eager profile'})")
                held += fig["held"]
                rec += fig["time_s"]
            elif bp.mode == "keep":
                per_op = False
                for u in self.of("saved", br):
                    if ALL in bp.units or u.name in bp.units:
                        host += u.host_bytes
                        per_op = True
                    elif u.name in bp.rebuilt and u.rebuild_from:
                        rec += u.time_s  # made again in the backward; the backward peak is keep's at most
                        held += u.bytes - u.rebuild_bytes
                        per_op = True
                    else:
                        held += u.bytes
                if per_op:  # a compiled run runs this branch eager (`executor.per_op_decisions`)
                    rec += self.eager_s(br)
                    hooked = True
            else:
                ops = self.of("op", br)
                hit = [u for u in ops if u.name in bp.units]
                cached += sum(u.bytes for u in hit)
                fixed = self.recompute.get(br)
                if fixed is not None and not hit:
                    rec += fixed["plain"]
                    plain += 1
                else:
                    rec += (fixed["sac_all"] if fixed else 0.0) + sum(u.time_s for u in ops if u not in hit)
        if plain == len(BRANCHES):
            rec += self.both_extra_s
        for u in self.of("input"):
            keepers = [b for b in u.users if d.branch(b).mode == "keep"]
            holders = [b for b in u.users if d.branch(b).mode == "recompute"]
            off = bool(keepers) and u.name in d.offload_inputs
            if holders or (keepers and not off):
                held += u.bytes
            if off:
                host += u.host_bytes
                hooked = True
        if hooked:
            rec += self.hooks_s
        fwd, bwd = self.peaks[f"{d.attn.mode}/{d.mlp.mode}"]
        return OptionCost(held + cached, host, fwd + cached, bwd + cached, rec)


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
    shared_bytes: float = 0.0  # activations alive all step that no block owns (the rotary tables)
    # transient buffers outside the model, e.g. gloo's copy of a gradient bucket while it all-reduces
    workspace_bytes: float = 0.0
    # Copies run beside compute (a GPU's copy stream) or on the compute's own cores (the CPU: the
    # copy out is paid in the block's forward, the copy back in the backward that prefetches it).
    overlap: bool = True
    # Micro-batches whose saved activations are alive at once: 1, but a pipeline stage under 1F1B
    # holds the forwards of several before their backwards; every row then carries the other
    # micro-batches' held bytes too (their blocks' choices are this one's).
    inflight: int = 1

    @property
    def static_bytes(self) -> float:
        return sum(self.static.values())

    @property
    def base_bytes(self) -> float:
        """What every stage of the step holds whatever the plan: static, shared and workspace."""
        return self.static_bytes + self.shared_bytes + self.workspace_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        blocks = [
            BlockProfile(
                b["fwd_s"], b["bwd_s"], b["input_bytes"],
                [Unit(**{**u, "users": tuple(u["users"])}) for u in b["units"]],
                b["peaks"], b.get("tensors", []), b.get("recompute", {}), b.get("timing_depth", 1),
                b.get("compiled", {}),
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
            keep = b.cost("keep")
            held.append(b.input_bytes if i == s else 0.0)
            host.append(0.0)
            fpk.append(keep.fwd_peak)
            # the segment's backward rematerialises all of it first; blocks s..i-1 are live at B_i
            bpk.append(keep.bwd_peak + sum(blocks[j].cost("keep").held for j in range(s, i)))
            rec.append(b.fwd_s)
            continue
        c = b.cost(name)
        held.append(c.held), host.append(c.host), fpk.append(c.fwd_peak), bpk.append(c.bwd_peak)
        rec.append(c.recompute_s)
    link = profile.link_bytes_per_s
    xfer = [h / link if h else 0.0 for h in host]
    static = profile.static_bytes
    timeline: list[tuple[str, float, float]] = []
    stall = 0.0
    peak, peak_at = -1.0, {}
    prefix = 0.0
    others = (profile.inflight - 1) * sum(held)  # the other in-flight micro-batches' saved bytes

    def record(stage: str, dur: float, own: float, neighbour: float, prefix_: float) -> None:
        nonlocal peak, peak_at
        mem = profile.base_bytes + others + prefix_ + neighbour + own
        timeline.append((stage, dur, mem))
        if mem > peak:
            peak = mem
            peak_at = {**profile.static, "rotary tables": profile.shared_bytes, "workspace": profile.workspace_bytes,
                       "activations held": prefix_, "other micro-batches' activations": others,
                       "transfer buffers": neighbour, f"{stage} working set": own}

    lap = profile.overlap
    for k in range(n):
        if lap:  # block k-1's copy out runs during F_k, its tensors still on the device
            prev, s_ = (host[k - 1] if k else 0.0), max(0.0, (xfer[k - 1] if k else 0.0) - blocks[k].fwd_s)
        else:  # block k copies out in its own forward and frees its tensors at the end of it
            prev, s_ = 0.0, xfer[k]
        stall += s_
        record(f"F{k}", blocks[k].fwd_s + s_, fpk[k], prev, prefix)
        prefix += held[k]
    head_s = profile.head_fwd_s + profile.head_bwd_s
    s_ = max(0.0, (xfer[n - 1] if n else 0.0) - head_s) if lap else 0.0
    stall += s_
    held_total = prefix
    record("H", head_s + s_, profile.head_peak, host[n - 1] if n and lap else 0.0, prefix)
    for k in range(n - 1, -1, -1):
        prefix -= held[k]
        prev = host[k - 1] if k else 0.0  # block k-1 is prefetched while B_k runs
        if lap:
            s_ = max(0.0, (xfer[k - 1] if k else 0.0) - (blocks[k].bwd_s + rec[k]))
        else:  # the prefetch of block k-1 (and, for the last block, its own fetch) is paid here
            s_ = (xfer[k - 1] if k else 0.0) + (xfer[k] if k == n - 1 else 0.0)
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


def stage_profile(profile: ModelProfile, blocks: int, last: bool, static: dict[str, float], inflight: int,
                  workspace_bytes: float) -> ModelProfile:
    """A pipeline stage's part of a model profile: its first `blocks` blocks (a model's blocks are
    alike), the head only on the last stage (logits and loss; the embedding's output is the
    first block's input), its own static bytes, the schedule's micro-batches in flight, and its
    send and receive buffers as workspace."""
    head = (profile.head_fwd_s, profile.head_bwd_s, profile.head_held, profile.head_peak) if last else (0.0,) * 4
    return replace(profile, blocks=list(profile.blocks[:blocks]), static=dict(static), head_fwd_s=head[0],
                   head_bwd_s=head[1], head_held=head[2], head_peak=head[3], inflight=inflight,
                   workspace_bytes=workspace_bytes, meta={**profile.meta, "n_layers": blocks})


def sqrt_segments(n: int) -> list[tuple[int, int]]:
    """Chen et al. 2016: ⌈√n⌉ segments of about √n blocks, each checkpointed as one unit."""
    if n == 0:
        return []
    k = max(1, round(math.sqrt(n)))
    return [(s, min(n, s + k)) for s in range(0, n, k)]
