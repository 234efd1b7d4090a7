"""Planning for one device: profile -> activation plan -> prediction, at a micro-batch: what the
run's plan (`cluster.run_plan`) asks of every rank, measured here (`plan_device`) or on any profile,
measured or estimated for a card that is not here (`plan_profile`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hetforge.memory.milp import PlanError, plan_for_strategy
from hetforge.core.sizes import format_bytes, parse_size
from hetforge.memory.plan import ModelProfile, Plan, Prediction, simulate
from hetforge.memory.profile import profile_model
from hetforge.model.accounting import ShardLayout, static_bytes
from hetforge.model.gpt_neox import GPTNeoXConfig

def profile_cache() -> Path:
    """Where measured profiles are kept (keyed by what was measured): `HETFORGE_CACHE`, else the
    user's cache directory; never the working directory."""
    root = os.environ.get("HETFORGE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetforge"
    return Path(root) / "memory_profiles"


@dataclass
class DevicePlan:
    micro_batch: int
    budget: float | None
    plan: Plan
    prediction: Prediction
    keep_all: Prediction
    profile: ModelProfile
    optimizer_offload: bool = False
    offload_s: float = 0.0  # per optimizer step: gradients down, weights up, the host's step

    def summary(self) -> str:
        runs, out = [], []
        for i, o in enumerate(self.plan.options):
            if runs and runs[-1][2] == o:
                runs[-1][1] = i
            else:
                runs.append([i, i, o])
        for s, e, o in runs:
            out.append(f"{s}-{e}:{o}" if e > s else f"{s}:{o}")
        if self.plan.segments:
            out = [f"segments {self.plan.segments}"]
        if self.optimizer_offload:
            out.append("optimizer on the host")
        return ", ".join(out)


def resolve_budget(mem_cfg, device_memory: float | None) -> float | None:
    if mem_cfg.budget is None:
        return None
    if mem_cfg.budget == "auto":
        return device_memory
    return parse_size(mem_cfg.budget)


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


def comm_workspace(backend: str | None, grad_bytes: float) -> float:
    """Bytes the gradient all-reduce allocates during the backward: gloo copies each bucket (DDP's
    default cap, 25 MiB, or all the gradients if fewer); NCCL reduces the buckets in place."""
    return float(min(grad_bytes, DDP_BUCKET_BYTES)) if backend == "gloo" else 0.0


def plan_device(
    model_cfg: GPTNeoXConfig, mem_cfg, seq_len: int, precision: str, device: torch.device, micro_batch: int,
    budget: float | None, optimizer: str = "adamw", cache_dir: Path | None = None,
    workspace_bytes: float = 0.0, layout: ShardLayout | None = None, compiled: bool = False,
) -> DevicePlan:
    """Profile this device and plan on it. Raises PlanError (naming the smallest feasible budget)
    when nothing fits."""
    link = mem_cfg.link_gbps * 1e9 if mem_cfg.link_gbps else None
    prof = profile_model(model_cfg, micro_batch, seq_len, precision, device, link, optimizer, cache_dir,
                         compiled=compiled)
    prof.workspace_bytes = workspace_bytes
    return plan_profile(prof, model_cfg, mem_cfg, micro_batch, budget, optimizer, layout, compiled)


def plan_profile(prof: ModelProfile, model_cfg: GPTNeoXConfig, mem_cfg, micro_batch: int, budget: float | None,
                 optimizer: str = "adamw", layout: ShardLayout | None = None, compiled: bool = False) -> DevicePlan:
    """The plan for a profile, measured here or estimated for another card (`memory.analytic`).

    Optimizer offload (`memory.optimizer_offload`): "on" always; "auto" only when no activation plan
    fits beside the optimizer's state, since the host step and the copies cost time every step.
    Under a sharded `layout` the static bytes are its shards and gathered units, and the host
    optimizer is not an option (a sharded run offloads with parallel.offload=params). `compiled`:
    the run compiles its blocks, so `memory.rebuild: auto` offers no rebuilding (see `rebuild_units`);
    a compiled profile (`profile_model(compiled=True)`) adds compile budgets to the menu."""
    layout = layout or ShardLayout()
    mode = mem_cfg.optimizer_offload if layout.strategy == "ddp" else "off-sharded"
    offload = mode == "on"

    def solve_with(off: bool) -> Plan:
        prof.static = layout.static_bytes(model_cfg, optimizer, off)
        return plan_for_strategy(prof, budget, mem_cfg.strategy, mem_cfg.granularity, mem_cfg.time_limit_s,
                                 rebuild_units(mem_cfg, compiled))

    try:
        plan = solve_with(offload)
    except PlanError as err:
        if mode == "off-sharded":
            raise
        if mode == "off":
            state = static_bytes(model_cfg, optimizer)["optimizer state"]
            raise PlanError(f"{err}; memory.optimizer_offload=auto would move the optimizer's "
                            f"{format_bytes(state)} to the host") from None
        if mode != "auto":
            raise
        plan, offload = solve_with(True), True  # raises in its turn if even that does not fit
    keep = simulate(prof, Plan(["keep"] * model_cfg.n_layers, "keep-all"))
    offload_s = 0.0
    if offload:
        n = prof.static["weights"] / 4.0
        offload_s = 2 * 4.0 * n / prof.link_bytes_per_s + n * prof.meta["host_step_s_per_param"]
    return DevicePlan(micro_batch, budget, plan, simulate(prof, plan), keep, prof, offload, offload_s)


def rebuild_units(mem_cfg, compiled: bool) -> bool:
    """Whether plans may rebuild units (`memory.rebuild`). Auto: only where the blocks run eager. A
    rebuilding branch runs eager, giving up its compiled kernels, which costs more than the
    compiler's own recomputation does. A compiled run has the partitioner's recomputation instead (compile budgets,
    `memory.compiled`), which makes again what rebuilding would, inside the compiled backward."""
    return mem_cfg.rebuild == "on" or (mem_cfg.rebuild == "auto" and not compiled)


def plan_for_config(cfg, model_cfg: GPTNeoXConfig, device: torch.device, micro_batch: int,
                    device_memory: float | None = None, cache_dir: Path | None = None) -> DevicePlan:
    """`plan_device` with the budget, precision and optimizer a run config gives, for this device
    alone (a run plans every rank through `cluster.run_plan`)."""
    from hetforge.core.precision import resolve_precision

    return plan_device(model_cfg, cfg.memory, cfg.train.seq_len, resolve_precision(cfg.train.precision, device),
                       device, micro_batch, resolve_budget(cfg.memory, device_memory), cfg.train.optimizer, cache_dir)
