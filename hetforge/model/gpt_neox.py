"""A GPT-NeoX-style decoder, written to be read top to bottom.

Parameter names and the fused-QKV layout follow Hugging Face's `GPTNeoXForCausalLM` so that export
is a renaming, not a re-layout. Attention goes through `F.scaled_dot_product_attention`, which picks
flash / memory-efficient / math kernels per device: the same code runs on a P100, an H200 and a CPU.
Blocks are kept as a plain `nn.ModuleList` so that parallelisms and memory plans are applied from
outside (torchtitan style), never baked into the model.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTNeoXConfig:
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    rotary_pct: float = 0.25
    rotary_base: float = 10000.0
    parallel_residual: bool = True
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary_dims(self) -> int:
        # Rounded down to even: rotate-half pairs channels (FORGE-s has head_dim 86: 21 -> 20).
        return int(self.head_dim * self.rotary_pct) // 2 * 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_model_config(cls, cfg, vocab_size: int) -> "GPTNeoXConfig":
        """Build from a validated `hetforge.config.ModelConfig`; `vocab_size` fills a None."""
        return cls(
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            d_ff=cfg.d_ff,
            vocab_size=cfg.vocab_size or vocab_size,
            rotary_pct=cfg.rotary_pct,
            rotary_base=cfg.rotary_base,
            parallel_residual=cfg.parallel_residual,
            tie_embeddings=cfg.tie_embeddings,
            norm_eps=cfg.norm_eps,
            dropout=cfg.dropout,
            init_std=cfg.init_std,
        )


class RotaryEmbedding(nn.Module):
    """NeoX rotary embedding on the first `dims` channels of each head (rotate-half layout)."""

    def __init__(self, dims: int, base: float):
        super().__init__()
        self.dims, self.base = dims, base
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dims, 2, dtype=torch.float32) / self.dims))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the frequencies in place: after a model built on the meta device is given
        real (uninitialised) storage."""
        self.inv_freq.copy_(self._inv_freq().to(self.inv_freq.device))

    def cos_sin(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int) -> torch.Tensor:
    if dims == 0:
        return x
    rot, rest = x[..., :dims], x[..., dims:]
    rot = rot * cos.to(rot.dtype) + _rotate_half(rot) * sin.to(rot.dtype)
    return torch.cat((rot, rest), dim=-1)


class HeadMerge(nn.Module):
    """(batch, heads, seq, head) -> (batch, seq, heads x head), a copy. A module of its own (no
    weights, so checkpoints do not see it) so that a memory plan can tell which tensor it read, the
    attention's output, and rebuild the merged copy from it in the backward (`memory.units`)."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        b, h, s, d = y.shape
        return y.transpose(1, 2).reshape(b, s, h * d)


class Attention(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rotary_dims = cfg.n_heads, cfg.head_dim, cfg.rotary_dims
        self.dropout = cfg.dropout
        self.padded_head_dim = cfg.head_dim  # set from outside: `set_head_padding`
        self.query_key_value = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.merge = HeadMerge()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # HF NeoX layout: per head, [q | k | v] contiguous.
        qkv = self.query_key_value(x).view(b, s, self.n_heads, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)
        q = apply_rotary(q, cos, sin, self.rotary_dims)
        k = apply_rotary(k, cos, sin, self.rotary_dims)
        pad = self.padded_head_dim - self.head_dim
        if pad > 0:  # zero channels: same scores, same outputs; lets a fused kernel take the head size
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            scale=1.0 / math.sqrt(self.head_dim) if pad > 0 else None,
        )
        if pad > 0:
            y = y[..., : self.head_dim]
        return self.dense(self.merge(y))


def set_head_padding(model: nn.Module, padded_head_dim: int) -> None:
    """Run every attention of `model` at this head size (see `core.hardware.padded_head_dim`);
    parameters and results are unchanged, so checkpoints and exports do not know of it."""
    for m in model.modules():
        if isinstance(m, Attention):
            if padded_head_dim < m.head_dim:
                raise ValueError(f"padded head size {padded_head_dim} < head size {m.head_dim}")
            m.padded_head_dim = padded_head_dim


class MLP(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.d_model, cfg.d_ff)
        self.dense_4h_to_h = nn.Linear(cfg.d_ff, cfg.d_model)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """One method, so that a memory plan that rebuilds the activation's output in the backward
        (`memory.units.rebuilds`) runs the same function as the forward did."""
        return F.gelu(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x)))


class Block(nn.Module):
    """One transformer layer; `parallel_residual` computes attention and MLP from the same input
    (GPT-J / NeoX), which shortens the dependency chain at no loss in quality at scale."""

    def __init__(self, cfg: GPTNeoXConfig):
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    # The two branches are separate methods so that a memory plan can recompute or offload each
    # one on its own (selective recomputation) without a second copy of the block's logic.
    def attn_branch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.drop(self.attention(self.input_layernorm(x), cos, sin))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.mlp(self.post_attention_layernorm(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, run=None) -> torch.Tensor:
        """`run(name, fn, *args)` executes a branch; a memory plan passes one, plain calls do not."""
        run = run or _call
        attn = run("attn", self.attn_branch, x, cos, sin)
        if self.parallel_residual:
            return x + attn + run("mlp", self.mlp_branch, x)
        x = x + attn
        return x + run("mlp", self.mlp_branch, x)


def _call(name, fn, *args):
    return fn(*args)


class Blocks(nn.ModuleList):
    """The chain of blocks, run in order. A memory plan replaces it from outside with a subclass
    that runs the same blocks under the plan (`hetforge.memory.executor.apply_plan`); the blocks
    and their parameter names stay the same, so state dicts and DDP see one model either way."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = block(x, cos, sin)
        return x


def initial_value(cfg: GPTNeoXConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A parameter's initial value (fp32, CPU), drawn from its own generator seeded by the run's
    seed and the parameter's name: the same weights however the model is built or sharded (a shard
    takes its slice of this draw), one parameter in memory at a time, never the whole model.

    Output projections feed the residual stream once per layer: they are scaled down so that the
    stream's variance does not grow with depth (GPT-2 / NeoX "wang" style)."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "layernorm" in name or "layer_norm" in name:
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith("attention.dense.weight") or name.endswith("dense_4h_to_h.weight"):
        std = std / math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


class GPTNeoX(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = Blocks(Block(cfg) for _ in range(cfg.n_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.embed_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.embed_out.weight = self.embed_in.weight
        self.rotary = RotaryEmbedding(cfg.rotary_dims, cfg.rotary_base)
        if self.embed_in.weight.device.type != "meta":  # on the meta device: initialised once placed
            self.reset_parameters()

    @classmethod
    def build(cls, cfg: GPTNeoXConfig, device: torch.device | str, seed: int) -> "GPTNeoX":
        """Built on the meta device, then given storage on `device` and initialised there (from
        `initial_value`): no second copy on the host, and the weights a sharded build gets too."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        model.reset_parameters(seed)
        model.rotary.reset_buffers()
        return model

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Every parameter from `initial_value`; `seed` None draws one from the global generator
        (so `torch.manual_seed` still fixes the weights)."""
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.cfg, name, tuple(p.shape), seed))

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> final hidden states (batch, seq, d_model), after the last norm:
        what the output projection reads, and what fine-tuned heads pool."""
        cos, sin = self.rotary.cos_sin(idx.shape[1], idx.device)
        x = self.emb_dropout(self.embed_in(idx))
        return self.final_layer_norm(self.layers(x, cos, sin))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab)."""
        return self.embed_out(self.features(idx))

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if non_embedding:
            n -= self.embed_in.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.embed_out.weight.numel()
        return n
