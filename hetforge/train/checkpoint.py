"""What a training checkpoint holds, and putting it back.

A checkpoint is self-contained: the weights (`model.safetensors`), one file per stateful component
of the run (`optimizer.pt`, `scaler.pt`, ...: whatever the loop registers, each through its
`state_dict` / `load_state_dict`), the RNG state of every rank (`rng.pt`), the tokenizer it was
trained with (`tokenizer.json`) and `state.json` (step, global sample position, model shape, data
fingerprint). `eval`, `generate` and `export` need nothing but the directory, from any working
directory. Writing, checking and finding checkpoints (manifest, checksums, atomic publish, fallback
to the previous valid one) is `hetforge.core.checkpoint_io`'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_model
from torch import nn

from hetforge import __version__
from hetforge.core.checkpoint_io import (  # noqa: F401  (the checkpoint API, in one import)
    CheckpointError,
    latest_valid,
    list_checkpoints,
    publish,
    read_state,
    remove_stale_temps,
    resolve,
    set_rng_state,
    verify,
    write_manifest,
)
from hetforge.model.load import TOKENIZER, WEIGHTS, load_for_inference, load_weights  # noqa: F401

RNG = "rng.pt"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    components: dict[str, Stateful],
    state: dict[str, Any],
    keep: int = 2,
    rng: list[dict[str, Any]] | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """Write `ROOT/step_NNNNNNNN` atomically: weights, each component, the ranks' RNG states (in
    rank order), the tokenizer and the state."""

    def write(tmp: Path) -> None:
        save_model(model, str(tmp / WEIGHTS))
        for name, comp in components.items():
            torch.save(comp.state_dict(), tmp / f"{name}.pt")
        if rng is not None:
            torch.save({"ranks": rng}, tmp / RNG)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))

    return publish(root, step, write, keep, {"hetforge_version": __version__})


def write_weights_checkpoint(path: str | Path, model: nn.Module, state: dict[str, Any],
                             tokenizer: Path | None = None) -> Path:
    """Weights, tokenizer and state only (no optimizer, no RNG), with a manifest: an imported
    model, to evaluate, sample from, or start a run from (`model.init_from`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path / WEIGHTS))
    if tokenizer is not None and Path(tokenizer).resolve() != (path / TOKENIZER).resolve():
        shutil.copyfile(tokenizer, path / TOKENIZER)
    (path / "state.json").write_text(json.dumps(state, indent=1))
    write_manifest(path, int(state.get("step", 0)), {"hetforge_version": __version__})
    return path


def load_components(path: Path, components: dict[str, Stateful], rank: int = 0, restore_rng: bool = True) -> None:
    """Each registered component from its file, and this rank's RNG state (rank 0's when the
    checkpoint was written by fewer ranks). A component the checkpoint lacks is an error: resuming
    without it would not continue the same run."""
    for name, comp in components.items():
        f = Path(path) / f"{name}.pt"
        if not f.is_file():
            raise CheckpointError(f"{path} has no {name} state ({f.name}); it was written by another kind of run")
        comp.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
    if restore_rng and (Path(path) / RNG).is_file():
        ranks = torch.load(Path(path) / RNG, map_location="cpu", weights_only=True)["ranks"]
        set_rng_state(ranks[rank] if rank < len(ranks) else ranks[0])
