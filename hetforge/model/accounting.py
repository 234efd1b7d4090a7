"""The one place that counts what a model shape costs: parameters, FLOPs and static bytes.

Training FLOPs per token = 6·N + 12·L·d·s (PaLM, appendix B): 6 FLOPs per weight per token for the
forward and backward matmuls, plus the attention score/value products that no weight accounts for.
N here is the non-embedding parameter count *plus the output projection* (V·d): the input
embedding is a table lookup and costs nothing, but the logits are a real V×d matmul on every token,
and for the small models this project trains on CPUs it is a third of all the work. MFU excludes
recomputation (model FLOPs); HFU includes it (hardware FLOPs).

Static bytes are what a rank holds whatever its activation plan: fp32 master weights and gradients
(autocast computes in bf16/fp16 from them) and the optimizer's state (AdamW's and LAMB's two
moments) unless it lives on the host. The probe, the planner, sizing and the report all read them
here, so they agree.
"""

from __future__ import annotations

from hetforge.model.gpt_neox import GPTNeoXConfig

WEIGHT_BYTES = 4  # fp32 master copy
GRAD_BYTES = 4
OPTIMIZER_BYTES = {"adamw": 8, "lamb": 8}  # two fp32 moments per parameter


def count_parameters(shape: GPTNeoXConfig) -> dict[str, int]:
    """Exact parameter count of hetforge's GPT-NeoX (all linears and LayerNorms carry biases):
    total, embedding and non-embedding."""
    d, f = shape.d_model, shape.d_ff
    per_layer = (
        2 * 2 * d  # input + post-attention LayerNorm (weight, bias)
        + 3 * d * d + 3 * d  # fused QKV
        + d * d + d  # attention output projection
        + d * f + f  # MLP up
        + f * d + d  # MLP down
    )
    non_embedding = shape.n_layers * per_layer + 2 * d  # + final LayerNorm
    embedding = shape.vocab_size * d * (1 if shape.tie_embeddings else 2)
    return {"total": non_embedding + embedding, "embedding": embedding, "non_embedding": non_embedding}


def block_matmul_params(shape: GPTNeoXConfig) -> int:
    """Weights of one block that multiply every token (QKV, output, the MLP's two)."""
    return 4 * shape.d_model * shape.d_model + 2 * shape.d_model * shape.d_ff


def matmul_params(shape: GPTNeoXConfig) -> int:
    """Weights that take part in a matmul for every token (biases and norms are negligible): the
    N of 6N."""
    return shape.n_layers * block_matmul_params(shape) + shape.vocab_size * shape.d_model


def block_forward_flops(shape: GPTNeoXConfig, tokens: int, seq_len: int) -> float:
    """One block's forward for `tokens` tokens in sequences of `seq_len`: its matmuls and the
    attention products (QK^T and AV, 2·s·d each per token). What recomputing a block repeats."""
    return (2.0 * block_matmul_params(shape) + 4.0 * seq_len * shape.d_model) * tokens


def head_forward_flops(shape: GPTNeoXConfig, tokens: int) -> float:
    return 2.0 * shape.vocab_size * shape.d_model * tokens


def flops_per_token(shape: GPTNeoXConfig, seq_len: int) -> float:
    """Model FLOPs for one trained token (forward + backward), attention included."""
    return 6.0 * matmul_params(shape) + 12.0 * shape.n_layers * shape.d_model * seq_len


def static_bytes(shape: GPTNeoXConfig, optimizer: str = "adamw", offload: bool = False) -> dict[str, float]:
    """Device bytes that do not depend on the activation plan, by kind."""
    n = count_parameters(shape)["total"]
    out = {"weights": float(WEIGHT_BYTES * n), "gradients": float(GRAD_BYTES * n)}
    if not offload:
        out["optimizer state"] = float(OPTIMIZER_BYTES[optimizer] * n)
    return out
