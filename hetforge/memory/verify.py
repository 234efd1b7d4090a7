"""Holding a plan to its prediction during training: one measured step (the second of a run, after
warm-up) is compared with what the planner said; a gap over the tolerance is a warning, because a
wrong profile means the next budget decision is wrong too."""

from __future__ import annotations

import torch

from hetforge.memory.device_plan import DevicePlan
from hetforge.memory.executor import PlanRunner


class PlanCheck:
    def __init__(self, dp: DevicePlan, runner: PlanRunner, device: torch.device, tolerance: float,
                 check_step: int = 2):
        self.dp, self.runner, self.device, self.tol, self.check_step = dp, runner, device, tolerance, check_step
        self.done = False

    def before(self, steps_this_call: int) -> bool:
        """True when this step is the measured one."""
        if self.done or steps_this_call + 1 != self.check_step:
            return False
        self.runner.ledger.reset_peaks()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return True

    def after(self, compute_s: float, samples: int) -> tuple[dict, list[str]]:
        self.done = True
        pred = self.dp.prediction
        rec = {
            "event": "memory_plan_check",
            "micro_batch": self.dp.micro_batch,
            "predicted_held_bytes": pred.held_bytes,
            "measured_held_bytes": self.runner.ledger.peak_device,
            "predicted_step_s": pred.time_s * samples / max(self.dp.micro_batch, 1),
            "measured_step_s": compute_s,
        }
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            rec["predicted_peak_bytes"] = pred.peak_bytes
            rec["measured_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        warnings = []
        for what, key in (("held activation memory", "held_bytes"), ("step time", "step_s"),
                          ("peak memory", "peak_bytes")):
            p, m = rec.get(f"predicted_{key}"), rec.get(f"measured_{key}")
            if p is None or m is None or p <= 0:
                continue
            rec[f"{key.rsplit('_', 1)[0]}_ratio"] = m / p
            if abs(m / p - 1) > self.tol:
                warnings.append(f"memory plan: measured {what} is {m / p:.2f}x the prediction (tolerance "
                                f"{self.tol:.0%}); re-profile with `hetforge plan` on this device")
        return rec, warnings
