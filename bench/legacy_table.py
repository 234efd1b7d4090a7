"""The legacy-GPU table (docs/legacy_gpus.md): what each preset needs on each common card at seq 2048.

For every card of the device table and every preset from 125M to forge-l, from the analytic model
(`hetforge.memory.analytic`: bytes from the model's shapes, times from the card's datasheet; no GPU
and no profile needed): the run's precision on that card, the attention kernel PyTorch would use,
whether micro-batch 1 fits and how (keep everything, an activation plan, the optimizer's state on
the host), the largest micro-batch up to 16 that fits, the plan there and its predicted samples per
second.

    .venv/bin/python bench/legacy_table.py                       # docs/legacy_gpus.md
    .venv/bin/python bench/legacy_table.py --presets 125m,350m --cards V100,T4

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.core.hardware import DEVICES, lookup  # noqa: E402
from hetforge.config import MemoryConfig  # noqa: E402
from hetforge.memory.analytic import (BANDWIDTH_EFFICIENCY, EFFICIENCY, analytic_profile, block_summary,  # noqa: E402
                                      usable_bytes)
from hetforge.memory.device_plan import plan_profile  # noqa: E402
from hetforge.memory.milp import PlanError  # noqa: E402
from hetforge.model.accounting import static_bytes  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoXConfig  # noqa: E402
from hetforge.model.presets import PRESETS  # noqa: E402

SEQ = 2048
MICRO = (1, 2, 4, 8, 16)
NOT_BUILT = {"K80": "compute capability 3.7: current PyTorch CUDA builds need 5.0 or newer"}


def gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def entry(cfg: GPTNeoXConfig, card, mem: MemoryConfig) -> dict:
    budget = usable_bytes(card)
    out = {"card": card.name, "usable_gib": budget / 2**30,
           "static_gib": sum(static_bytes(cfg).values()) / 2**30}
    fits = {}
    for mb in MICRO:
        prof = analytic_profile(cfg, mb, SEQ, card)
        out["precision"], out["attention"] = prof.meta["precision"], prof.meta["attention"]
        try:
            dp = plan_profile(prof, cfg, mem, mb, budget, compiled=True)  # a GPU run compiles its blocks
        except PlanError:
            break
        keep = dp.keep_all.peak_bytes <= budget and not dp.optimizer_offload
        how = "keep all" if keep else ("optimizer on host, " if dp.optimizer_offload else "") + \
            block_summary(prof, dp.plan.options)
        step = dp.prediction.time_s + dp.offload_s
        fits[mb] = {"how": how, "samples_per_s": mb / step, "peak_gib": dp.prediction.peak_bytes / 2**30,
                    "optimizer_offload": dp.optimizer_offload}
    out["fits"] = fits
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="125m,350m,forge-s,forge-m,forge-l")
    ap.add_argument("--seconds", type=float, default=20.0, help="HiGHS time limit per plan")
    ap.add_argument("--cards", default=",".join(d.name for d in DEVICES))
    ap.add_argument("--out", default=str(ROOT / "docs" / "legacy_gpus.md"))
    args = ap.parse_args()
    mem = MemoryConfig(granularity="tensor", time_limit_s=args.seconds)
    rows = []
    lines = [
        "# What each preset needs on the GPUs labs own (seq 2048)",
        "",
        "Written by `bench/legacy_table.py` from hetforge's analytic model (`hetforge/memory/analytic.py`): each",
        "preset's real block and head traced at micro-batch x 2048 tokens on fake tensors (bytes from shapes),",
        f"times on a roofline of the card's datasheet (matmuls at {EFFICIENCY:.0%} of its peak, other ops at",
        f"{BANDWIDTH_EFFICIENCY:.0%} of its memory bandwidth), the usable memory 95% of the card's",
        "less 0.75 GiB (CUDA context, workspaces), AdamW (8 bytes a parameter of state). The plan is hetforge's",
        "MILP at per-tensor granularity; the optimizer's state goes to the host only where nothing fits",
        "otherwise. `hetforge plan CONFIG --card NAME --micro-batch N --budget auto` prints one cell's full plan, and",
        "`bench/gpu_check.sh` checks the model against a measured profile when a GPU is lent.",
        "",
        "Attention: `flash` and `mem-efficient` keep O(sequence) per head; `math` (no kernel for that card,",
        "dtype or head size) keeps the sequence x sequence attention probabilities of every layer for the",
        "backward. FORGE-s's head size 86 is not a multiple of 8: it runs padded to 88 with zero channels",
        "(`model.pad_head_dim: auto`, exact), which is what lets a fused kernel take it; with",
        "`pad_head_dim: off` every card above falls back to `math` for FORGE-s (`hetforge plan --card`).",
        "",
        f"Presets in this table: {', '.join(args.presets.split(','))}.",
        "",
        "| card | preset | precision | attention | weights+grads+Adam / usable (GiB) | micro-batch 1 | largest micro-batch (<=16): plan | samples/s there |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset in args.presets.split(","):
        cfg = PRESETS[preset]
        for name in args.cards.split(","):
            card = lookup(name)
            if card.name in NOT_BUILT:
                lines.append(f"| {card.name} | {preset} | - | - | - | not run: {NOT_BUILT[card.name]} | - | - |")
                continue
            e = entry(cfg, card, mem)
            rows.append({"preset": preset, **e})
            fits = e["fits"]
            one = fits.get(1)
            first = one["how"] if one else "does not fit, even with the optimizer on the host"
            if fits:
                top = max(fits)
                last = f"{top}: {fits[top]['how']}"
                speed = f"{fits[top]['samples_per_s']:.2f}"
            else:
                last, speed = "-", "-"
            lines.append(f"| {card.name} | {preset} | {e['precision']} | {e['attention']} | "
                         f"{gib(e['static_gib'] * 2**30)} / {gib(e['usable_gib'] * 2**30)} | {first} | {last} | {speed} |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    record({"bench": "legacy_table", "rows": len(rows), "out": str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out),
            "fits_at_1": sum(1 for r in rows if 1 in r["fits"])})


if __name__ == "__main__":
    main()
