"""A grid of small trainings (model sizes x token budgets) for fitting a scaling law.

Each run is an ordinary `hetforge train` of the sweep's config with the model shape, the number of
steps and the run directory overridden, so every run is resumable and accountable like any other
(`RUN/report.json`). Runs go one after another here, or, with `--print-commands`, as one command
line each for a scheduler. `collect` reads the finished runs back for the fit.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from hetforge.model.presets import PRESETS
from hetforge.scaling.laws import ScalingError

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """'100k', '2.5M', '1e6', '30B' -> an integer count."""
    s = text.strip().lower()
    try:
        if s and s[-1] in _SUFFIX:
            return int(round(float(s[:-1]) * _SUFFIX[s[-1]]))
        return int(round(float(s)))
    except ValueError:
        raise ScalingError(f"cannot read the count {text!r}: use e.g. 100k, 2.5M, 1e6") from None


def parse_size(text: str) -> tuple[int, int, int]:
    """'4x128' (layers x width) or a preset name -> (n_layers, d_model, n_heads)."""
    s = text.strip()
    if s in PRESETS:
        p = PRESETS[s]
        return p.n_layers, p.d_model, p.n_heads
    m = re.fullmatch(r"(\d+)x(\d+)", s)
    if not m:
        raise ScalingError(f"cannot read the model size {text!r}: use LAYERSxWIDTH (e.g. 4x128) or a preset "
                           f"({', '.join(PRESETS)})")
    layers, d = int(m.group(1)), int(m.group(2))
    head = 32 if d < 256 else 64
    if d % head:
        raise ScalingError(f"model width {d} must be a multiple of {head} (the head size at that width)")
    return layers, d, d // head


@dataclass
class SweepRun:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    tokens: int
    steps: int

    def overrides(self, out: Path, warmup: int) -> list[str]:
        return [
            f"run_dir={out / self.name}", f"name={self.name}",
            f"model.n_layers={self.n_layers}", f"model.d_model={self.d_model}", f"model.n_heads={self.n_heads}",
            f"model.d_ff={4 * self.d_model}", f"train.steps={self.steps}",
            f"train.warmup_steps={min(warmup, max(1, self.steps // 10))}",
            f"train.eval_interval={self.steps}", f"train.checkpoint_interval={self.steps}",
            "train.tensorboard=false", "train.progress=false",
        ]


def plan_sweep(sizes: list[str], tokens: list[str], tokens_per_step: int) -> list[SweepRun]:
    runs = []
    for size in sizes:
        layers, d, heads = parse_size(size)
        for t in tokens:
            n_tok = parse_count(t)
            steps = max(2, math.ceil(n_tok / tokens_per_step))
            runs.append(SweepRun(f"L{layers}-d{d}-T{t.strip()}", layers, d, heads, steps * tokens_per_step, steps))
    return runs


def collect(runs_dir: Path) -> list[dict]:
    """Every finished run under `runs_dir`: its N (matmul parameters, the N of 6N), tokens trained
    and final validation loss, from the run's own report."""
    from hetforge.scaling.accounting import run_report
    from hetforge.scaling.downstream import final_scores

    rows = []
    for metrics in sorted(Path(runs_dir).glob("*/metrics.jsonl")):
        try:
            rep = run_report(metrics.parent)
        except ValueError:
            continue  # a run that has not trained yet
        if rep["final_val_loss"] is None:
            continue  # not finished: no final validation
        row = {"name": metrics.parent.name, "params": rep["matmul_params"], "tokens": rep["tokens"],
               "loss": rep["final_val_loss"], "flops": rep["model_flops"], "wall_s": rep["wall_s"]}
        tasks = final_scores(metrics.parent)
        rows.append({**row, "tasks": tasks} if tasks else row)
    return rows


def write_rows(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
