"""Checkpoint directories on disk: written whole or not at all, checked before they are trusted.

Layout: `ROOT/step_00000100/` with any files its writer puts there and last `manifest.json` (size
and SHA-256 of every file). A checkpoint is written into a temporary directory next to it, every
file fsynced, then renamed into place: a crash or a full disk mid-write leaves the previous
checkpoint untouched, and the half-written one is removed (at once when the write fails, on the
next start when the writer was killed: a writer holds a lock on its temporary directory, so one
nobody holds is a dead writer's, from whatever host or PID). Readers try checkpoints newest first and skip any whose
files do not match the manifest. This module knows files, not models: what goes into the
directory is the writer's (`hetforge.train.checkpoint`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from hetforge.core.console import warn
from hetforge.core.errors import HetforgeError

_NAME = re.compile(r"^step_(\d{8})$")
_TEMP = re.compile(r"^\.step_(\d{8})\.tmp-(?P<host>.+)-(?P<pid>\d+)$")
MANIFEST = "manifest.json"


class CheckpointError(HetforgeError, RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `path` whole or not at all: into a temporary file of this process and thread next to
    it, then renamed over it. Ranks on one host may write the same file at once (a profile cache
    keyed by what was measured): each renames its own whole copy, the last one stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _temp_dir(root: Path, step: int) -> Path:
    return Path(root) / f".step_{step:08d}.tmp-{socket.gethostname()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _lock_dir(path: Path, blocking: bool) -> int | None:
    """An exclusive flock on the directory itself: held by its writer for the whole write, and
    released by the kernel however the writer ends (a kill -9 included), so a directory nobody
    holds is a dead writer's whatever its PID became since. None where the file system has no
    flock; raises BlockingIOError when a live writer holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    return fd


def _writer_is_gone(path: Path, host: str, pid: int) -> bool:
    try:
        fd = _lock_dir(path, blocking=False)
    except BlockingIOError:
        return False  # a live writer (this run's or another's) holds it
    except OSError:  # vanished meanwhile
        return False
    if fd is not None:
        os.close(fd)
        return True
    # no flock here: judge by the PID, on this host only
    return host == socket.gethostname() and (pid == os.getpid() or not _alive(pid))


_ANY_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>[^/]+)-(?P<pid>\d+)$")


def temp_dir(final: Path) -> tuple[Path, int | None]:
    """A fresh temporary directory beside `final` (`.NAME.tmp-HOST-PID`) and the lock its writer
    holds on it until it is renamed into place or the writer dies (`remove_dead_temps`)."""
    tmp = Path(final).parent / f".{Path(final).name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp, _lock_dir(tmp, blocking=True)


def remove_dead_temps(parent: str | Path, name: str | None = None) -> list[Path]:
    """Remove the temporary directories of `name` (any name: None), as `temp_dir` makes them, under
    `parent` whose writer is gone, from any host and PID; one a live process is writing stays."""
    parent = Path(parent)
    removed = []
    for p in sorted(parent.glob(f".{name or '*'}.tmp-*")) if parent.is_dir() else []:
        m = _ANY_TEMP.match(p.name)
        if m and m["name"] == (name or m["name"]) and p.is_dir() and _writer_is_gone(p, m["host"], int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def remove_stale_temps(root: str | Path) -> list[Path]:
    """Remove the temporary directories of writers that died mid-write, from any host and PID; one
    a live process is writing stays (its writer holds a lock on it). Returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        m = _TEMP.match(p.name)
        if m and p.is_dir() and _writer_is_gone(p, m["host"], int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def write_manifest(path: Path, step: int, extra: dict[str, Any] | None = None) -> None:
    """Every file of the directory, sub-directories included (a sharded checkpoint's `dcp/`)."""
    files = {}
    for f in sorted(path.rglob("*")):
        if f.name == MANIFEST or not f.is_file():
            continue
        fsync(f)
        files[f.relative_to(path).as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    (path / MANIFEST).write_text(json.dumps({"step": step, **(extra or {}), "files": files}, indent=1))
    fsync(path / MANIFEST)


def begin_publish(root: str | Path, step: int) -> tuple[Path, int]:
    """(a fresh temporary directory for checkpoint `step`, the lock its writer holds on it until
    `finish_publish`): when several processes write one checkpoint (sharded state), the main one
    begins and finishes, and all write in between."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = _temp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        return tmp, _lock_dir(tmp, blocking=True)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {step_dir(root, step)}: {' '.join(str(err).split())}") from err


def finish_publish(root: str | Path, step: int, tmp: Path, lock: int | None, keep: int,
                   manifest_extra: dict[str, Any] | None = None, failed: BaseException | None = None) -> Path:
    """Manifest, atomic rename to `ROOT/step_NNNNNNNN`, old checkpoints pruned to `keep`; with
    `failed` (a writer's error), the temporary directory is removed and the error raised."""
    root = Path(root)
    final = step_dir(root, step)
    try:
        if failed is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(failed, (OSError, RuntimeError)):
                raise failed
            raise CheckpointError(f"could not write checkpoint {final}: {' '.join(str(failed).split())}") from failed
        write_manifest(tmp, step, manifest_extra)
        if final.exists():  # re-saving the same step (e.g. after resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync(root)
    except CheckpointError:
        raise
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {' '.join(str(err).split())}") from err
    finally:
        if lock is not None:
            os.close(lock)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def publish(root: str | Path, step: int, write: Callable[[Path], None], keep: int,
            manifest_extra: dict[str, Any] | None = None) -> Path:
    """`write(tmp)` fills a temporary directory; it becomes `ROOT/step_NNNNNNNN` atomically, with
    its manifest, and only the newest `keep` checkpoints stay."""
    tmp, lock = begin_publish(root, step)
    failed = None
    try:
        write(tmp)
    except BaseException as err:  # noqa: BLE001  (removed and raised again by finish_publish)
        failed = err
    return finish_publish(root, step, tmp, lock, keep, manifest_extra, failed)


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
        files = manifest["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return "manifest missing or unreadable"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {info['bytes']}"
        if sha256_file(f) != info["sha256"]:
            return f"{name} checksum mismatch"
    return None


def latest_valid(root: str | Path, warn: Callable[[str], None] | None = warn) -> Path | None:
    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        if warn is not None:
            warn(f"checkpoint {path} is corrupt ({problem}); falling back to the previous one")
    return None


def resolve(path_or_root: str | Path, warn: Callable[[str], None] | None = warn) -> Path:
    """Accept a checkpoint directory, a checkpoints/ directory or a run directory."""
    p = Path(path_or_root)
    if (p / MANIFEST).is_file():
        problem = verify(p)
        if problem:
            raise CheckpointError(f"checkpoint {p} is corrupt: {problem}")
        return p
    for root in (p, p / "checkpoints"):
        found = latest_valid(root, warn) if root.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(f"no valid checkpoint found at {p}")


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: state.json unreadable ({err.__class__.__name__})") from None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
