"""Atomic, verifiable checkpoints.

Layout: `RUN/checkpoints/step_00000100/` holding `model.safetensors` (weights), `optimizer.pt`
(optimizer + loss-scaler state), `rng.pt`, `state.json` (step, consumed samples, config) and last
`manifest.json` (size and SHA-256 of every file). A checkpoint is written under a temporary name,
fsynced, then renamed: a crash or a full disk mid-write leaves the previous checkpoint untouched, and
the half-written one is removed. On load, checkpoints are tried newest first and any whose files do
not match the manifest is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from hetforge import __version__
from hetforge.console import warn

_NAME = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(
            {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler else None},
            tmp / "optimizer.pt",
        )
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
        _write_manifest(tmp, step)
        if final.exists():  # re-saving the same step (e.g. after resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {err}") from err
    _prune(root, keep)
    return final


def _write_manifest(path: Path, step: int) -> None:
    files = {}
    for f in sorted(path.iterdir()):
        if f.name == MANIFEST:
            continue
        _fsync(f)
        files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"step": step, "hetforge_version": __version__, "files": files}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(path / MANIFEST)


def write_weights_checkpoint(path: str | Path, model: nn.Module, state: dict[str, Any]) -> Path:
    """Weights and state only (no optimizer, no RNG), with a manifest: an imported model, to
    evaluate, sample from, or start a run from (`model.init_from`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path / "model.safetensors"))
    (path / "state.json").write_text(json.dumps(state, indent=1))
    _write_manifest(path, int(state.get("step", 0)))
    return path


def _prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary directories are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def verify(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return "manifest missing or unreadable"
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {info['bytes']}"
        if _sha256(f) != info["sha256"]:
            return f"{name} checksum mismatch"
    return None


def latest_valid(root: str | Path) -> Path | None:
    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        warn(f"checkpoint {path} is corrupt ({problem}); falling back to the previous one")
    return None


def resolve(path_or_root: str | Path) -> Path:
    """Accept a checkpoint directory, a checkpoints/ directory or a run directory."""
    p = Path(path_or_root)
    if (p / MANIFEST).is_file():
        problem = verify(p)
        if problem:
            raise CheckpointError(f"checkpoint {p} is corrupt: {problem}")
        return p
    for root in (p, p / "checkpoints"):
        found = latest_valid(root) if root.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(f"no valid checkpoint found at {p}")


def load_weights(path: Path, model: nn.Module) -> None:
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if missing or unexpected:  # strict=True raises first; kept for clarity of intent
        raise CheckpointError(f"{path}: weights do not match the model ({missing=}, {unexpected=})")


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    restore_rng: bool = True,
) -> Checkpoint:
    load_weights(path, model)
    if optimizer is not None:
        load_training_state(path, optimizer, scaler, restore_rng)
    elif restore_rng:
        set_rng_state(torch.load(path / "rng.pt", map_location="cpu", weights_only=True))
    state = json.loads((path / "state.json").read_text())
    return Checkpoint(path, int(state["step"]), state)


def load_training_state(path: Path, optimizer, scaler: torch.amp.GradScaler | None = None,
                        restore_rng: bool = True) -> None:
    """Optimizer, loss scaler and RNG of a checkpoint, for an optimizer made after the weights were
    loaded (it may keep its state on the host: `HostOffloadOptimizer`)."""
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    if scaler is not None and opt["scaler"]:
        scaler.load_state_dict(opt["scaler"])
    if restore_rng:
        set_rng_state(torch.load(path / "rng.pt", map_location="cpu", weights_only=True))


def load_for_inference(path_or_run: str | Path, device: torch.device | str = "cpu"):
    """(model in eval mode, checkpoint state) from a checkpoint, checkpoints/ or run directory."""
    from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig

    path = resolve(path_or_run)
    state = json.loads((path / "state.json").read_text())
    model = GPTNeoX(GPTNeoXConfig(**state["model_config"]))
    load_weights(path, model)
    return model.to(device).eval(), {**state, "path": str(path)}
