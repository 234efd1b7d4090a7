"""Training checkpoints: one format for every strategy, on PyTorch's distributed checkpoint (DCP).

A checkpoint directory holds `dcp/` (the weights under "model" and the optimizer's state under
"optim", keyed by parameter name: the same keys whatever the sharding), `scaler.pt` (the loss
scaler), `rng.pt` (every rank's RNG state, in rank order), the tokenizer it was trained with and
`state.json` (step, global sample position, model shape, data fingerprint), then `manifest.json`.
A sharded run (FSDP2) writes its shards from every rank; a replicated one (one process, DDP,
ZeRO-1 with its state gathered first) from rank 0 alone. Any run reads any checkpoint: DCP reshards
on load, to any number and layout of ranks, or to one process (`eval`, `generate` and `export` need
no process group). Writing, checking and finding checkpoints (manifest, checksums, atomic publish,
fallback to the previous valid one, stale temporary directories) is `core.checkpoint_io`'s.

Checkpoints of hetforge before this format (`model.safetensors` + `optimizer.pt`) are still read.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from hetforge import __version__
from hetforge.cluster.dist import DistContext, all_gather_object, broadcast_object, post, wait_for_main
from hetforge.core.checkpoint_io import (  # noqa: F401  (the checkpoint API, in one import)
    CheckpointError,
    begin_publish,
    finish_publish,
    latest_valid,
    list_checkpoints,
    read_state,
    remove_stale_temps,
    resolve,
    rng_state,
    set_rng_state,
    verify,
    write_manifest,
)
from hetforge.model.load import DCP_DIR, TOKENIZER, WEIGHTS, dcp_error, load_for_inference, load_weights  # noqa: F401

RNG = "rng.pt"
SCALER = "scaler.pt"
LEGACY_OPTIMIZER = "optimizer.pt"  # the format before DCP for every strategy


def _quiet():
    """DCP warns that it assumes one process when no group is initialised: here that is the intent."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
    return ctx


def save_dcp(directory: Path, payload: dict[str, Any], collective: bool) -> None:
    """`payload` into `directory/dcp`: from every rank (`collective`, a sharded state) or this one."""
    ctx = _quiet()
    try:
        dcp.save(payload, checkpoint_id=str(Path(directory) / DCP_DIR), no_dist=not collective)
    finally:
        ctx.__exit__(None, None, None)


def write_extras(tmp: Path, scaler, state: dict[str, Any], step: int, rng: list[dict[str, Any]] | None,
                 tokenizer: Path | None) -> None:
    """Everything but the weights and optimizer: the loss scaler, the ranks' RNG states, the
    tokenizer, the state."""
    if scaler is not None:
        torch.save(scaler.state_dict(), tmp / SCALER)
    if rng is not None:
        torch.save({"ranks": rng}, tmp / RNG)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / TOKENIZER)
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))


def write_weights_checkpoint(path: str | Path, model: nn.Module, state: dict[str, Any],
                             tokenizer: Path | None = None) -> Path:
    """Weights, tokenizer and state only (no optimizer, no RNG), with a manifest: an imported
    model, to evaluate, sample from, or start a run from (`model.init_from`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_dcp(path, {"model": model.state_dict()}, collective=False)
    if tokenizer is not None and Path(tokenizer).resolve() != (path / TOKENIZER).resolve():
        shutil.copyfile(tokenizer, path / TOKENIZER)
    (path / "state.json").write_text(json.dumps(state, indent=1))
    write_manifest(path, int(state.get("step", 0)), {"hetforge_version": __version__})
    return path


# --- state by name -----------------------------------------------------------------------------------
def _by_name(state: dict, order: list[str]) -> dict:
    """A torch optimizer's state dict (integer keys, in `param_groups` order) keyed by name."""
    ids = [i for g in state["param_groups"] for i in g["params"]]
    name = dict(zip(ids, order))
    return {name[i]: s for i, s in state["state"].items()}


def _by_index(named: dict[str, dict], optimizer, order: list[str]) -> dict:
    """The other way: named per-parameter state in the integer form of `optimizer`'s groups."""
    groups, i = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    return {"state": {k: named[name] for k, name in enumerate(order) if name in named}, "param_groups": groups}


def _legacy(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and not (path / DCP_DIR).is_dir()


def load_model_state(path: Path, model: nn.Module, sharded: bool) -> None:
    """The checkpoint's weights into `model`, whichever kind of run wrote them and however `model` is
    (or is not) sharded."""
    path = Path(path)
    if not sharded:
        load_weights(path, model)  # consolidates a sharded run's weights, reads the old format too
        return
    if _legacy(path):
        full = load_file(str(path / WEIGHTS))
        if model.embed_out.weight is model.embed_in.weight:  # safetensors stores a tied weight once
            for a, b in (("embed_in.weight", "embed_out.weight"), ("embed_out.weight", "embed_in.weight")):
                if a in full:
                    full.setdefault(b, full[a])
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        return
    if not (path / DCP_DIR).is_dir():
        raise CheckpointError(f"{path} holds no weights ({DCP_DIR}/)")
    sd = get_model_state_dict(model)
    dcp.load({"model": sd}, checkpoint_id=str(path / DCP_DIR))
    set_model_state_dict(model, sd)


def load_optimizer_state(path: Path, model: nn.Module, optimizer, order: list[str], sharded: bool) -> None:
    """The checkpoint's optimizer state into `optimizer` (on the device, on the host, ZeRO-1's or
    FSDP2's), whichever kind of run wrote it."""
    path = Path(path)
    if (path / LEGACY_OPTIMIZER).is_file():
        named = _by_name(torch.load(path / LEGACY_OPTIMIZER, map_location="cpu", weights_only=True), order)
    elif (path / DCP_DIR).is_dir():
        if sharded:  # each rank reads its shards into the layout FSDP2 gives it
            template = get_optimizer_state_dict(model, optimizer)
            dcp.load({"optim": template["state"]}, checkpoint_id=str(path / DCP_DIR))
            set_optimizer_state_dict(model, optimizer, template)
            return
        ctx = _quiet()
        try:  # a replicated optimizer (plain, on the host, or ZeRO-1) reads the whole state by name
            named = _load_state_dict_from_keys({"optim"}, checkpoint_id=str(path / DCP_DIR))["optim"]
        except (KeyError, RuntimeError, CheckpointException) as err:
            raise CheckpointError(f"{path} has no optimizer state ({dcp_error(err)[:120]}); it holds "
                                  f"weights only: start a run from it with model.init_from") from None
        finally:
            ctx.__exit__(None, None, None)
    else:
        raise CheckpointError(f"{path} has no optimizer state; start a run from it with model.init_from")
    if sharded:
        set_optimizer_state_dict(model, optimizer, {"state": named, "param_groups": _by_name_groups(optimizer, order)},
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(_by_index(named, optimizer, order))


def _by_name_groups(optimizer, order: list[str]) -> list[dict]:
    groups, i = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": order[i:i + n]})
        i += n
    return groups


def find_checkpoint(root: Path, ctx: DistContext, resume: str, warn) -> Path | None:
    """The newest valid checkpoint under `root` (rank 0 looks, after removing what dead writers
    left; every rank gets its answer). `resume`: auto, always (none is an error) or never."""
    if ctx.is_main:
        for stale in remove_stale_temps(root):
            warn(f"removed {stale}, a checkpoint whose writer died mid-write")
    if resume == "never":
        return None
    found = broadcast_object(ctx, latest_valid(root, warn) if ctx.is_main else None)
    if found is None and resume == "always":
        raise CheckpointError(f"--resume given but {root} holds no valid checkpoint")
    return found


class CheckpointManager:
    """Reading and writing one run's training state on every rank of it."""

    def __init__(self, root: Path, ctx: DistContext, keep: int, sharded: bool):
        self.root, self.ctx, self.keep, self.sharded = Path(root), ctx, keep, sharded
        self._written = 0

    def load_training(self, path: Path, model: nn.Module, optimizer, order: list[str], scaler) -> None:
        """Optimizer, loss scaler and this rank's RNG state (rank 0's where fewer ranks wrote it)."""
        load_optimizer_state(path, model, optimizer, order, self.sharded)
        if scaler is not None:
            if not (path / SCALER).is_file():
                raise CheckpointError(f"{path} has no loss-scaler state ({SCALER}); it was written by another kind "
                                      f"of run: start a run from its weights with model.init_from")
            scaler.load_state_dict(torch.load(path / SCALER, map_location="cpu", weights_only=True))
        if (path / RNG).is_file():
            ranks = torch.load(path / RNG, map_location="cpu", weights_only=True)["ranks"]
            set_rng_state(ranks[self.ctx.rank] if self.ctx.rank < len(ranks) else ranks[0])

    def save(self, step: int, model: nn.Module, optimizer, order: list[str], scaler, state: dict[str, Any],
             tokenizer: Path | None) -> tuple[Path | None, str | None]:
        """Write `ROOT/step_NNNNNNNN` (every rank calls this): rank 0 opens the temporary directory,
        the state goes in through DCP, rank 0 adds the rest and the manifest and publishes it
        atomically. Returns (the checkpoint, None) or (None, why it failed) on every rank alike."""
        ctx = self.ctx
        rngs = all_gather_object(ctx, rng_state())
        self._written += 1
        key = f"checkpoint/{self._written}"  # the others wait through the store: a long write is no hang
        tmp, lock, error = None, None, None
        if ctx.is_main:
            try:
                tmp, lock = begin_publish(self.root, step)
            except CheckpointError as err:
                error = str(err)
        tmp, error = self._share(key + "/dir", tmp, error)
        if error is not None:
            return None, error
        failed: BaseException | None = None
        try:
            payload = self._payload(model, optimizer, order)
            if self.sharded or ctx.is_main:
                save_dcp(tmp, payload, collective=self.sharded)
        except (OSError, RuntimeError, CheckpointException) as err:  # DCP raises on every rank when any failed
            failed = RuntimeError(dcp_error(err)) if isinstance(err, CheckpointException) else err
        path = None
        if ctx.is_main:
            try:
                if failed is None:
                    write_extras(tmp, scaler, state, step, rngs, tokenizer)
            except (OSError, RuntimeError) as err:
                failed = err
            try:
                path = finish_publish(self.root, step, tmp, lock, self.keep,
                                      {"hetforge_version": __version__, "format": "dcp"}, failed)
            except CheckpointError as err:
                error = str(err)
        return self._share(key, path, error)

    def _payload(self, model: nn.Module, optimizer, order: list[str]) -> dict:
        """What goes through DCP from this rank: its shards, or (replicated) everything on rank 0."""
        if self.sharded:
            return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)["state"]}
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: every rank sends its part to rank 0
            optimizer.consolidate_state_dict(to=0)
        if not self.ctx.is_main:
            return {}
        return {"model": model.state_dict(), "optim": _by_name(optimizer.state_dict(), order)}

    def _share(self, key: str, path: Path | None, error: str | None) -> tuple[Path | None, str | None]:
        """Rank 0's outcome, posted to the others through the store."""
        if not self.ctx.distributed:
            return path, error
        if self.ctx.is_main:
            post(self.ctx, key, json.dumps([str(path) if path else None, error]))
            return path, error
        written, error = json.loads(wait_for_main(self.ctx, key, "writing a checkpoint"))
        return (Path(written) if written else None), error


def read_tensors(path: str | Path, key: str = "model") -> dict[str, Any]:
    """A checkpoint's weights ("model") or optimizer state by parameter name ("optim"), whole, in
    this process, whatever wrote them: for inspection and comparisons."""
    path = resolve(path)
    if _legacy(path):
        if key == "model":
            return load_file(str(path / WEIGHTS))
        raise CheckpointError(f"{path}: an old-format checkpoint's optimizer state is read by a run resuming from it")
    ctx = _quiet()
    try:
        return _load_state_dict_from_keys({key}, checkpoint_id=str(path / DCP_DIR))[key]
    except (KeyError, RuntimeError, CheckpointException) as err:
        raise CheckpointError(f"{path} holds no {key!r} state ({dcp_error(err)[:120]})") from None
    finally:
        ctx.__exit__(None, None, None)
