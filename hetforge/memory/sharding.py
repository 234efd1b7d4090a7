"""Which data-parallel strategy a run needs: a pure function of each rank's memory and measured
activation bytes (`parallel.strategy: auto`).

The strategies are tried from the least sharding to the most (ddp, zero1, zero2, fsdp; see
`model.accounting.sharded_static_bytes` for what each keeps per rank): the first under which every
rank's weights, gradients, optimizer state and gathered buffers, plus its activations at micro-
batch 1, fit its memory is taken. Less sharding means less communication per step (ZeRO-1 sends
what DDP does plus one all-gather of the weights; FSDP gathers every unit twice per micro-batch),
so the least that fits is the fastest that fits. With an activation plan the activations counted
are the plan's floor (each block's input kept, one block's whole); the planner then solves the
real plan under the chosen strategy's static bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetforge.model.accounting import MIN_UNIT_PARAMS, STRATEGIES, sharded_static_bytes
from hetforge.model.gpt_neox import GPTNeoXConfig


@dataclass
class RankNeed:
    rank: int
    device: str
    budget: float | None  # bytes the rank may use; None: not known (nothing to fit)
    activation_bytes: float  # at micro-batch 1, workspace margin included


class NoStrategyFits(ValueError):
    pass


def strategy_needs(shape: GPTNeoXConfig, optimizer: str, needs: list[RankNeed], strategy: str, shard_size: int,
                   gather_bytes: int, offload: str = "none", unit_params: int = MIN_UNIT_PARAMS,
                   state_shares: list[float] | None = None) -> list[float]:
    """Each rank's bytes under `strategy`; `state_shares`: the ranks' fractions of the optimizer
    state under zero1 by memory (`model.accounting.state_shares`), in the order of `needs`."""
    def static(i: int) -> float:
        share = state_shares[i] if state_shares is not None and strategy == "zero1" else None
        return sum(sharded_static_bytes(shape, optimizer, strategy, shard_size, offload, gather_bytes,
                                        unit_params, share).values())
    return [static(i) + n.activation_bytes for i, n in enumerate(needs)]


HOST_OPTIMIZER = "ddp+host-optimizer"
HOST_PARAMS = "fsdp+host-params"  # FSDP2's CPU offload: weight, gradient and state shards on the host


def choose_strategy(shape: GPTNeoXConfig, optimizer: str, needs: list[RankNeed], shard_size: int,
                    gather_bytes: int = 4, offload: str = "none", unit_params: int = MIN_UNIT_PARAMS,
                    state_shares: list[float] | None = None) -> tuple[str, str]:
    """(strategy, why in one line): the least sharding under which every rank fits; where none does
    and `offload` is "none", HOST_PARAMS if FSDP with its shards on the host fits. Raises
    NoStrategyFits naming the rank short of memory. `state_shares`: zero1's optimizer state split by memory (None: evenly)."""
    if len(needs) <= 1:
        return "ddp", "one rank: nothing to shard"
    if all(n.budget is None for n in needs):
        return "ddp", "no rank's memory is declared or known: every rank holds a full replica"
    tried = []
    for strategy in STRATEGIES:
        if offload == "params" and strategy in ("ddp", "zero1"):
            continue
        if offload == "optimizer" and strategy != "ddp":
            continue
        totals = strategy_needs(shape, optimizer, needs, strategy, shard_size, gather_bytes, offload, unit_params,
                                state_shares)
        short = _short(needs, totals)
        if not short:
            worst = max(((t / n.budget, n, t) for n, t in zip(needs, totals) if n.budget is not None),
                        key=lambda w: w[0])
            why = f"auto: {strategy}" + (f" ({'; '.join(tried)})" if tried else "") + \
                  f"; the fullest rank {worst[1].rank} ({worst[1].device}) needs {_gib(worst[2])} of {_gib(worst[1].budget)}"
            return strategy, why
        n, t = max(short, key=lambda nt: nt[1] - nt[0].budget)
        tried.append(f"{strategy} needs {_gib(t)} on rank {n.rank} ({n.device}) with {_gib(n.budget)}")
    if offload == "none":  # the last resort: FSDP with every shard on the host
        totals = strategy_needs(shape, optimizer, needs, "fsdp", shard_size, gather_bytes, "params", unit_params)
        short = _short(needs, totals)
        if not short:
            return HOST_PARAMS, f"auto: fsdp with its shards on the host ({'; '.join(tried)})"
        n, t = max(short, key=lambda nt: nt[1] - nt[0].budget)
        tried.append(f"{HOST_PARAMS} needs {_gib(t)} on rank {n.rank} ({n.device}) with {_gib(n.budget)}")
    raise NoStrategyFits("no data-parallel strategy fits: " + "; ".join(tried) +
                         "; add ranks, an activation plan (memory.budget: auto), or a smaller model")


def unit_size_that_fits(shape: GPTNeoXConfig, optimizer: str, needs: list[RankNeed], strategy: str, shard_size: int,
                        gather_bytes: int, offload: str = "none",
                        unit_params: int = MIN_UNIT_PARAMS) -> tuple[int, str | None]:
    """FSDP's unit floor for a run whose ranks' memory is known: `unit_params` (small blocks grouped:
    fewer, larger collectives), unless some rank is short of memory under it and every rank fits
    with one block a unit, whose gathered weights and gradients are a group's smaller. Returns the
    floor, and why it changed (None when it did not)."""
    if strategy not in ("zero2", "fsdp") or unit_params <= 1 or all(n.budget is None for n in needs):
        return unit_params, None

    def short(units: int) -> list[tuple[RankNeed, float]]:
        return _short(needs, strategy_needs(shape, optimizer, needs, strategy, shard_size, gather_bytes, offload, units))

    grouped = short(unit_params)
    if not grouped or short(1):
        return unit_params, None
    n, t = max(grouped, key=lambda nt: nt[1] - nt[0].budget)
    return 1, (f"FSDP units: one block each (rank {n.rank} ({n.device}) needs {_gib(t)} of {_gib(n.budget)} with "
               f"blocks grouped to {unit_params / 1e6:.1f}M parameters a unit: their gathered weights and "
               f"gradients no longer fit; parallel.unit_params sets it)")


def _short(needs: list[RankNeed], totals: list[float]) -> list[tuple[RankNeed, float]]:
    """The ranks whose bytes exceed their known memory, with those bytes."""
    return [(n, t) for n, t in zip(needs, totals) if n.budget is not None and t > n.budget]


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def pick_strategy(fits: list[dict[str, bool]], devices: list[str]) -> tuple[str, str]:
    """(strategy, why) from each rank's planner verdicts (strategy -> a plan fits at micro-batch 1):
    the first of the order every rank can take; DDP with the optimizer on the host only where no
    sharding fits (its copies and host step cost every step), then FSDP with its shards on the host
    (HOST_PARAMS). Raises NoStrategyFits."""
    order = [s for s in (*STRATEGIES, HOST_OPTIMIZER, HOST_PARAMS) if all(s in f for f in fits)]
    tried = []
    for s in order:
        short = [r for r, f in enumerate(fits) if not f[s]]
        if not short:
            pick = "ddp" if s == HOST_OPTIMIZER else s
            return pick, f"auto: {s}" + (f" ({'; '.join(tried)})" if tried else "") + ": every rank has a memory plan"
        tried.append(f"{s} has no plan on rank {short[0]} ({devices[short[0]]})")
    raise NoStrategyFits("no data-parallel strategy fits: " + "; ".join(tried) +
                         "; add ranks, or use a smaller model or micro-batch")
