"""Downstream tasks during training: `train.eval_tasks` scored at each validation and at the end.

The same scorer as `hetforge eval --tasks`, on the first `train.eval_task_limit` questions of each
task, so the curve in metrics.jsonl / TensorBoard is the one a later full evaluation extends. Every
rank scores the same questions in the same batches (a sharded model's forward is a collective);
rank 0 logs them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetforge.config import TrainConfig
from hetforge.core.console import warn
from hetforge.core.metrics import MetricsLogger
from hetforge.core.precision import Precision
from hetforge.data.tokenizer import load_tokenizer
from hetforge.evaluate.benchmarks import BENCHMARKS, data_root, expand
from hetforge.evaluate.multiple_choice import TaskScore
from hetforge.evaluate.suite import score_tasks


class TaskEval:
    """Checks the task names when the run starts (a typo fails before training, not at step N)."""

    def __init__(self, tc: TrainConfig, tokenizer_path, device: torch.device, precision: Precision,
                 enabled: bool = True):
        self.names = list(tc.eval_tasks)
        if self.names and not enabled:  # a pipeline's stages have no whole model to score with
            warn("train.eval_tasks are not scored under parallel.pipeline; score a checkpoint with hetforge eval")
            self.names = []
        self.limit, self.shots, self.seq_len, self.batch = tc.eval_task_limit, tc.eval_task_shots, tc.seq_len, \
            tc.micro_batch_size
        self.device, self.precision = device, precision
        self.tok = None
        if self.names:
            entries = expand(self.names, self.shots)
            if any(t in BENCHMARKS for _, ts in entries for t in ts):
                data_root()
            self.tok = load_tokenizer(tokenizer_path)

    def __call__(self, model: torch.nn.Module, step: int, tokens: int, logger: MetricsLogger | None,
                 say: Callable[[str], None]) -> list[TaskScore]:
        """Score the tasks; log acc (acc_norm) and chance per task, with the tokens trained so far."""
        if not self.names:
            return []
        was_training = model.training
        model.eval()
        try:
            with self.precision.autocast():
                scores = score_tasks(model, self.tok, self.names, self.seq_len, self.device, self.shots, self.limit,
                                     self.batch)
        finally:
            model.train(was_training)
        values = {}
        for s in scores:
            values[f"{s.task}/acc"] = s.acc
            if s.acc_norm is not None:
                values[f"{s.task}/acc_norm"] = s.acc_norm
            values[f"{s.task}/chance"] = s.chance
        if logger is not None:
            logger.log("tasks", step, {**values, "tokens": tokens, "limit": self.limit, "shots": self.shots})
        say(f"step {step:>6} | " + " | ".join(f"{s.task} {s.acc:.3f}" for s in scores))
        return scores
