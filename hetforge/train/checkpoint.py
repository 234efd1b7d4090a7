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
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_model
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hetforge import __version__
from hetforge.core.checkpoint_io import (  # noqa: F401  (the checkpoint API, in one import)
    CheckpointError,
    begin_publish,
    finish_publish,
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
from hetforge.model.load import DCP_DIR, TOKENIZER, WEIGHTS, load_for_inference, load_weights  # noqa: F401

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
        write_extras(tmp, components, state, step, rng, tokenizer)

    return publish(root, step, write, keep, {"hetforge_version": __version__})


def write_extras(tmp: Path, components: dict[str, Stateful], state: dict[str, Any], step: int,
                 rng: list[dict[str, Any]] | None, tokenizer: Path | None) -> None:
    """Everything but the weights: each component, the ranks' RNG states, the tokenizer, the state."""
    for name, comp in components.items():
        torch.save(comp.state_dict(), tmp / f"{name}.pt")
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


# --- sharded state (FSDP2 / ZeRO) ------------------------------------------------------------------
# A sharded run's weights and optimizer state go through PyTorch's distributed checkpoint (DCP)
# into `dcp/`: every rank writes its shards, and DCP's metadata lets any number and layout of ranks
# (or one process, or `eval` / `export` with no process group) read them back resharded. The
# optimizer's state is kept by parameter name, which does not depend on the sharding. A replicated
# run keeps `model.safetensors` + `optimizer.pt`; either kind resumes under either strategy.
OPTIMIZER = "optimizer.pt"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def sharded_payload(model: nn.Module, optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)["state"]}


def save_sharded(directory: Path, model: nn.Module, optimizer) -> None:
    """Every rank calls this (a collective): its shards of weights and optimizer state."""
    dcp.save(sharded_payload(model, optimizer), checkpoint_id=str(Path(directory) / DCP_DIR))


def load_model_state(path: Path, model: nn.Module, sharded: bool) -> None:
    """The checkpoint's weights into `model`, whichever kind wrote them and however `model` is
    (or is not) sharded."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        if not sharded:
            load_weights(path, model)
            return
        full = load_file(str(path / WEIGHTS))
        if model.embed_out.weight is model.embed_in.weight:  # safetensors stores a tied weight once
            for a, b in (("embed_in.weight", "embed_out.weight"), ("embed_out.weight", "embed_in.weight")):
                if a in full:
                    full.setdefault(b, full[a])
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        return
    if not (path / DCP_DIR).is_dir():
        raise CheckpointError(f"{path} holds no weights ({WEIGHTS} or {DCP_DIR}/)")
    if sharded:
        sd = get_model_state_dict(model)
        dcp.load({"model": sd}, checkpoint_id=str(path / DCP_DIR))
        set_model_state_dict(model, sd)
    else:
        load_weights(path, model)  # consolidates from the shards


def _by_name(state: dict, order: list[str]) -> dict:
    """A torch optimizer's state dict (integer keys, in `param_groups` order) keyed by name."""
    ids = [i for g in state["param_groups"] for i in g["params"]]
    name = dict(zip(ids, order))
    return {"state": {name[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}


def _by_index(named: dict[str, dict], optimizer, order: list[str]) -> dict:
    """The other way: named per-parameter state in the integer form of `optimizer`'s groups."""
    groups, i = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    return {"state": {k: named[name] for k, name in enumerate(order) if name in named}, "param_groups": groups}


def load_optimizer_state(path: Path, model: nn.Module, optimizer, order: list[str], sharded: bool) -> None:
    """The checkpoint's optimizer state into `optimizer`, across kinds of checkpoint and strategy."""
    path = Path(path)
    if (path / OPTIMIZER).is_file():
        state = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True)
        if sharded:
            set_optimizer_state_dict(model, optimizer, _by_name(state, order),
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state)
        return
    if not (path / DCP_DIR).is_dir():
        raise CheckpointError(f"{path} has no optimizer state ({OPTIMIZER} or {DCP_DIR}/); it was written by "
                              f"another kind of run")
    if sharded:
        template = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optim": template["state"]}, checkpoint_id=str(path / DCP_DIR))
        set_optimizer_state_dict(model, optimizer, template)
        return
    # A replicated optimizer (plain, on the host, or ZeRO-1) reads the whole state by name.
    params = dict(model.named_parameters())
    named = {n: {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros(params[n].shape),
                 "exp_avg_sq": torch.zeros(params[n].shape)} for n in order}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"optim": named}, checkpoint_id=str(path / DCP_DIR), no_dist=not _distributed())
    optimizer.load_state_dict(_by_index(named, optimizer, order))
