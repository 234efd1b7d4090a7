"""Device and precision choice: bf16 where the hardware has it, fp16 with dynamic loss scaling on
pre-Ampere GPUs (P100, V100, T4...), fp32 otherwise. One place decides, so the loop stays plain."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetforge.core.errors import ConfigError
from hetforge.core.hardware import detect, run_precision

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` for one device by `hardware.run_precision`'s rule (a distributed run decides
    once for all its ranks, in the loop). fp16 on the CPU is allowed (slow) so that the
    loss-scaling path is testable anywhere."""
    if name != "auto":
        return name
    return run_precision([detect(device)])[0]


@dataclass
class Precision:
    name: str
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 gathers weights in for compute (None: as stored, fp32)."""
        return None if self.name == "fp32" else self.dtype

    def autocast(self):
        """Weights stay fp32 (master copy); matmuls run in the low-precision dtype."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def grad_scaler(self, synced: bool = False) -> torch.amp.GradScaler:
        """Dynamic loss scaling for fp16 (skips a step and halves the scale on inf/NaN gradients);
        a disabled pass-through for bf16 and fp32, whose exponent range needs none. `synced`: the
        inf/NaN check is agreed over all ranks (PyTorch's ShardedGradScaler), as it must be where a
        rank sees only part of the gradients (shards, a pipeline's stages): one rank's overflow
        skips every rank's step, and the scale stays the same everywhere."""
        kind = SyncedGradScaler if synced else torch.amp.GradScaler
        return kind(self.device.type, enabled=self.name == "fp16")


class SyncedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose inf/NaN verdict is the maximum over all ranks, taken when the gradients
    are unscaled (what PyTorch's ShardedGradScaler does; that one's found-inf tensors have a shape
    the fused AdamW step refuses)."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.is_enabled():
            return
        super().unscale_(optimizer)
        for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
