"""Compiled branches, and the compiler's own recomputation inside them.

Under `torch.compile` the AOT partitioner decides what a compiled region saves for its backward, and
`torch._functorch.config.activation_memory_budget` (0 to 1) lets it save less by recomputing in the
backward what is cheap to make again: pointwise ops first, fused into the backward's own kernels, a
cheaper way to a smaller footprint than recomputing whole branches (`bench/memory_plans.py`
compares the two). A memory plan offers it per kept branch (`plan.BranchPlan.budget`), priced on a
compiled profile (`profile.profile_model(compiled=True)`).

The budget is read while a region compiles, so one budget per graph: each budget is its own
backend, and dynamo keeps one graph per backend of a function (its backend-match guard), so blocks
that share a budget share a graph. A branch's saved bytes move in steps as the budget falls, not
smoothly, which `COMPILED_BUDGETS` samples.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable

import torch

# the budgets a plan may give a kept compiled branch (1.0, the default, is plain compilation)
COMPILED_BUDGETS = (0.7, 0.5, 0.0)

_BACKENDS: dict[float, Callable] = {}
_USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache, one per ATen CPU capability. Its key misses the capability: with
    one shared cache, kernels built under AVX-512 were reused by a process running with
    `ATEN_CPU_CAPABILITY=avx2` and trained to NaN (seen here). An explicit
    TORCHINDUCTOR_CACHE_DIR is kept."""
    if not _USER_INDUCTOR_CACHE:  # (Inductor writes its default into the variable once it has used it)
        cap = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"hetforge_inductor_{os.getuid()}_{cap}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_branches(blocks: Iterable[torch.nn.Module]) -> None:
    """Regional compilation: each block's two branches compiled on their own (what the block's
    forward and a memory plan both call). Identical blocks share one compiled graph, as parameters
    are graph inputs, so the cold start is one block's, not the model's."""
    inductor_cache_dir()
    for block in blocks:
        block.attn_branch = torch.compile(block.attn_branch)
        block.mlp_branch = torch.compile(block.mlp_branch)


def compile_chain(layers: torch.nn.Module, whole_chain: bool = False) -> None:
    """Compile a model's chain of blocks: each block's branches (`compile_branches`, what a memory
    plan's runner calls) and, with `whole_chain`, the chain's own forward as one graph, which runs
    wherever no plan needs the branches one by one (no plan, or a keep-all plan between measured
    steps: `executor.PlannedBlocks`). One graph over every block runs like whole-model
    `torch.compile`, which the branches alone, with a graph break between each, do not quite
    (`bench/memory_plans.py`). Its cold start traces every block, not one, and its backward
    is one autograd node: the gradients are ready only at its end, so a DDP run (whose all-reduce
    overlaps the backward bucket by bucket) and a sharded one keep to the branches."""
    compile_branches(layers)
    if whole_chain:
        plain = getattr(layers, "plain", layers)  # under a plan already applied: the chain it wraps
        plain.forward = torch.compile(plain.forward)


def budget_backend(budget: float) -> Callable:
    """Inductor, partitioning under `budget`; one object per budget (dynamo compares backends by
    identity)."""
    backend = _BACKENDS.get(budget)
    if backend is None:
        def backend(gm, example_inputs, budget=budget):
            import torch._functorch.config as functorch_config
            from torch._inductor.compile_fx import compile_fx

            with functorch_config.patch(activation_memory_budget=budget):
                return compile_fx(gm, example_inputs)
        _BACKENDS[budget] = backend
    return backend


def compiled_at(fn: Callable, budget: float) -> Callable:
    """`fn` compiled with the partitioner's activation memory budget at `budget`."""
    inductor_cache_dir()
    return torch.compile(fn, backend=budget_backend(budget))
