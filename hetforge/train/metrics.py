"""Metrics sinks: a JSONL file (the record of truth), TensorBoard, and the loss-curve PNG.

The JSONL file is appended to across resumes; readers keep the last record of each (kind, step),
so a run resumed from an earlier checkpoint than its last log line still yields one clean curve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Records by kind, sorted by step, last write winning for a repeated step (events: for a
    repeated step and event name, so that different events of one step all stay)."""
    by_key: dict[tuple, dict] = {}
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            by_key[(rec["kind"], rec["step"], rec.get("event", ""))] = rec
    out: dict[str, list[dict]] = {}
    for (kind, *_), rec in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(kind, []).append(rec)
    return out


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    train = records.get("train", [])
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1.4)
    val = records.get("val", [])
    if val:
        ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val loss", lw=1.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
