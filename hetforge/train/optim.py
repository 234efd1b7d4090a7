"""Optimizers and the learning-rate schedule.

The schedule is a pure function of the step, so resuming needs no scheduler object, only the step.
LAMB (You et al. 2020, used by FORGE at large batch) is not in PyTorch; it is AdamW's update
rescaled per tensor by the trust ratio ||w|| / ||update||.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from hetforge.config import TrainConfig
from hetforge.model.accounting import proportional_partition


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio`·peak at the last step."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and LayerNorm gains are not regularised (GPT-NeoX convention)."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def param_order(model: nn.Module) -> list[str]:
    """Parameter names in the order `param_groups` lists them: what the integer keys of a torch
    optimizer's state dict stand for, so that it can be read by name (a sharded run's state)."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(name)
    return decay + no_decay


class ProportionalZero(ZeroRedundancyOptimizer):
    """PyTorch's ZeRO-1, with the optimizer state partitioned in proportion to each rank's memory
    (`model.accounting.proportional_partition`) instead of evenly: a 32 GB card then holds twice
    the state of a 16 GB one in the same run. Only the partition changes; stepping, the broadcast
    of updated parameters and the state dict's consolidation are ZeroRedundancyOptimizer's own,
    which read the partition through `_partition_parameters`."""

    def __init__(self, params, weights: list[float], **kwargs):
        self._state_weights = list(weights)  # read while the base class partitions, in its __init__
        super().__init__(params, **kwargs)

    def _partition_parameters(self, params_per_rank=None):
        if params_per_rank is not None or self._partition_parameters_cache:
            return super()._partition_parameters(params_per_rank)
        if len(self._state_weights) != self.world_size:
            raise ValueError(f"{len(self._state_weights)} state share weights for {self.world_size} ranks")
        sizes = [[p.numel() for p in g["params"]] for g in self.param_groups]
        self._partition_parameters_cache = [[] for _ in range(self.world_size)]
        for group, ranks in zip(self.param_groups, proportional_partition(sizes, self._state_weights)):
            per_rank = [[] for _ in range(self.world_size)]
            for p, r in zip(group["params"], ranks):
                per_rank[r].append(p)
            self._partition_param_group(group, per_rank)
        return self._partition_parameters_cache


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device,
                    offload: bool = False, zero1: bool = False,
                    state_weights: list[float] | None = None) -> torch.optim.Optimizer:
    """AdamW or LAMB over the model's parameter groups; with `offload`, the same optimizer kept and
    stepped in host memory (`HostOffloadOptimizer`); with `zero1`, its state sharded over the
    ranks (PyTorch's `ZeroRedundancyOptimizer`: each rank steps its part, then broadcasts it), in
    proportion to `state_weights` (each rank's memory) when given."""
    groups = param_groups(model, cfg.weight_decay)
    if zero1:
        zero = ZeroRedundancyOptimizer if state_weights is None else \
            (lambda params, **kw: ProportionalZero(params, state_weights, **kw))
        if cfg.optimizer == "lamb":
            return zero(groups, optimizer_class=Lamb, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        return zero(groups, optimizer_class=torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                    **_adamw_kernel(device))
    if offload:
        return HostOffloadOptimizer(groups, lambda host_groups: _make(host_groups, cfg, torch.device("cpu")))
    return _make(groups, cfg, device)


def _make(groups: list[dict], cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **_adamw_kernel(device))


def _adamw_kernel(device: torch.device) -> dict:
    """The fused kernel (one pass over each tensor, one launch per group) on CUDA and on the CPU,
    where the multi-tensor path makes one pass per arithmetic op and is several times slower; on a
    sharded model it is also one DTensor dispatch per group instead of one per op."""
    return {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}


class HostOffloadOptimizer:
    """ZeRO-Offload's idea for a device too small for weights, gradients and optimizer state: the
    optimizer, its state (Adam's two moments, 8 bytes a parameter) and an fp32 copy of the weights
    live in host memory (pinned where a GPU is there), each step runs on the host's cores, and only
    the updated weights go back. The device keeps weights and gradients.

    To the loop and the loss scaler it is an optimizer: `param_groups` are the device parameters'
    groups (the loop sets the learning rate there; it is passed on at each step), so unscaling and
    clipping work on the device gradients as before. Its state dict is the host optimizer's, in the
    same form as an on-device one's, so a run can resume with offload switched on or off."""

    def __init__(self, groups: list[dict], make):
        self.param_groups = groups
        pin = torch.cuda.is_available() and any(p.is_cuda for g in groups for p in g["params"])
        host_groups, self._pairs = [], []
        for g in groups:
            hosted = []
            for p in g["params"]:
                hp = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
                hp.copy_(p.detach())
                hp.requires_grad_(True)
                hp.grad = torch.zeros_like(hp)  # a pinned landing place for the gradient, reused
                hosted.append(hp)
                self._pairs.append((p, hp))
            host_groups.append({**g, "params": hosted})
        self.inner = make(host_groups)
        self.defaults = self.inner.defaults
        self.state = self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        for mine, theirs in zip(self.param_groups, self.inner.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        stepped = []
        for p, hp in self._pairs:
            if p.grad is not None:
                hp.grad.copy_(p.grad, non_blocking=True)
                stepped.append((p, hp))
        if any(p.is_cuda for p, _ in stepped):
            torch.cuda.synchronize()
        missing = [hp for p, hp in self._pairs if p.grad is None]
        saved = [hp.grad for hp in missing]
        for hp in missing:  # a parameter without a gradient is not stepped, as on the device
            hp.grad = None
        self.inner.step()
        for hp, g in zip(missing, saved):
            hp.grad = g
        for p, hp in stepped:
            p.copy_(hp, non_blocking=True)
        return None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
