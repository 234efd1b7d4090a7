"""A run's accounting (FLOPs per token, peaks, the run_start record) and its loss-curve PNG, drawn
from its metrics record (`hetforge.core.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hetforge.cluster.dist import DistContext, all_gather_object
from hetforge.config import RunConfig
from hetforge.core.metrics import read_metrics
from hetforge.model.accounting import block_forward_flops, count_parameters, flops_per_token, matmul_params
from hetforge.model.gpt_neox import GPTNeoXConfig
from hetforge.scaling.flops import measure_matmul_peak


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


@dataclass
class Accounting:
    """What a run's steps are worth: model FLOPs per token, hardware FLOPs per token (this rank's
    recomputation added), every rank's matmul peak (MFU is the job's against their sum)."""

    params: int
    flops_per_token: float
    hw_flops_per_token: float
    rank_peaks: list[float]
    tokens_per_step: int
    peak_source: str

    @property
    def peak(self) -> float:
        return sum(self.rank_peaks)


def account(cfg: RunConfig, ctx: DistContext, model: torch.nn.Module, shape: GPTNeoXConfig,
            recompute_share: float, global_batch: int, device: torch.device, dtype: torch.dtype) -> Accounting:
    """`recompute_share`: the part of the blocks' forward this rank's activation plan repeats."""
    tc = cfg.train
    fpt = flops_per_token(shape, tc.seq_len)
    hw_fpt = fpt + recompute_share * shape.n_layers * block_forward_flops(shape, 1, tc.seq_len)
    mine = tc.peak_tflops * 1e12 if tc.peak_tflops else measure_matmul_peak(device, dtype)
    params = count_parameters(shape)["total"] if cfg.parallel.pipeline else model.num_parameters()  # a stage: the whole
    return Accounting(params, fpt, hw_fpt, all_gather_object(ctx, mine), global_batch * tc.seq_len,
                      "configured" if tc.peak_tflops else "measured")


def log_run_start(cfg: RunConfig, ctx: DistContext, logger, step: int, acc: Accounting, shape: GPTNeoXConfig,
                  device_name: str, power: tuple[float | None, str], sources: list[dict]) -> None:
    """The `run_start` record the report derives cost and energy from (every rank's device and power)."""
    ranks = all_gather_object(ctx, {"rank": ctx.rank, "device": device_name, "power_w": power[0],
                                    "power_source": power[1]})
    if ctx.is_main:
        logger.log("event", step, {
            "event": "run_start", "params": acc.params, "flops_per_token": acc.flops_per_token,
            "hw_flops_per_token": acc.hw_flops_per_token, "matmul_params": matmul_params(shape),
            "seq_len": cfg.train.seq_len, "tokens_per_step": acc.tokens_per_step, "ranks": ranks,
            "rank_peak_tflops": [p / 1e12 for p in acc.rank_peaks], "sources": sources})
