"""The cluster table (docs/sharded_clusters.md): FORGE-s, FORGE-m and FORGE-l on the clusters a lab
would ask about, predicted analytically (no GPU, no profile: seconds to run).

Per cluster and preset at seq 2048, micro-batch 1: the strategy `parallel.strategy: auto` would
take (`memory.sharding.choose_strategy`: the least sharding under which every card holds its
shards and gathered units, `model.accounting.sharded_static_bytes`, beside the activation floor
of a full-recompute plan), each card's bytes under it, and the predicted tokens/s: the global
batch's model FLOPs (`model.accounting.flops_per_token`, plus a forward's third for the
recomputation) at 45% of each card's datasheet peak in the run's precision (`memory.analytic`'s
EFFICIENCY), balanced over the cards, or the collectives (`collective_bytes_per_step`) at the
link, whichever is longer. The activation floor per sample is every block's input kept (2 bytes
x seq x d per layer) plus one block's whole (34 x seq x d bytes with a fused attention kernel,
Korthikanti et al. 2022, table 2) plus the logits (4 bytes x seq x vocab, twice). `hetforge plan
--cluster` makes the full per-tensor plan for one row from measured block profiles.

    .venv/bin/python bench/cluster_table.py   # writes docs/sharded_clusters.md

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetforge.core.hardware import lookup  # noqa: E402
from hetforge.memory.analytic import EFFICIENCY, card_precision, usable_bytes  # noqa: E402
from hetforge.memory.sharding import NoStrategyFits, RankNeed, choose_strategy  # noqa: E402
from hetforge.model.accounting import (  # noqa: E402
    collective_bytes_per_step,
    count_parameters,
    flops_per_token,
    parameter_sizes,
    sharded_static_bytes,
    state_shares,
)
from hetforge.model.presets import PRESETS  # noqa: E402

SEQ = 2048
GLOBAL_BATCH = 512  # sequences per step (1M tokens at 2048, FORGE's order of magnitude)
LINK_GBPS = {"intra": 10.0}  # GB/s per rank on the ring: PCIe 3 peer-to-peer; NVLink cards are faster
CLUSTERS = {
    "8x V100-16GB": ["V100"] * 8,
    "4x V100-16GB + 4x P100-16GB": ["V100"] * 4 + ["P100"] * 4,
    "16x T4": ["T4"] * 16,
    "4x A100-40GB": ["A100-40GB"] * 4,
    "2x V100-32GB + 2x V100-16GB": ["V100-32GB"] * 2 + ["V100"] * 2,
}


def activation_floor(shape) -> float:
    s, d = SEQ, shape.d_model
    return 2 * s * d * shape.n_layers + 34 * s * d + 2 * 4 * s * shape.vocab_size


def row(cluster: str, preset: str) -> dict:
    shape = PRESETS[preset]
    cards = [lookup(c) for c in CLUSTERS[cluster]]
    precision = min((card_precision(c) for c in cards), key=["fp32", "fp16", "bf16"].index)
    gather = 4 if precision == "fp32" else 2
    needs = [RankNeed(r, c.name, usable_bytes(c), activation_floor(shape)) for r, c in enumerate(cards)]
    out = {"cluster": cluster, "preset": preset, "params_b": count_parameters(shape)["total"] / 1e9,
           "precision": precision}
    budgets = [n.budget for n in needs]
    # ZeRO-1 splits the optimizer state in proportion to memory where the cards differ (FSDP2 evenly)
    shares = state_shares(parameter_sizes(shape), budgets) if len(set(budgets)) > 1 else None
    try:
        strategy, why = choose_strategy(shape, "adamw", needs, len(cards), gather, state_shares=shares)
    except NoStrategyFits:
        fsdp = sum(sharded_static_bytes(shape, "adamw", "fsdp", len(cards), gather_bytes=gather).values())
        out.update(strategy=None, fits=False, per_rank_gib=fsdp / 2**30,
                   usable_gib=min(n.budget for n in needs) / 2**30, tokens_per_s=0.0)
        return out
    # the bytes on the smallest card (the first of them)
    small = min(range(len(cards)), key=lambda r: budgets[r])
    share = shares[small] if shares and strategy == "zero1" else None
    static = sum(sharded_static_bytes(shape, "adamw", strategy, len(cards) if strategy != "ddp" else 1,
                                      gather_bytes=gather, state_share=share).values())
    out["state_shares"] = shares if strategy == "zero1" else None
    if shares:  # what equal parts would have taken
        try:
            out["strategy_equal_shares"] = choose_strategy(shape, "adamw", needs, len(cards), gather)[0]
        except NoStrategyFits:
            out["strategy_equal_shares"] = None
    flops = flops_per_token(shape, SEQ) * (1 + 1 / 3)  # full recomputation repeats the forward
    rate = sum(c.peak_tflops(precision) * 1e12 * EFFICIENCY for c in cards) / flops  # tokens/s, balanced
    compute_s = GLOBAL_BATCH * SEQ / rate
    micro = GLOBAL_BATCH // len(cards)
    comm_s = collective_bytes_per_step(shape, strategy, len(cards), micro, gather) / (LINK_GBPS["intra"] * 1e9)
    step = max(compute_s, comm_s)
    out.update(strategy=strategy, fits=True, per_rank_gib=(static + activation_floor(shape)) / 2**30,
               usable_gib=min(n.budget for n in needs) / 2**30, compute_s=compute_s, comm_s=comm_s,
               tokens_per_s=GLOBAL_BATCH * SEQ / step, bound="compute" if compute_s >= comm_s else "collectives")
    return out


def main() -> None:
    rows = [row(c, p) for c in CLUSTERS for p in ("forge-s", "forge-m", "forge-l")]
    lines = [
        "# FORGE presets on lab clusters (seq 2048, analytic)",
        "",
        "Written by `bench/cluster_table.py` (see its docstring for the model): what `parallel.strategy: auto` "
        "takes on each cluster, the bytes per card under it (shards, gathered units and a full-recompute "
        f"activation floor at micro-batch 1) against the smallest card's usable memory, and the predicted "
        f"tokens/s at a global batch of {GLOBAL_BATCH} x {SEQ} tokens: the FLOPs (with recomputation) at "
        f"{EFFICIENCY:.0%} of the datasheet peak, or the collectives at {LINK_GBPS['intra']:g} GB/s per rank, "
        "whichever is longer. Per card: the smallest card's bytes. Where the cards' memory differs, ZeRO-1 "
        "gives each card a share of the optimizer state in proportion to its memory (`parallel.state_shares: "
        "memory`); FSDP2's shards are even (1/W).",
        "",
        "| cluster | preset | params | precision | strategy | per card / usable (GiB) | bound | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['cluster']} | {r['preset']} | {r['params_b']:.1f}B | {r['precision']} | does not fit "
                         f"(FSDP needs {r['per_rank_gib']:.1f} before activations) | - / {r['usable_gib']:.1f} | - | - |")
            continue
        lines.append(f"| {r['cluster']} | {r['preset']} | {r['params_b']:.1f}B | {r['precision']} | {r['strategy']} | "
                     f"{r['per_rank_gib']:.1f} / {r['usable_gib']:.1f} | {r['bound']} | {r['tokens_per_s']:,.0f} |")
    for r in rows:
        if r.get("state_shares") and r.get("strategy_equal_shares") != r["strategy"]:
            lines += ["", f"On {r['cluster']}, {r['preset']} takes zero1 because each card holds optimizer state in "
                      f"proportion to its memory ({', '.join(f'{x:.0%}' for x in r['state_shares'])}); with equal "
                      f"parts the smallest cards could not hold theirs beside the weights and gradients, and "
                      f"auto would take {r['strategy_equal_shares'] or 'nothing'}."]
    lines += ["", "FORGE-m and FORGE-l need more cards than these clusters have, or `parallel.offload: params` "
              "(FSDP2's CPU offload: weights, gradients and optimizer shards in host memory, the step on the host), "
              "which this table does not price.", ""]
    out = ROOT / "docs" / "sharded_clusters.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(json.dumps({"bench": "cluster_table", "rows": rows}))


if __name__ == "__main__":
    main()
