"""Downstream accuracy against training compute, as FORGE reports it beside the loss.

A run's `tasks` records (train.eval_tasks, logged with the tokens trained so far) and the
`hetforge eval --tasks` results saved in RUN/eval/ give accuracy per task at a known compute
(model FLOPs per token times tokens). One run gives a curve; a sweep's final points show how
accuracy grows with scale. Each panel draws its task's chance level, since a small model's score
means something only above it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hetforge.core.metrics import read_metrics


def run_points(run_dir: str | Path) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """({task: [(training FLOPs, acc)]}, {task: chance}) over a run's in-training task scores."""
    metrics = read_metrics(Path(run_dir) / "metrics.jsonl")
    starts = [e for e in metrics.get("event", []) if e.get("event") == "run_start"]
    if not starts:
        return {}, {}
    per_token = starts[-1]["flops_per_token"]
    series: dict[str, list[tuple[float, float]]] = {}
    chance: dict[str, float] = {}
    for rec in metrics.get("tasks", []):
        for key, value in rec.items():
            task, _, metric = key.rpartition("/")
            if metric == "acc":
                series.setdefault(task, []).append((per_token * rec["tokens"], value))
            elif metric == "chance":
                chance[task] = value
    return series, chance


def final_scores(run_dir: str | Path) -> dict[str, dict]:
    """{task: {acc, chance, n, source}} at a run's last scored step: a zero-shot `hetforge eval
    --tasks` result of its newest checkpoint where there is one (full sets), else its last
    in-training task record (capped at train.eval_task_limit)."""
    run = Path(run_dir)
    out: dict[str, dict] = {}
    metrics = read_metrics(run / "metrics.jsonl")
    records = metrics.get("tasks", [])
    if records:
        last = records[-1]
        for key, value in last.items():
            task, _, metric = key.rpartition("/")
            if metric == "acc":
                out[task] = {"acc": value, "chance": last.get(f"{task}/chance"), "n": last.get("limit"),
                             "source": f"training (step {last['step']})"}
    saved = sorted((run / "eval").glob("step_*-0shot.json"))
    if saved:
        got = json.loads(saved[-1].read_text())
        for t in got["tasks"]:
            out[t["task"]] = {"acc": t["acc"], "chance": t["chance"], "n": t["n"], "source": saved[-1].name}
    return out


def plot_downstream(series: dict[str, list[tuple[float, float]]], chance: dict[str, float], path: Path,
                    title: str, sizes: dict[str, list[float]] | None = None) -> Path:
    """One panel per task: accuracy against training FLOPs (log scale), chance dashed. `sizes`
    (the model size of each point) colours a sweep's points by N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    tasks = sorted(series)
    cols = min(4, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        pts = sorted(series[task])
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if sizes and task in sizes:
            sc = ax.scatter([p[0] for p in series[task]], [p[1] for p in series[task]],
                            c=[math.log10(n) for n in sizes[task]], cmap="viridis", zorder=3)
            fig.colorbar(sc, ax=ax, label="log10 N")
        else:
            ax.plot(xs, ys, marker="o", markersize=3)
        level = chance.get(task)
        if level is not None:
            ax.axhline(level, linestyle="--", color="grey", linewidth=1, label=f"chance {level:.3f}")
            ax.legend(fontsize=7, loc="best")
        span = ys + ([level] if level is not None else [])
        ax.set_ylim(max(0.0, min(span) - 0.05), min(1.0, max(span) + 0.05))
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(labelsize=7)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("training FLOPs", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
