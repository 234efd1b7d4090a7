"""What a training run cost, as FORGE reports it: FLOPs, tokens, tokens per parameter, utilisation,
wall time and energy.

Everything is derived from the run directory's record of truth, `metrics.jsonl`: the `run_start`
event the loop writes once per invocation (FLOPs per token, parameters, every rank's device and
power) and the train records (cumulative tokens, step time, MFU/HFU per logging interval). So the
figures survive resumes and can be recomputed for any run, finished or not.

Energy is power x time per rank. Power is, in order: measured through NVML during the run (where
`pynvml` and an NVIDIA GPU are there), the `power_w` declared for the device in the cluster
description, the board power of the GPU model from `hetforge.cluster.devices`; a CPU with nothing
declared has no estimate.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.core.metrics import read_metrics


def rank_power(declared_w: float | None, device_name: str, is_cuda: bool) -> tuple[float | None, str]:
    """This rank's power figure before the run, and where it comes from."""
    from hetforge.core.hardware import lookup

    if declared_w:
        return float(declared_w), "declared"
    info = lookup(device_name) if is_cuda else None
    if info is not None:
        return info.power_w, f"board power of {info.name}"
    return None, "unknown (declare power_w for the device)"


class PowerMeter:
    """Mean board power of this rank's GPU over the run, through NVML; inert elsewhere."""

    def __init__(self, device):
        self.samples: list[float] = []
        self._handle = None
        if getattr(device, "type", "cpu") != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # no NVML library, no driver, or not an NVIDIA device
            self._handle = None

    def sample(self) -> None:
        if self._handle is not None:
            try:
                self.samples.append(self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0)
            except Exception:
                self._handle = None

    @property
    def mean_w(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def run_report(run_dir: str | Path) -> dict:
    """The run's accounting, from its metrics. Raises FileNotFoundError without metrics."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    starts = [e for e in metrics.get("event", []) if e.get("event") == "run_start"]
    train = metrics.get("train", [])
    if not starts or not train:
        raise ValueError(f"{run_dir}: no training recorded yet (metrics.jsonl has no run_start or train records)")
    start = starts[-1]
    tokens = train[-1]["tokens"]
    wall, prev, mfu_w, hfu_w = 0.0, 0, 0.0, 0.0
    for r in train:  # each record covers the steps since the previous one
        dt = r["step_time_s"] * (r["step"] - prev)
        wall += dt
        mfu_w += r["mfu"] * dt
        hfu_w += r.get("hfu", r["mfu"]) * dt
        prev = r["step"]
    n = start["matmul_params"]
    ranks = start["ranks"]
    measured = [e for e in metrics.get("event", []) if e.get("event") == "power_measured"]
    if measured:  # NVML's mean over the run wins over any figure known beforehand
        for r, w in zip(ranks, measured[-1]["measured_w"]):
            if w is not None:
                r["power_w"], r["power_source"] = w, "measured (NVML)"
    powers = [r.get("power_w") for r in ranks]
    energy = wall * sum(powers) if all(p is not None for p in powers) else None
    val = metrics.get("val", [])
    return {
        "run": str(run_dir),
        "steps": train[-1]["step"],
        "params": start["params"],
        "matmul_params": n,
        "tokens": tokens,
        "tokens_per_param": tokens / n,
        "model_flops": start["flops_per_token"] * tokens,
        "hardware_flops": start["hw_flops_per_token"] * tokens,
        "mfu": mfu_w / wall if wall else 0.0,
        "hfu": hfu_w / wall if wall else 0.0,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "world_size": len(ranks),
        "devices": [r["device"] for r in ranks],
        "power_w": powers,
        "power_source": sorted({r["power_source"] for r in ranks}),
        "energy_j": energy,
        "final_train_loss": train[-1]["loss"],  # the mean over the last logging interval, as printed then
        "final_train_loss_steps": [train[-2]["step"] + 1 if len(train) > 1 else 1, train[-1]["step"]],
        "final_val_loss": val[-1]["loss"] if val else None,
        "loss_curve": str(run_dir / "loss_curve.png"),
    }


def write_report(run_dir: str | Path) -> Path:
    rep = run_report(run_dir)
    return write_text_atomic(Path(run_dir) / "report.json", json.dumps(rep, indent=1))


def report_table(rep: dict):
    from rich.table import Table

    t = Table(title=f"run {rep['run']}", show_header=False)
    t.add_row("parameters", f"{rep['params'] / 1e6:,.2f}M ({rep['matmul_params'] / 1e6:,.2f}M in matmuls: the N of 6N)")
    t.add_row("tokens", f"{rep['tokens']:,} in {rep['steps']:,} steps ({rep['tokens_per_param']:.1f} tokens/param)")
    t.add_row("training FLOPs", f"{rep['model_flops']:.3g} model, {rep['hardware_flops']:.3g} with recomputation")
    t.add_row("utilisation", f"MFU {rep['mfu']:.1%}, HFU {rep['hfu']:.1%}")
    t.add_row("wall time", f"{rep['wall_s'] / 3600:,.3f} h ({rep['tokens_per_s']:,.0f} tokens/s, "
                           f"{rep['world_size']} rank(s): {', '.join(sorted(set(rep['devices'])))})")
    if rep["energy_j"] is not None:
        t.add_row("energy", f"{rep['energy_j'] / 3.6e6:,.4f} kWh ({sum(rep['power_w']):,.0f} W; "
                            f"{'; '.join(rep['power_source'])})")
    else:
        t.add_row("energy", f"no estimate: {'; '.join(rep['power_source'])}")
    first, last = rep["final_train_loss_steps"]
    t.add_row("final train loss", f"{rep['final_train_loss']:.4f} (mean over steps {first}-{last})")
    if rep["final_val_loss"] is not None:
        t.add_row("final val loss", f"{rep['final_val_loss']:.4f}")
    t.add_row("loss curve", rep["loss_curve"])
    return t
