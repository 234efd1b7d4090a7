"""Holding a plan to its prediction during training: one measured step (the second of a run, after
warm-up) is compared with what the planner said; a gap over the tolerance is a warning, because a
wrong profile means the next budget decision is wrong too.

Three figures: the saved-activation bytes the executor's ledger held, the activation peak the
allocator saw (`PeakMeter`: CUDA statistics or, on the CPU, the profiler's allocation events), and
the step time. For the peak the gradients are allocated (as zeros) before the measured step, so
what the meter sees above its start is the activations, as the planner counts them."""

from __future__ import annotations

import torch

from hetforge.memory.device_plan import DevicePlan
from hetforge.memory.executor import PlanRunner
from hetforge.memory.measure import PeakMeter


class PlanCheck:
    def __init__(self, dp: DevicePlan, runner: PlanRunner, device: torch.device, tolerance: float,
                 check_step: int = 2):
        self.dp, self.runner, self.device, self.tol, self.check_step = dp, runner, device, tolerance, check_step
        self.done = False
        self._meter: PeakMeter | None = None

    def before(self, steps_this_call: int, params) -> bool:
        """True when this step is the measured one (and the meter is then running)."""
        if self.done or steps_this_call + 1 != self.check_step:
            return False
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # accumulating onto zeros changes no value
        self.runner.measure = True
        self.runner.ledger.reset_peaks()
        self._meter = PeakMeter(self.device).__enter__()
        return True

    def after(self, compute_s: float, samples: int) -> tuple[dict, list[str]]:
        self.done = True
        self._meter.__exit__(None, None, None)
        self.runner.measure = False
        pred = self.dp.prediction
        rec = {
            "event": "memory_plan_check",
            "micro_batch": self.dp.micro_batch,
            "predicted_held_bytes": pred.held_bytes,
            "measured_held_bytes": self.runner.ledger.peak_device,
            "predicted_activation_peak_bytes": pred.activation_peak,
            "measured_activation_peak_bytes": self._meter.peak,
            "predicted_step_s": pred.time_s * samples / max(self.dp.micro_batch, 1),
            "measured_step_s": compute_s,
        }
        warnings = []
        for what, key in (("held activation memory", "held_bytes"), ("activation peak", "activation_peak_bytes"),
                          ("step time", "step_s")):
            p, m = rec[f"predicted_{key}"], rec[f"measured_{key}"]
            if p <= 0:
                continue
            rec[f"{key.rsplit('_', 1)[0]}_ratio"] = m / p
            if abs(m / p - 1) > self.tol:
                warnings.append(f"memory plan: measured {what} is {m / p:.2f}x the prediction (tolerance "
                                f"{self.tol:.0%}); re-profile with `hetforge plan` on this device")
        return rec, warnings
