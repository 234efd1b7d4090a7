"""A model from a checkpoint directory: its shape from `state.json`, its weights, its tokenizer."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_model
from torch import nn

from hetforge.core.checkpoint_io import CheckpointError, read_state, resolve
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig

WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
DCP_DIR = "dcp"  # a sharded run's weights and optimizer state (torch.distributed.checkpoint)


def load_weights(path: Path, model: nn.Module) -> None:
    """The checkpoint's weights into `model` (an unsharded one); a model of another shape is the
    user's error. A sharded run's checkpoint is consolidated here from its shards, in this one
    process: `eval`, `generate` and `export` need neither its world size nor a process group."""
    if not (Path(path) / WEIGHTS).is_file() and (Path(path) / DCP_DIR).is_dir():
        _load_sharded(Path(path), model)
        return
    try:
        load_model(model, str(Path(path) / WEIGHTS), strict=True)
    except RuntimeError as err:  # size mismatch or missing / unexpected keys
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "size mismatch" in ln or "Missing" in ln or "Unexpected" in ln),
                      lines[0] if lines else "")
        raise CheckpointError(f"{path}: the weights do not fit this model ({detail[:200]})") from None


def _load_sharded(path: Path, model: nn.Module) -> None:
    sd = model.state_dict()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": sd}, checkpoint_id=str(path / DCP_DIR),
                     no_dist=not (dist.is_available() and dist.is_initialized()))
    except (RuntimeError, ValueError, KeyError, CheckpointException) as err:
        raise CheckpointError(f"{path}: the weights do not fit this model ({dcp_error(err)[:200]})") from None
    model.load_state_dict(sd)


def dcp_error(err: BaseException) -> str:
    """The first underlying error of a DCP failure (which wraps every rank's traceback), in one line."""
    if isinstance(err, CheckpointException) and err.failures:
        cause = next(iter(err.failures.values()))
        err = cause[0] if isinstance(cause, tuple) else cause
    return " ".join(str(err).split())


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
