"""Model-size presets: shapes (`GPTNeoXConfig`), nothing else.

The FORGE sizes are the published ones (Yin et al., SC'23): 1.44B, 13B and 22.4B GPT-NeoX models.
`vocab_size` here is only the default for presets used without a project tokenizer; a run takes the
vocabulary size from its tokenizer.
"""

from __future__ import annotations

from hetforge.model.gpt_neox import GPTNeoXConfig


def _shape(n_layers: int, d_model: int, n_heads: int, vocab_size: int) -> GPTNeoXConfig:
    return GPTNeoXConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_ff=4 * d_model, vocab_size=vocab_size)


PRESETS: dict[str, GPTNeoXConfig] = {
    # CPU demo and tests: trains in minutes on two cores.
    "tiny": _shape(4, 128, 4, 8192),
    # The throughput benchmark's model (6 layers, d=256).
    "small": _shape(6, 256, 8, 8192),
    # GPT-3 / Pythia "125M" class.
    "125m": _shape(12, 768, 12, 50304),
    "350m": _shape(24, 1024, 16, 50304),
    # FORGE (byte-level BPE with a ~52k vocabulary).
    "forge-s": _shape(24, 2064, 24, 52000),
    "forge-m": _shape(40, 5120, 40, 52000),
    "forge-l": _shape(48, 6144, 48, 52000),
}
