"""Splitting the global batch over unequal ranks.

Each rank has a time model t_i(b): seconds for one forward+backward micro-step of b samples,
interpolated from a few measured points, and a largest micro-batch its memory allows. A rank given
n samples runs them as a = ceil(n / b) micro-steps of near-equal size, with the b that minimises its
time. The balancer picks the n_i (summing exactly to the global batch) that minimise the step time
max_i time_i(n_i): a greedy fill (each next sample to the rank whose time grows least) followed by
single-sample moves off the slowest rank while they help. That is within one sample's time of the
optimum for time models that grow with n, which measured ones do.

Under FSDP every micro-step also gathers the weights and reduce-scatters the gradients, a cost that
does not shrink with its size (`TimeModel.per_micro_s`, from a measured link): without it a probe
that times two micro-batches of 4 a little faster than one of 8 would double the step's collectives.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.core.errors import HetforgeError
from hetforge.core.sizes import format_bytes


BALANCE_FILE = "balance.json"  # a run's balance as it stands (the plan's, or re-balanced since)


class BalanceError(HetforgeError, ValueError):
    pass


@dataclass
class TimeModel:
    points: list[tuple[int, float]]  # (micro-batch, seconds per micro-step), b ascending
    max_micro: int
    # (micro-batch, seconds per optimizer step) paid once a step by a rank running that micro-batch,
    # whatever its share: the host optimizer step and copies of a plan that offloads it
    step_costs: list[tuple[int, float]] = field(default_factory=list)
    # seconds of collectives every micro-step launches whatever its size (FSDP2 gathers each unit's
    # weights and reduce-scatters its gradients per micro-batch): fewer, larger micro-batches save them
    per_micro_s: float = 0.0
    # seconds of collectives once a step, whatever the share (FSDP2 accumulating unsharded)
    per_step_s: float = 0.0

    def __post_init__(self):
        self.points = sorted((int(b), float(t)) for b, t in self.points)
        self.step_costs = sorted((int(b), float(t)) for b, t in self.step_costs)
        self._step_bs = [b for b, _ in self.step_costs]
        if not self.points:
            raise BalanceError("a time model needs at least one measured point")
        self._bs = [b for b, _ in self.points]

    def __call__(self, b: int) -> float:
        if b <= 0:
            return 0.0
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * b / pts[0][0]
        i = bisect.bisect_left(self._bs, b)
        if i < len(pts) and pts[i][0] == b:
            return pts[i][1]
        if i == 0:  # below the smallest measured size: proportional, never below zero
            return pts[0][1] * b / pts[0][0]
        (b0, t0), (b1, t1) = (pts[i - 1], pts[i]) if i < len(pts) else (pts[-2], pts[-1])
        return max(t0 + (t1 - t0) * (b - b0) / (b1 - b0), 1e-9)

    def step_cost(self, micro: int) -> float:
        """The once-a-step cost of running micro-batch `micro`: that of the nearest probed size at or
        above it (what needs its optimizer on the host at b does so above b too)."""
        if not self.step_costs:
            return 0.0
        i = min(bisect.bisect_left(self._step_bs, micro), len(self.step_costs) - 1)
        return self.step_costs[i][1]

    def scaled(self, factor: float) -> "TimeModel":
        return TimeModel([(b, t * factor) for b, t in self.points], self.max_micro,
                         [(b, t * factor) for b, t in self.step_costs], self.per_micro_s, self.per_step_s)

    def samples_per_s(self) -> float:
        return max(b / t for b, t in self.points if b <= self.max_micro)

    def _best(self, n: int) -> tuple[float, int, int, int]:
        best: tuple[float, int, int, int] | None = None
        for b in sorted({b for b in self._bs if b <= self.max_micro} | {min(n, self.max_micro)}):
            a = math.ceil(n / b)
            q, r = divmod(n, a)  # r micro-steps of q + 1 samples, a - r of q
            t = r * self(q + 1) + (a - r) * self(q) + a * self.per_micro_s + self.step_cost(q + 1 if r else q) \
                + self.per_step_s
            if best is None or t < best[0] - 1e-15:
                best = (t, q, r, a)
        return best

    def split(self, n: int) -> tuple[list[int], float]:
        """Best micro-batch sizes for n samples on this rank, and their total time."""
        if n == 0:
            return [], 0.0
        t, q, r, a = self._best(n)
        return [q + 1] * r + [q] * (a - r), t

    def cost(self, n: int) -> float:
        return self._best(n)[0] if n > 0 else 0.0

    def split_in(self, n: int, k: int) -> tuple[list[int], float]:
        """n samples in exactly k micro-batches (sizes differ by at most one; a size 0 is a dummy
        micro-batch of one sample at weight 0), and their time: what every rank must run when each
        micro-batch is a collective (FSDP). Infinite when a part would exceed the memory's limit."""
        q, r = divmod(n, k)
        parts = [q + 1] * r + [q] * (k - r)
        if parts[0] > self.max_micro:
            return parts, math.inf
        return parts, (sum(self(max(p, 1)) for p in parts) + k * self.per_micro_s + self.step_cost(max(parts[0], 1))
                       + self.per_step_s)

    def cost_in(self, n: int, k: int) -> float:
        return self.split_in(n, k)[1]


@dataclass
class RankShare:
    rank: int
    host: str
    device: str
    memory_gb: float | None
    samples_per_s: float
    max_micro: int
    samples: int
    micro_batches: list[int]
    predicted_s: float

    @property
    def micro_batch_size(self) -> int:
        return max(self.micro_batches, default=0)

    @property
    def grad_accum(self) -> int:
        return len(self.micro_batches)


@dataclass
class BalancePlan:
    global_batch: int
    mode: str
    shares: list[RankShare]
    fingerprint: str = ""
    models: list[dict] = field(default_factory=list)  # the time models it was solved from
    accumulation: str = "sharded"  # FSDP2's (`model.accounting.ACCUMULATIONS`); replicated runs: sharded

    @property
    def predicted_step_s(self) -> float:
        return max(s.predicted_s for s in self.shares)

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for s in self.shares:
            out.append(acc)
            acc += s.samples
        return out

    def micro_positions(self, rank: int, consumed: int) -> list[tuple[int, int]]:
        """(first global sample position, count) of each of this rank's micro-batches in the step
        that starts at global position `consumed`. Ranks take consecutive slices in rank order, so
        the union over ranks is exactly the single-process global batch, in the same order."""
        start = consumed + self.offsets()[rank]
        out = []
        for n in self.shares[rank].micro_batches:
            out.append((start, n))
            start += n
        return out

    def to_dict(self) -> dict:
        return {"global_batch": self.global_batch, "mode": self.mode, "fingerprint": self.fingerprint,
                "predicted_step_s": self.predicted_step_s, "shares": [asdict(s) for s in self.shares],
                "models": self.models, "accumulation": self.accumulation}

    @classmethod
    def from_dict(cls, d: dict) -> "BalancePlan":
        return cls(d["global_batch"], d["mode"], [RankShare(**s) for s in d["shares"]], d.get("fingerprint", ""),
                   d.get("models", []), d.get("accumulation", "sharded"))

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> "BalancePlan | None":
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return None

    def table(self, title: str = "batch balance"):
        from rich.table import Table

        t = Table(title=f"{title} ({self.mode}): global batch {self.global_batch}, "
                        f"predicted step {self.predicted_step_s * 1e3:.1f} ms")
        for col in ("rank", "host", "device", "memory", "samples/s", "micro-batch", "accum", "share",
                    "predicted"):
            t.add_column(col, justify="right" if col not in ("host", "device") else "left")
        for s in self.shares:
            t.add_row(str(s.rank), s.host, s.device, format_bytes(s.memory_gb * 2**30) if s.memory_gb else "-",
                      f"{s.samples_per_s:,.1f}", str(s.micro_batch_size), str(s.grad_accum),
                      f"{s.samples} ({s.samples / self.global_batch:.0%})", f"{s.predicted_s * 1e3:.1f} ms")
        return t


def fit_link(timed: dict[int, float], world: int) -> tuple[float, float]:
    """(seconds per collective, bytes each rank sends per second) from all-gathers timed at two or
    more sizes (bytes each rank contributes -> seconds): a line through the smallest and the largest.
    A ring all-gather sends (world - 1) times a rank's part. Where the larger one was not slower
    (too small to see the link), the link is taken as free and only the latency counts."""
    if len(timed) < 2:
        raise BalanceError("fitting a link needs all-gathers timed at two sizes at least")
    (n0, t0), (n1, t1) = min(timed.items()), max(timed.items())
    sent = (world - 1) * (n1 - n0)
    return max(t0, 0.0), (sent / (t1 - t0) if t1 > t0 and sent > 0 else math.inf)


def collective_seconds(collectives: int, bytes_sent: float, latency_s: float, bytes_per_s: float) -> float:
    """Time of `collectives` launches sending `bytes_sent` in all, one after another (an upper
    bound where the device overlaps them with compute; what decides the micro-batch count either way)."""
    return collectives * latency_s + (bytes_sent / bytes_per_s if bytes_sent else 0.0)


@dataclass
class RankInfo:
    """What a rank reports about itself for planning."""

    rank: int
    host: str
    device: str
    memory_gb: float | None
    model: TimeModel


def _models(infos: list[RankInfo]) -> list[dict]:
    """The time models a plan was solved from, kept in the plan so re-balancing can rescale them."""
    return [{"points": i.model.points, "max_micro": i.model.max_micro, "step_costs": i.model.step_costs,
             "per_micro_s": i.model.per_micro_s, "per_step_s": i.model.per_step_s} for i in infos]


def _shares(infos: list[RankInfo], counts: list[int]) -> list[RankShare]:
    out = []
    for info, n in zip(infos, counts):
        parts, t = info.model.split(n)
        out.append(RankShare(info.rank, info.host, info.device, info.memory_gb, info.model.samples_per_s(),
                             info.model.max_micro, n, parts, t))
    return out


def solve_counts(models: list[TimeModel], global_batch: int) -> list[int]:
    """Samples per rank minimising max_i cost_i(n_i) with sum n_i = global_batch."""
    counts = [0] * len(models)
    heap = [(m.cost(1), i) for i, m in enumerate(models)]
    heapq.heapify(heap)
    for _ in range(global_batch):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (models[i].cost(counts[i] + 1), i))
    for _ in range(global_batch):  # polish: move single samples off the slowest rank
        costs = [m.cost(n) for m, n in zip(models, counts)]
        worst = max(range(len(models)), key=lambda i: costs[i])
        if counts[worst] == 0:
            break
        best_j, best_max = None, costs[worst]
        for j, m in enumerate(models):
            if j == worst:
                continue
            new_max = max([models[worst].cost(counts[worst] - 1), m.cost(counts[j] + 1)]
                          + [c for k, c in enumerate(costs) if k not in (worst, j)])
            if new_max < best_max - 1e-12:
                best_j, best_max = j, new_max
        if best_j is None:
            break
        counts[worst] -= 1
        counts[best_j] += 1
    return counts


class _InCount:
    """A rank's cost when it must run exactly k micro-batches (what `solve_counts` reads)."""

    def __init__(self, model: TimeModel, k: int):
        self.model, self.k = model, k

    def cost(self, n: int) -> float:
        return self.model.cost_in(n, self.k)


def count_candidates(infos: list[RankInfo], global_batch: int, limit: int = 64) -> list[int]:
    """Micro-batch counts worth trying: from the fewest that hold the batch in the ranks' memory
    to one sample per micro-batch on an even share, thinned to `limit` values."""
    lo = max(1, math.ceil(global_batch / sum(i.model.max_micro for i in infos)))
    hi = max(lo, math.ceil(global_batch / len(infos)))
    return _thinned(lo, hi, hi, limit)


def balanced_plan(infos: list[RankInfo], global_batch: int, equal_counts: bool = False) -> BalancePlan:
    """Samples per rank minimising the step time. With `equal_counts` (FSDP: every micro-batch is
    a collective) every rank runs the same number k of micro-batches, of unequal sizes: k is
    chosen with the counts, the fastest step over the candidates."""
    if not equal_counts:
        counts = solve_counts([i.model for i in infos], global_batch)
        return BalancePlan(global_batch, "balanced", _shares(infos, counts), models=_models(infos))
    best = None
    for k in count_candidates(infos, global_batch):
        costs = [_InCount(i.model, k) for i in infos]
        counts = solve_counts(costs, global_batch)
        t = max(c.cost(n) for c, n in zip(costs, counts))
        if best is None or t < best[0] - 1e-15:
            best = (t, k, counts)
    _, k, counts = best
    return BalancePlan(global_batch, "balanced", _shares_in(infos, counts, k), models=_models(infos))


def _shares_in(infos: list[RankInfo], counts: list[int], k: int) -> list[RankShare]:
    out = []
    for info, n in zip(infos, counts):
        parts, t = info.model.split_in(n, k)
        if math.isinf(t):
            raise BalanceError(f"rank {info.rank} ({info.device}) cannot hold {n} samples in {k} micro-batches "
                               f"of at most {info.model.max_micro}")
        out.append(RankShare(info.rank, info.host, info.device, info.memory_gb, info.model.samples_per_s(),
                             info.model.max_micro, n, parts, t))
    return out


def equal_counts(plan: BalancePlan, infos: list[RankInfo]) -> BalancePlan:
    """The same shares, each split into one number k of micro-batches, for a strategy whose every
    micro-batch is a collective (an equal or fixed plan under FSDP): the k whose slowest rank is
    fastest. Not the count the busiest rank would pick for itself: a rank that prefers 48 micro-
    batches of 1 would force them on a rank whose best is 3 of 16."""
    counts = [s.samples for s in plan.shares]
    if len({s.grad_accum for s in plan.shares if s.samples}) <= 1 and all(s.grad_accum for s in plan.shares):
        return plan
    lo = max(max(math.ceil(n / max(i.model.max_micro, 1)) for i, n in zip(infos, counts)), 1)
    hi = max(lo, max(counts))
    best = None
    for k in _thinned(lo, hi, max(counts)):
        t = max(i.model.cost_in(n, k) for i, n in zip(infos, counts))
        if best is None or t < best[0] - 1e-15:
            best = (t, k)
    plan.shares = _shares_in(infos, counts, best[1])
    return plan


def _thinned(lo: int, hi: int, n: int, limit: int = 64) -> list[int]:
    """Counts from lo to hi worth trying for n samples: those that change the micro-batch size
    (n / k rounded up), thinned to `limit` values, the ends kept."""
    ks = sorted(k for k in {lo, hi} | {math.ceil(n / b) for b in range(1, n + 1)} if lo <= k <= hi)
    if len(ks) > limit:
        step = len(ks) / limit
        ks = sorted({ks[int(i * step)] for i in range(limit)} | {ks[-1]})
    return ks


def equal_plan(infos: list[RankInfo], global_batch: int) -> BalancePlan:
    """HetSeq's default: the same share for every rank, whatever its speed (within memory)."""
    w = len(infos)
    counts = [global_batch // w + (1 if r < global_batch % w else 0) for r in range(w)]
    return BalancePlan(global_batch, "equal", _shares(infos, counts),
                       models=_models(infos))


def fixed_plan(infos: list[RankInfo], global_batch: int, assignments: list[tuple[int, int]]) -> BalancePlan:
    """User-set (samples, micro_batch_size) per rank, checked against the batch and memory."""
    if len(assignments) != len(infos):
        raise BalanceError(f"cluster.assignments has {len(assignments)} entries for {len(infos)} ranks")
    total = sum(n for n, _ in assignments)
    if total != global_batch:
        raise BalanceError(f"cluster.assignments sum to {total} samples but the global batch is {global_batch}")
    shares = []
    for info, (n, b) in zip(infos, assignments):
        if b > info.model.max_micro:
            raise BalanceError(
                f"cluster.assignments[{info.rank}]: micro-batch {b} exceeds what rank {info.rank} "
                f"({info.device}, {info.memory_gb or '?'} GB) fits in memory: at most {info.model.max_micro}"
            )
        a = math.ceil(n / b) if n else 0
        parts = [b] * (a - 1) + [n - b * (a - 1)] if a else []
        shares.append(RankShare(info.rank, info.host, info.device, info.memory_gb, info.model.samples_per_s(),
                                info.model.max_micro, n, parts,
                                sum(info.model(p) for p in parts) + len(parts) * info.model.per_micro_s
                                + info.model.per_step_s))
    return BalancePlan(global_batch, "fixed", shares,
                       models=_models(infos))


def choose_accumulation(sharded: BalancePlan | None, unsharded: BalancePlan | None,
                        setting: str) -> tuple[BalancePlan, str]:
    """FSDP2's accumulation for a run (`model.accounting.ACCUMULATIONS`), from the two balances
    solved on the same probes: `unsharded` is None where some rank's memory cannot hold full weights
    and gradients (`sharded` is None only when unsharded is configured). auto takes unsharded only
    when it prices the step faster: it frees each rank to run the micro-batch count that suits its
    speed and pays the collectives once a step, for ZeRO-1's memory during the step. Returns the
    plan, marked, and why in one line."""
    if setting == "unsharded":
        if unsharded is None:
            raise BalanceError("parallel.accumulation=unsharded: some rank cannot hold the full weights and "
                               "gradients with a micro-batch of one; use accumulation: sharded (or auto)")
        unsharded.accumulation = "unsharded"
        return unsharded, "gradients accumulated unsharded, reduced once a step (as configured)"
    if sharded is None:
        raise BalanceError("no sharded balance to choose from")
    sharded.accumulation = "sharded"
    if setting == "sharded" or unsharded is None:
        why = "as configured" if setting == "sharded" else "full weights and gradients do not fit every rank"
        return sharded, f"gradients reduce-scattered every micro-batch ({why})"
    a, u = sharded.predicted_step_s, unsharded.predicted_step_s
    if u < a:
        unsharded.accumulation = "unsharded"
        return unsharded, (f"auto: gradients accumulated unsharded, reduced once a step: predicted "
                           f"{u * 1e3:.0f} ms against {a * 1e3:.0f} ms reducing every micro-batch")
    return sharded, (f"auto: gradients reduce-scattered every micro-batch: predicted {a * 1e3:.0f} ms against "
                     f"{u * 1e3:.0f} ms accumulating unsharded")


class DriftMonitor:
    """Watches each rank's measured compute time per step against the plan's prediction. When some
    rank is off by more than `threshold` (relative to the median rank) for `window` consecutive
    steps, it rescales that rank's time model by what was observed and solves again. The global
    batch never changes; every rank sees the same gathered times, so all reach the same new plan."""

    def __init__(self, plan: BalancePlan, threshold: float, window: int, warmup_steps: int = 2):
        self.plan, self.threshold, self.window, self.warmup = plan, threshold, window, warmup_steps
        self.strikes, self.seen = 0, 0
        self.models = [TimeModel(m["points"], m["max_micro"], m.get("step_costs", []), m.get("per_micro_s", 0.0),
                                 m.get("per_step_s", 0.0))
                       for m in plan.models]

    def observe(self, compute_s: list[float]) -> BalancePlan | None:
        self.seen += 1
        if self.seen <= self.warmup or len(self.models) != len(compute_s):
            return None
        ratios = {s.rank: compute_s[s.rank] / s.predicted_s for s in self.plan.shares
                  if s.samples > 0 and s.predicted_s > 0}
        if len(ratios) < 2:
            return None
        med = statistics.median(ratios.values())
        drift = max(abs(r / med - 1.0) for r in ratios.values())
        self.strikes = self.strikes + 1 if drift > self.threshold else 0
        if self.strikes < self.window:
            return None
        self.models = [m.scaled(ratios.get(i, med)) for i, m in enumerate(self.models)]
        infos = [RankInfo(s.rank, s.host, s.device, s.memory_gb, m) for s, m in zip(self.plan.shares, self.models)]
        new = balanced_plan(infos, self.plan.global_batch)
        new.fingerprint, new.mode = self.plan.fingerprint, "rebalanced"
        self.plan, self.strikes, self.seen = new, 0, 0
        return new
