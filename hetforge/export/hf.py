"""Hugging Face format, both ways: a hetforge checkpoint as a `GPTNeoXForCausalLM` directory that
`transformers` loads offline, and such a directory back as a hetforge checkpoint for continued
pre-training (`model.init_from`).

hetforge's parameter names and fused-QKV layout are Hugging Face's, so export is a renaming:
`gpt_neox.` in front of every block parameter, `embed_out.weight` as it is (transformers 5 maps it
to `lm_head` on load, 4 reads it directly). The config carries the rotary fraction both as v5's
`rope_parameters` and v4's `rotary_pct`; as transformers takes int(head_dim x fraction) rotary
channels with no rounding to even, the fraction is chosen so that this gives hetforge's (even)
count. Writing needs neither transformers nor a network; the tests load the result with it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hetforge.core.errors import HetforgeError
from hetforge.data.tokenizer import EOT, load_tokenizer
from hetforge.model.gpt_neox import GPTNeoXConfig


class ExportError(HetforgeError, ValueError):
    """A checkpoint or directory that cannot be converted, phrased for the user."""


def rotary_fraction(head_dim: int, rotary_dims: int, rotary_pct: float) -> float:
    """A fraction f with int(head_dim * f) == rotary_dims (the user's own where it already does)."""
    if int(head_dim * rotary_pct) == rotary_dims:
        return rotary_pct
    return (rotary_dims + 0.5) / head_dim


def hf_config(cfg: GPTNeoXConfig, eot_id: int, max_positions: int) -> dict:
    f = rotary_fraction(cfg.head_dim, cfg.rotary_dims, cfg.rotary_pct)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "gelu",  # exact (erf) GELU, as F.gelu computes
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base, "partial_rotary_factor": f},
        "rotary_pct": f,
        "rotary_emb_base": cfg.rotary_base,
        "max_position_embeddings": max_positions,
        "layer_norm_eps": cfg.norm_eps,
        "use_parallel_residual": cfg.parallel_residual,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": True,
        "attention_dropout": cfg.dropout,
        "hidden_dropout": cfg.dropout,
        "initializer_range": cfg.init_std,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write `out` as a Hugging Face GPTNeoXForCausalLM directory (config, weights, tokenizer)."""
    from hetforge.model.load import load_for_inference

    model, state = load_for_inference(checkpoint, "cpu")
    cfg = model.cfg
    tok_path = Path(state["tokenizer"])
    if not tok_path.is_file():
        raise ExportError(f"the checkpoint's tokenizer {tok_path} is missing: the export needs it")
    eot = load_tokenizer(tok_path).token_to_id(EOT)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "embed_out.weight":
            if cfg.tie_embeddings:
                continue  # transformers ties it to the input embedding itself
            tensors[name] = t
        else:
            tensors[f"gpt_neox.{name}"] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, eot, state["seq_len"]), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}, indent=1))
    shutil.copyfile(tok_path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "unk_token": EOT,
        "pad_token": EOT, "model_max_length": state["seq_len"], "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    return out


def _from_hf_config(c: dict) -> GPTNeoXConfig:
    if c.get("model_type") != "gpt_neox":
        raise ExportError(f"not a GPT-NeoX model (model_type {c.get('model_type')!r})")
    act = c.get("hidden_act", "gelu")
    if act != "gelu":
        raise ExportError(f"hidden_act {act!r}: hetforge's GPT-NeoX uses exact GELU ('gelu')")
    rope = c.get("rope_parameters") or {}
    frac = rope.get("partial_rotary_factor", c.get("rotary_pct", 0.25))
    d, heads = c["hidden_size"], c["num_attention_heads"]
    if int(d // heads * frac) % 2:
        raise ExportError(f"{int(d // heads * frac)} rotary channels per head: hetforge rotates an even number")
    return GPTNeoXConfig(
        n_layers=c["num_hidden_layers"], d_model=d, n_heads=heads, d_ff=c["intermediate_size"],
        vocab_size=c["vocab_size"], rotary_pct=float(frac),
        rotary_base=float(rope.get("rope_theta", c.get("rotary_emb_base", 10000.0))),
        parallel_residual=bool(c.get("use_parallel_residual", True)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_eps=float(c.get("layer_norm_eps", 1e-5)),
        dropout=float(c.get("hidden_dropout", 0.0)), init_std=float(c.get("initializer_range", 0.02)),
    )


def _hf_weights(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise ExportError(f"{src}: no model*.safetensors (save the model with safe_serialization=True)")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def import_hf(src: str | Path, out: str | Path) -> Path:
    """Write a Hugging Face GPTNeoX directory as a hetforge checkpoint (weights, model config and
    tokenizer) that `model.init_from`, `hetforge eval` and `hetforge generate` accept."""
    from hetforge.model.gpt_neox import GPTNeoX
    from hetforge.train.checkpoint import write_weights_checkpoint

    src = Path(src)
    if not (src / "config.json").is_file():
        raise ExportError(f"{src}: not a Hugging Face model directory (no config.json)")
    if not (src / "tokenizer.json").is_file():
        raise ExportError(f"{src}: no tokenizer.json (a fast tokenizer is needed to train on)")
    cfg = _from_hf_config(json.loads((src / "config.json").read_text()))
    state = {}
    for name, t in _hf_weights(src).items():
        if name in ("lm_head.weight", "embed_out.weight"):
            state["embed_out.weight"] = t
        elif name.startswith("gpt_neox.") and not name.endswith(("inv_freq", "attention.bias", "masked_bias")):
            state[name[len("gpt_neox."):]] = t
    model = GPTNeoX(cfg)
    if cfg.tie_embeddings:
        state.pop("embed_out.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "embed_out.weight"]
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{src}: weights do not match a GPT-NeoX of this config (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((src / "config.json").read_text())
    return write_weights_checkpoint(out, model, {
        "step": 0, "model_config": cfg.to_dict(), "tokenizer": str((out / "tokenizer.json").resolve()),
        "seq_len": int(config.get("max_position_embeddings", 2048)), "imported_from": str(src),
    })
