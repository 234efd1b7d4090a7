"""Holding a plan to its prediction during training: measured steps (from the third of a run, past
warm-up and past DDP's rebuild of its gradient buckets after the first iteration) are compared with
what the planner said; a gap over the tolerance is a warning, because a wrong profile means the
next budget decision is wrong too.

Three figures: the saved-activation bytes the executor's ledger held, the step time, and the
activation peak the allocator saw (`PeakMeter`). On a GPU all three come from one step (the
allocator's statistics cost nothing). On the CPU the meter is the profiler, which slows the step it
watches, so the peak is taken in the next step. Gradients are allocated (as zeros) before the
metered step unless DDP keeps them in its buckets, so what the meter sees above its start is the
activations, as the planner counts them."""

from __future__ import annotations

import torch

from hetforge.memory.executor import PlanRunner
from hetforge.memory.measure import PeakMeter


class PlanCheck:
    """`held_bytes`, `micro_step_s`, `activation_peak`: the plan's predictions for one micro-batch of
    `micro_batch` samples (`memory.plan.Prediction`)."""

    def __init__(self, held_bytes: float, micro_step_s: float, activation_peak: float, micro_batch: int,
                 runner: PlanRunner, device: torch.device, tolerance: float, check_step: int = 3):
        self.held, self.micro_step_s, self.activation_peak = held_bytes, micro_step_s, activation_peak
        self.micro_batch, self.runner, self.device, self.tol = micro_batch, runner, device, tolerance
        self.timed_step = check_step
        self.metered_step = check_step if device.type == "cuda" else check_step + 1
        self.done = False
        self._meter: PeakMeter | None = None
        self._now = 0
        self._rec: dict = {}

    def before(self, steps_this_call: int, params, preallocate_grads: bool = True) -> bool:
        """True when this step is measured (time and ledger, or the meter, or both)."""
        self._now = steps_this_call + 1
        if self.done or self._now not in (self.timed_step, self.metered_step):
            return False
        if self._now == self.timed_step:
            self.runner.measure = True
            self.runner.ledger.reset_peaks()
        if self._now == self.metered_step:
            if preallocate_grads:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # accumulating onto zeros changes no value
            self._meter = PeakMeter(self.device).__enter__()
        return True

    def after(self, compute_s: float, samples: int) -> tuple[dict | None, list[str]]:
        """The record and its warnings once every figure is in; (None, []) before."""
        if self._now == self.timed_step:
            self.runner.measure = False
            self._rec.update({
                "predicted_held_bytes": self.held, "measured_held_bytes": self.runner.ledger.peak_device,
                "predicted_step_s": self.micro_step_s * samples / max(self.micro_batch, 1),
                "measured_step_s": compute_s,
            })
        if self._now == self.metered_step:
            self._meter.__exit__(None, None, None)
            self._rec.update({"predicted_activation_peak_bytes": self.activation_peak,
                              "measured_activation_peak_bytes": self._meter.peak})
        if self._now != max(self.timed_step, self.metered_step):
            return None, []
        self.done = True
        rec = {"event": "memory_plan_check", "micro_batch": self.micro_batch, **self._rec}
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
