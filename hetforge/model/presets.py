"""Model-size presets and the analytic parameter count.

The FORGE sizes are the published ones (Yin et al., SC'23): 1.44B, 13B and 22.4B GPT-NeoX models.
`vocab_size` here is only the default for presets used without a project tokenizer; a run takes the
vocabulary size from its tokenizer.
"""

from __future__ import annotations

PRESETS: dict[str, dict[str, int]] = {
    # CPU demo and tests: trains in minutes on two cores.
    "tiny": {"n_layers": 4, "d_model": 128, "n_heads": 4, "d_ff": 512, "vocab_size": 8192},
    # The throughput benchmark's model (6 layers, d=256).
    "small": {"n_layers": 6, "d_model": 256, "n_heads": 8, "d_ff": 1024, "vocab_size": 8192},
    # GPT-3 / Pythia "125M" class.
    "125m": {"n_layers": 12, "d_model": 768, "n_heads": 12, "d_ff": 3072, "vocab_size": 50304},
    "350m": {"n_layers": 24, "d_model": 1024, "n_heads": 16, "d_ff": 4096, "vocab_size": 50304},
    # FORGE (byte-level BPE with a ~52k vocabulary).
    "forge-s": {"n_layers": 24, "d_model": 2064, "n_heads": 24, "d_ff": 4 * 2064, "vocab_size": 52000},
    "forge-m": {"n_layers": 40, "d_model": 5120, "n_heads": 40, "d_ff": 4 * 5120, "vocab_size": 52000},
    "forge-l": {"n_layers": 48, "d_model": 6144, "n_heads": 48, "d_ff": 4 * 6144, "vocab_size": 52000},
}


def count_parameters(
    n_layers: int, d_model: int, d_ff: int, vocab_size: int, tie_embeddings: bool = False
) -> dict[str, int]:
    """Exact parameter count of hetforge's GPT-NeoX (all linears and LayerNorms carry biases).

    Returns total, embedding and non-embedding counts; FLOPs accounting uses the non-embedding one.
    """
    d, f = d_model, d_ff
    per_layer = (
        2 * 2 * d  # input + post-attention LayerNorm (weight, bias)
        + 3 * d * d + 3 * d  # fused QKV
        + d * d + d  # attention output projection
        + d * f + f  # MLP up
        + f * d + d  # MLP down
    )
    non_embedding = n_layers * per_layer + 2 * d  # + final LayerNorm
    embedding = vocab_size * d * (1 if tie_embeddings else 2)
    return {"total": non_embedding + embedding, "embedding": embedding, "non_embedding": non_embedding}
