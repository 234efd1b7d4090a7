"""Showing a plan: the decisions, where the memory and the time go, the baselines beside it, and a
picture of memory over the step."""

from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.core.sizes import format_bytes
from hetforge.memory.plan import ModelProfile, Plan, Prediction, simulate
from hetforge.memory.units import DESCRIPTIONS


def decisions_table(plan: Plan, profile: ModelProfile) -> Table:
    t = Table(title=f"plan ({plan.strategy}): decision per block")
    for col in ("blocks", "decision", "held on device", "to host", "recompute ms"):
        t.add_column(col, justify="right" if col != "decision" else "left")
    if plan.segments:
        for s, e in plan.segments:
            t.add_row(f"{s}-{e - 1}", "checkpointed segment", format_bytes(profile.blocks[s].input_bytes), "0 B",
                      f"{sum(profile.blocks[i].fwd_s for i in range(s, e)) * 1e3:.2f}")
        return t
    i, n = 0, len(plan.options)
    while i < n:
        j = i
        while j + 1 < n and plan.options[j + 1] == plan.options[i]:
            j += 1
        c = profile.blocks[i].cost(plan.options[i])
        t.add_row(f"{i}" if i == j else f"{i}-{j}", escape(plan.options[i]), format_bytes(c.held), format_bytes(c.host),
                  f"{c.recompute_s * 1e3:.2f}")
        i = j + 1
    return t


def tensors_table(profile: ModelProfile) -> Table:
    t = Table(title="saved tensors of one block (keep-all), from the saved-tensor hooks")
    for col in ("unit", "shape", "dtype", "storage bytes"):
        t.add_column(col)
    for r in profile.blocks[0].tensors:
        t.add_row(r["unit"], "x".join(map(str, r["shape"])), r["dtype"], format_bytes(r["bytes"]))
    return t


def units_table(profile: ModelProfile) -> Table:
    """What a tensor-level plan decides on, per block: saved units (keep, offload, or rebuild from
    another unit) and op units (cache or recompute, in a recomputed branch)."""
    t = Table(title="units of one block: saved (keep / offload / rebuild) and op outputs (cache / recompute)")
    for col in ("unit", "kind", "what", "device bytes", "host bytes", "recompute ms", "rebuilt from"):
        t.add_column(col, justify="left" if col in ("unit", "kind", "what", "rebuilt from") else "right")
    for u in profile.blocks[0].units:
        t.add_row(u.name, u.kind, DESCRIPTIONS.get(u.name, ""), format_bytes(u.bytes),
                  format_bytes(u.host_bytes) if u.kind != "op" else "",
                  f"{u.time_s * 1e3:.3f}" if u.kind == "op" or u.rebuild_from else "",
                  f"{u.rebuild_from} (frees {format_bytes(u.rebuild_bytes)})" if u.rebuild_from else "")
    return t


def breakdown_table(pred: Prediction, budget: float | None) -> Table:
    t = Table(title="predicted peak memory and step time")
    t.add_column("memory at the peak stage")
    t.add_column("bytes", justify="right")
    t.add_column("step time")
    t.add_column("ms", justify="right")
    mem = list(pred.breakdown_memory.items()) + [("peak", pred.peak_bytes)]
    if budget is not None:
        mem.append(("budget", budget))
    tim = list(pred.breakdown_time.items()) + [("total", pred.time_s)]
    for k in range(max(len(mem), len(tim))):
        a = mem[k] if k < len(mem) else ("", None)
        b = tim[k] if k < len(tim) else ("", None)
        t.add_row(a[0], format_bytes(a[1]) if a[1] is not None else "", b[0], f"{b[1] * 1e3:.2f}" if b[1] is not None else "")
    return t


def baselines_table(profile: ModelProfile, chosen: Plan, others: dict[str, Plan | None]) -> Table:
    keep = simulate(profile, Plan(["keep"] * len(profile.blocks)))
    t = Table(title="the same profile under each strategy (fits = within the budget)")
    for col in ("strategy", "peak", "activations vs keep-all", "step time ms", "vs keep-all"):
        t.add_column(col, justify="right" if col != "strategy" else "left")
    rows = [("hetforge " + chosen.strategy, chosen)] + list(others.items())
    for name, p in rows:
        if p is None:
            t.add_row(name, "does not fit", "", "", "")
            continue
        pr = simulate(profile, p)
        t.add_row(name, format_bytes(pr.peak_bytes), f"{pr.activation_peak / keep.activation_peak:.2f}",
                  f"{pr.time_s * 1e3:.2f}", f"{pr.time_s / keep.time_s:.3f}")
    return t


def plot_timeline(pred: Prediction, keep: Prediction, budget: float | None, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for p, label, style in ((keep, "keep-all", "--"), (pred, "plan", "-")):
        xs, ys, t = [0.0], [], 0.0
        for _, dur, mem in p.timeline:
            t += dur * 1e3
            xs.append(t)
            ys.append(mem / 2**20)
        ax.stairs(ys, xs, label=f"{label} (peak {max(ys):.1f} MiB, {t:.1f} ms)", linestyle=style, linewidth=1.8)
    if budget is not None:
        ax.axhline(budget / 2**20, color="red", linewidth=1, label=f"budget {budget / 2**20:.1f} MiB")
    ax.set_xlabel("time in the step (ms): forward blocks, head, backward blocks")
    ax.set_ylabel("device memory (MiB)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_plan(path: Path, plan: Plan, pred: Prediction, budget: float | None, extra: dict | None = None) -> Path:
    d = {"plan": plan.to_dict(), "prediction": pred.to_dict(), "budget": budget, **(extra or {})}
    return write_text_atomic(path, json.dumps(d, indent=1))
