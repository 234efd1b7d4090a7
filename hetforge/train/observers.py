"""What watches the steps from outside them: stop signals, and step observers that a run, a bench
or a test installs (the check of the activation plan against its prediction is one)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Protocol

from hetforge.cluster.dist import all_gather_object
from hetforge.core.console import console, warn
from hetforge.memory.verify import PlanCheck
from hetforge.train.step import StepResult


class StepObserver(Protocol):
    """Called by the loop around every optimizer step, on every rank (collectives allowed: every
    rank calls them alike)."""

    def before_step(self, trainer) -> None: ...

    def after_step(self, trainer, result: StepResult) -> None: ...


class FirstStepRecord:
    """After a call's first step: its time where it compiled the blocks (the cold start), and what
    every rank holds of weights, gradients and optimizer state beside the plan's prediction."""

    def before_step(self, trainer) -> None:
        self._t0 = time.perf_counter()

    def after_step(self, trainer, result: StepResult) -> None:
        if trainer.state.steps_this_call != 1:
            return
        ctx, plan = trainer.ctx, trainer.plan
        if plan.compile:
            seconds = time.perf_counter() - self._t0
            trainer.say(f"compile: first step {seconds:.1f}s (compiling the blocks included)")
            if ctx.is_main:
                trainer.logger.log("event", trainer.state.step, {"event": "compile", "first_step_s": seconds})
        mine = plan.ranks[ctx.rank]
        ranks = all_gather_object(ctx, {"rank": ctx.rank, **trainer.held, "predicted": mine.static_bytes})
        if ctx.is_main:
            trainer.logger.log("event", trainer.state.step, {"event": "state_bytes", "strategy": plan.strategy,
                                                             "accumulation": plan.accumulation,
                                                             "predicted": mine.static_bytes, "ranks": ranks})


class PlanCheckObserver:
    """Holds this rank's activation plan to its prediction on one early step (`memory.verify`), and
    logs every rank's figures side by side."""

    def __init__(self, check: PlanCheck):
        self.check = check
        self._measuring = False

    def before_step(self, trainer) -> None:
        self._measuring = self.check.before(trainer.state.steps_this_call, trainer.params,
                                            not trainer.ctx.distributed)

    def after_step(self, trainer, result: StepResult) -> None:
        if not self._measuring:
            return
        record, warnings = self.check.after(result.compute_s, result.samples)
        for w in warnings:
            warn(f"rank {trainer.ctx.rank}: {w}")
        if record is not None:  # the same step on every rank
            ranks = all_gather_object(trainer.ctx, {**record, "rank": trainer.ctx.rank})
            if trainer.ctx.is_main:
                trainer.logger.log("event", trainer.state.step, {**record, "ranks": ranks})


class StopSignals:
    """SIGINT / SIGTERM ask the loop to stop after the current step and checkpoint; a second
    Ctrl-C aborts at once. Only the main thread may install handlers, so elsewhere this is inert."""

    def __init__(self, announce: bool = True):
        self.signum: int | None = None
        self.announce = announce
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        if self.announce:
            console.print(f"\n[yellow]{signal.Signals(signum).name}: stopping after this step, writing a checkpoint[/yellow]")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
