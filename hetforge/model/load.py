"""A model from a checkpoint directory: its shape from `state.json`, its weights, its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from torch import nn

from hetforge.core.checkpoint_io import CheckpointError, read_state, resolve
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig

WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"


def load_weights(path: Path, model: nn.Module) -> None:
    """The checkpoint's weights into `model`; a model of another shape is the user's error."""
    try:
        load_model(model, str(Path(path) / WEIGHTS), strict=True)
    except RuntimeError as err:  # size mismatch or missing / unexpected keys
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "size mismatch" in ln or "Missing" in ln or "Unexpected" in ln),
                      lines[0] if lines else "")
        raise CheckpointError(f"{path}: the weights do not fit this model ({detail[:200]})") from None


def model_shape(state: dict[str, Any], path: Path) -> GPTNeoXConfig:
    try:
        return GPTNeoXConfig(**state["model_config"])
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: state.json has no readable model_config ({err})") from None


def load_for_inference(path_or_run: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict]:
    """(model in eval mode, checkpoint state) from a checkpoint, checkpoints/ or run directory. The
    state's `tokenizer` is the checkpoint's own copy, so this works from any directory."""
    path = resolve(path_or_run)
    state = read_state(path)
    model = GPTNeoX(model_shape(state, path))
    load_weights(path, model)
    tok = path / TOKENIZER
    if not tok.is_file():
        raise CheckpointError(f"{path} carries no {TOKENIZER} (written by an older hetforge); train or export it again")
    return model.to(device).eval(), {**state, "path": str(path), "tokenizer": str(tok)}
