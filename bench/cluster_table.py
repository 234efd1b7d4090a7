"""The cluster table (docs/sharded_clusters.md): FORGE-s, FORGE-m and FORGE-l on the clusters a lab
would ask about, as `hetforge plan --cluster` plans them (no GPU, no profile: seconds to run).

Per cluster and preset at seq 2048, a global batch of 512 sequences and micro-batches of at most 2:
the run's plan (`cluster.run_plan` on declared facts: each card's bytes from the model's shapes,
its times from its datasheet, `memory.analytic`) with every block recomputed where memory needs it
(`memory.strategy: full`: the least activation memory a plan holds, decided without a search), the
links at 10 GB/s. The table shows the strategy `parallel.strategy: auto` takes (FSDP with its
shards on the host where no sharding alone fits), the busiest card's predicted peak against its
usable memory, and the predicted tokens/s; or why nothing fits.

    .venv/bin/python bench/cluster_table.py   # writes docs/sharded_clusters.md

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.cluster.facts import declared_facts  # noqa: E402
from hetforge.cluster.run_plan import resolve_plan  # noqa: E402
from hetforge.config import NodeSpec, build_config  # noqa: E402
from hetforge.core.errors import HetforgeError  # noqa: E402
from hetforge.model.accounting import count_parameters  # noqa: E402
from hetforge.model.presets import PRESETS  # noqa: E402

SEQ, GLOBAL_BATCH, MICRO, LINK_GBPS = 2048, 512, 2, 10.0
CLUSTERS = {
    "8x V100-16GB": [("V100", 8)],
    "4x V100-16GB + 4x P100-16GB": [("V100", 4), ("P100", 4)],
    "16x T4": [("T4", 16)],
    "4x A100-40GB": [("A100-40GB", 4)],
    "2x V100-32GB + 2x V100-16GB": [("V100-32GB", 2), ("V100", 2)],
}


def row(cluster: str, preset: str) -> dict:
    shape = PRESETS[preset]
    cfg = build_config({"model": {"preset": preset}, "memory": {"budget": "auto", "strategy": "full"},
                        "train": {"seq_len": SEQ, "micro_batch_size": MICRO, "global_batch_tokens": GLOBAL_BATCH * SEQ,
                                  "precision": "auto", "optimizer": "adamw"},
                        "parallel": {"link_gbps": LINK_GBPS}})
    nodes = [NodeSpec.model_validate({"host": "node", "devices": [{"type": t, "count": n} for t, n in CLUSTERS[cluster]]})]
    out = {"cluster": cluster, "preset": preset, "params_b": count_parameters(shape)["total"] / 1e9}
    try:
        plan = resolve_plan(cfg, shape, declared_facts(cfg, shape, nodes, cluster))
    except HetforgeError as err:
        return {**out, "fits": False, "why": " ".join(str(err).split())}
    busiest = max(plan.ranks, key=lambda r: (r.predicted_peak_bytes or 0) / r.memory_bytes)
    return {**out, "fits": True, "precision": plan.precision, "strategy": plan.strategy,
            "optimizer_offload": any(r.optimizer_offload for r in plan.ranks), "offload": plan.offload,
            "peak_gib": busiest.predicted_peak_bytes / 2**30, "usable_gib": busiest.memory_bytes / 2**30,
            "step_s": plan.predicted_step_s, "tokens_per_s": GLOBAL_BATCH * SEQ / plan.predicted_step_s,
            "bound": max(plan.step_parts, key=plan.step_parts.get)}


def main() -> None:
    rows = [row(c, p) for c in CLUSTERS for p in ("forge-s", "forge-m", "forge-l")]
    lines = [
        "# FORGE presets on lab clusters (seq 2048, planned from shapes and datasheets)", "",
        "Written by `bench/cluster_table.py` (see its docstring): the plan `hetforge plan --cluster` makes for "
        f"each cluster and preset at a global batch of {GLOBAL_BATCH} x {SEQ} tokens, micro-batches of at most "
        f"{MICRO}, every block recomputed where memory needs it, links at {LINK_GBPS:g} GB/s: the strategy "
        "`parallel.strategy: auto` takes, the busiest card's predicted peak against its usable memory, and the "
        "predicted tokens/s.", "",
        "| cluster | preset | params | precision | strategy | peak / usable (GiB) | bound | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['cluster']} | {r['preset']} | {r['params_b']:.1f}B | - | does not fit "
                         f"({r['why'].split(':')[0]}) | - | - | - |")
            continue
        strategy = r["strategy"] + (" + optimizer on the host" if r["optimizer_offload"] else "") + \
            (" + shards on the host" if r["offload"] == "params" else "")
        lines.append(f"| {r['cluster']} | {r['preset']} | {r['params_b']:.1f}B | {r['precision']} | {strategy} | "
                     f"{r['peak_gib']:.1f} / {r['usable_gib']:.1f} | {r['bound']} | {r['tokens_per_s']:,.0f} |")
    lines += ["", "\"Shards on the host\": FSDP2's CPU offload (`parallel.offload: params`), which `auto` takes where "
              "no sharding alone fits; the host's AdamW step and the copies over PCIe are in the step time. Where "
              "nothing fits, the sizes need more cards.", ""]
    out = ROOT / "docs" / "sharded_clusters.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    record({"bench": "cluster_table", "out": "docs/sharded_clusters.md", "rows": len(rows),
            "fit": sum(r["fits"] for r in rows),
            **{f"{r['cluster']} {r['preset']} tokens_per_s": round(r["tokens_per_s"]) for r in rows if r["fits"]}})


if __name__ == "__main__":
    main()
