"""The loss-curve PNG of a run, drawn from its metrics record (`hetforge.core.metrics`)."""

from __future__ import annotations

from pathlib import Path

from hetforge.core.metrics import read_metrics


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
