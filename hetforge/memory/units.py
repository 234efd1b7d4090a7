"""The named pieces of a transformer block that a tensor-level memory plan decides on.

A block's activations are seen two ways, and a plan needs both names:

* **saved units** are the tensors autograd saves for the backward, grouped by the module that saves
  them (the attention core's q, k, v, output and logsumexp; the MLP's hidden; ...). In a branch that
  is not recomputed each saved unit is kept on the device or offloaded to the host.
* **op units** are the outputs of the forward ops, grouped by the op that produces them (the QKV
  matmul, rotary, SDPA, GELU, ...). In a recomputed branch (selective activation checkpointing) each
  op unit's outputs are either cached in the forward or recomputed in the backward.

The block input is a unit of its own (`x`), shared by both branches of a parallel-residual block;
with a sequential residual the MLP's input is another (`mlp.input`).

Some saved units are the output of one cheap op applied to another unit the branch saves anyway:
the layer norms' outputs (from the block input), the GELU's output (from the MLP hidden, which
the GELU's own backward saves) and the merged heads (from the attention output, which SDPA's
backward saves; where the kernel does not save it, the math fallback, or saves it padded, the
merged copy is kept). A kept branch may **rebuild** them: the saved-tensor hook stores
nothing for them and runs that op again when the backward unpacks them (`rebuilds`). That frees
their bytes for an elementwise op, without re-running the branch under a checkpoint.

`Labeller` tracks which piece of a block is running, from forward hooks on the block's modules,
so the executor and the profiler name every saved tensor and every op the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

# (module path inside a Block, hook kind, label that starts there)
LABEL_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("input_layernorm", "pre", "attn.norm"),
    ("attention.query_key_value", "pre", "attn.qkv"),
    ("attention.query_key_value", "post", "attn.core"),
    ("attention.dense", "pre", "attn.dense"),
    ("post_attention_layernorm", "pre", "mlp.norm"),
    ("mlp.dense_h_to_4h", "pre", "mlp.up"),
    ("mlp.dense_h_to_4h", "post", "mlp.gelu"),
    ("mlp.dense_4h_to_h", "pre", "mlp.down"),
)

# Saved units: the module that saves a tensor -> the unit it belongs to.
SAVED_UNIT = {
    "attn.norm": "attn.norm-stats",
    "attn.qkv": "attn.norm-out",
    "attn.core": "attn.core",
    "attn.dense": "attn.merged",
    "mlp.norm": "mlp.norm-stats",
    "mlp.up": "mlp.norm-out",
    "mlp.gelu": "mlp.hidden",
    "mlp.down": "mlp.gelu-out",
}

DESCRIPTIONS = {
    "x": "block input (saved by the layer norms)",
    "mlp.input": "MLP input (sequential residual)",
    "attn.norm-stats": "attn layer-norm mean, rstd",
    "attn.norm-out": "attn layer-norm output (QKV matmul input)",
    "attn.core": "q, k, v, attention output, logsumexp (rotary + SDPA)",
    "attn.merged": "heads merged (output projection input)",
    "mlp.norm-stats": "MLP layer-norm mean, rstd",
    "mlp.norm-out": "MLP layer-norm output (up-projection input)",
    "mlp.hidden": "MLP hidden (GELU input)",
    "mlp.gelu-out": "GELU output (down-projection input)",
    "attn.norm": "layer norm (output, mean, rstd)",
    "attn.qkv": "QKV matmul output",
    "attn.rope": "rotary embedding of q, k",
    "attn.sdpa": "SDPA (output, logsumexp)",
    "attn.merge": "merge heads (copy)",
    "mlp.norm": "layer norm (output, mean, rstd)",
    "mlp.up": "up-projection output (hidden)",
    "mlp.gelu": "GELU output",
}

@dataclass(frozen=True)
class Rebuild:
    """A saved unit that one op makes again from a unit the branch saves anyway."""

    source: str  # the saved or input unit it is made from: its latest save before this one ...
    op_unit: str  # the op unit that made it in the forward (its time shares out the measured price)
    module: str  # the Block's submodule (or bound method) that makes it
    by_input: bool = False  # ... or its save that is the very tensor `module` read (a unit of several)
    same_last_dim: bool = True  # the output's last dimension is the source's (not for the merge)


def rebuilds(parallel_residual: bool) -> dict[str, Rebuild]:
    """The rebuildable saved units of a block: with a sequential residual the MLP's norm reads the
    MLP's own input."""
    mlp_in = "x" if parallel_residual else "mlp.input"
    return {
        "attn.norm-out": Rebuild("x", "attn.norm", "input_layernorm"),
        "mlp.norm-out": Rebuild(mlp_in, "mlp.norm", "post_attention_layernorm"),
        "mlp.gelu-out": Rebuild("mlp.hidden", "mlp.gelu", "mlp.activation"),
        "attn.merged": Rebuild("attn.core", "attn.merge", "attention.merge", by_input=True, same_last_dim=False),
    }


def rebuild_fn(block: torch.nn.Module, rebuild: Rebuild):
    """The callable that made the unit in `block`'s forward."""
    owner, _, attr = rebuild.module.rpartition(".")
    return getattr(block.get_submodule(owner) if owner else block, attr)


def remade_by_op(t: torch.Tensor, source_shape: tuple, same_last_dim: bool = True) -> bool:
    """Whether a saved tensor is the rebuilding op's output (or its autocast cast), made from a
    source of `source_shape`: its whole storage, the source's size (and last dimension), contiguous.
    A weight's cast that the same matmul saved is its transpose, not contiguous, and its last
    dimension is the layer's output size; it stays kept."""
    return (t.is_contiguous() and (not same_last_dim or tuple(source_shape[-1:]) == tuple(t.shape[-1:]))
            and math.prod(source_shape) * t.element_size() == t.untyped_storage().nbytes())


# modules whose input a rebuild is made from (`Rebuild.by_input`)
READ_BY = ("attention.merge",)

# Ops under these labels end their branch: early-stopping recomputation never reaches them and the
# backward needs none of their outputs, so caching them would only cost memory.
FINAL_LABELS = frozenset({"attn.dense", "mlp.down"})


def is_view_op(op) -> bool:
    """Ops whose outputs alias an input: free to recompute, never worth caching."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


class Labeller:
    """Which piece of a block is running now; set by forward hooks, read by the saved-tensor hooks
    (saved units) and the selective-checkpoint policy (op units)."""

    def __init__(self) -> None:
        self.label = ""
        self._after_sdpa = False
        self.read: dict[str, tuple] = {}  # module path -> the view it read last (a rebuild's source)

    def set(self, label: str) -> None:
        self.label = label
        self._after_sdpa = False

    def install(self, block: torch.nn.Module) -> list:
        handles = []
        for path, kind, label in LABEL_HOOKS:
            mod = block.get_submodule(path)
            if kind == "pre":
                handles.append(mod.register_forward_pre_hook(lambda m, a, lb=label: self.set(lb)))
            else:
                handles.append(mod.register_forward_hook(lambda m, a, o, lb=label: self.set(lb)))
        for path in READ_BY:
            handles.append(block.get_submodule(path).register_forward_pre_hook(partial(self._read, path)))
        return handles

    def _read(self, path: str, module, args) -> None:
        # Only an eager branch rebuilds (`executor.per_op_decisions`); in a compiled one a storage's
        # address would break the graph.
        if not torch.compiler.is_compiling():
            self.read[path] = view_key(args[0])

    def saved_unit(self) -> str:
        return SAVED_UNIT.get(self.label, self.label or "other")

    def op_unit(self, op) -> str | None:
        """The op unit of `op` running now; None for ops whose outputs are never worth caching."""
        if self.label in FINAL_LABELS or not self.label:
            return None
        if self.label == "attn.core":
            if "scaled_dot_product" in str(op):
                self._after_sdpa = True
                return "attn.sdpa"
            return "attn.merge" if self._after_sdpa else "attn.rope"
        return self.label


def storage_key(t: torch.Tensor) -> int:
    """The storage's identity (its StorageImpl, not its address): the same for every view of it,
    and defined for fake tensors too, which `memory.analytic` traces a block with."""
    return t.untyped_storage()._cdata


def view_key(t: torch.Tensor) -> tuple:
    """Identifies one view of a storage: two saves of the same view share one host copy."""
    return (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
