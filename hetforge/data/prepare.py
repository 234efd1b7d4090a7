"""`hetforge prepare`: corpus -> cleaned documents -> tokenizer -> train/val token shards.

The output directory is keyed by a fingerprint of everything that determines its content (the data
config, the bytes of every source file, the tokenizer file if given, the format version): re-running
with the same inputs is a no-op, and any change rebuilds. A build is written to a temporary directory
and renamed into place, so an interrupted prepare never leaves half a dataset that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetforge.core.errors import HetforgeError
from hetforge.config import DataConfig
from hetforge.core.console import console, make_progress, warn
from hetforge.data.corpus import read_corpus, source_files
from hetforge.data.shards import write_split
from hetforge.data.tokenizer import EOT, load_tokenizer, token_dtype, tokenizer_hash, train_bpe

FORMAT_VERSION = 1
ENCODE_CHUNK = 64  # documents per encode_batch call: parallel inside, a progress tick between


class PrepareError(HetforgeError, ValueError):
    pass


@dataclass
class PrepareResult:
    out_dir: Path
    meta: dict
    cached: bool


def fingerprint(cfg: DataConfig) -> str:
    h = hashlib.sha256()
    settings = cfg.model_dump(mode="json", exclude={"out_dir"})
    h.update(json.dumps({"format": FORMAT_VERSION, "data": settings}, sort_keys=True).encode())
    for source in cfg.sources:
        for path in source_files(source):
            h.update(str(path).encode())
            try:
                with path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
            except OSError:
                h.update(b"<unreadable>")
    if cfg.tokenizer.path:
        h.update(tokenizer_hash(cfg.tokenizer.path).encode())
    return h.hexdigest()


def _is_complete(out_dir: Path, digest: str) -> dict | None:
    meta_path = out_dir / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("fingerprint") != digest:
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, info in meta["splits"].items():
        f = out_dir / f"{split}.bin"
        if not f.is_file() or f.stat().st_size != max(info["tokens"], 1) * itemsize:
            return None
    return meta


def _split_documents(n: int, val_fraction: float, seed: int, report=None) -> tuple[np.ndarray, np.ndarray]:
    if n < 2:
        why = ""
        if report is not None and (report.files_skipped or report.docs_dropped):
            parts = [f"{k} file(s) {r} (e.g. {report.skipped_examples[r][0]})" for r, k in report.files_skipped.items()]
            parts += [f"{k} document(s) {r}" for r, k in report.docs_dropped.items()]
            why = f" (skipped: {'; '.join(parts)})"
        raise PrepareError(
            f"the corpus has {n} usable document(s) after cleaning; at least 2 are needed "
            f"(one for training, one for validation){why}. Check data.sources and data.min_chars."
        )
    perm = np.random.default_rng(seed).permutation(n)
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def prepare(cfg: DataConfig, force: bool = False, progress: bool = True, verbose: bool = True) -> PrepareResult:
    out_dir = Path(cfg.out_dir)
    t0 = time.perf_counter()
    digest = fingerprint(cfg)
    if not force:
        meta = _is_complete(out_dir, digest)
        if meta is not None:
            if verbose:
                console.print(f"prepare: {out_dir} is up to date (fingerprint {digest[:12]}), nothing to do")
            return PrepareResult(out_dir, meta, cached=True)

    docs, report = read_corpus(cfg)
    for reason, count in report.files_skipped.items():
        examples = ", ".join(report.skipped_examples.get(reason, []))
        warn(f"skipped {count} file(s): {reason} (e.g. {examples})")
    if report.nul_bytes_removed:
        warn(f"removed {report.nul_bytes_removed} NUL byte(s) from {report.files_with_nul} text file(s)")
    train_idx, val_idx = _split_documents(len(docs), cfg.val_fraction, cfg.seed, report)

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if cfg.tokenizer.path:
            tok = load_tokenizer(cfg.tokenizer.path)
            shutil.copyfile(cfg.tokenizer.path, tmp / "tokenizer.json")
        else:
            with console.status(f"training byte-level BPE (vocab {cfg.tokenizer.vocab_size})"):
                tok = train_bpe(
                    (docs[i].text for i in train_idx), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency
                )
            tok.save(str(tmp / "tokenizer.json"))
        vocab_size = tok.get_vocab_size()
        dtype = token_dtype(vocab_size)
        eot = tok.token_to_id(EOT)

        splits = {}
        with make_progress(enabled=progress) as bar:
            for split, idx in (("train", train_idx), ("val", val_idx)):
                task = bar.add_task(f"tokenizing {split}", total=len(idx))
                encoded: list[np.ndarray] = []
                for start in range(0, len(idx), ENCODE_CHUNK):
                    chunk = [docs[i].text for i in idx[start : start + ENCODE_CHUNK]]
                    # encode_batch runs on all cores (Rust threads) without Python overhead.
                    for enc in tok.encode_batch(chunk, add_special_tokens=False):
                        encoded.append(np.asarray(enc.ids, dtype=dtype))
                    bar.advance(task, len(chunk))
                splits[split] = write_split(tmp, split, encoded, eot, dtype)
                splits[split]["doc_ids"] = [docs[i].doc_id for i in idx]
                splits[split]["bytes"] = int(sum(len(docs[i].text.encode("utf-8")) for i in idx))

        meta = {
            "format_version": FORMAT_VERSION,
            "fingerprint": digest,
            "tokenizer_sha256": tokenizer_hash(tmp / "tokenizer.json"),
            "vocab_size": vocab_size,
            "eot_id": eot,
            "pad_id": tok.token_to_id("<|padding|>"),
            "dtype": dtype,
            "splits": splits,
            "sources": [s.model_dump(mode="json") for s in cfg.sources],
            "report": report.to_dict(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _print_summary(out_dir, meta, time.perf_counter() - t0)
    return PrepareResult(out_dir, meta, cached=False)


def _print_summary(out_dir: Path, meta: dict, seconds: float) -> None:
    from rich.table import Table

    r = meta["report"]
    table = Table(title=f"prepared {out_dir} in {seconds:.1f}s", show_header=True)
    table.add_column("item")
    table.add_column("count", justify="right")
    table.add_row("files read", str(r["files_read"]))
    for reason, n in r["files_skipped"].items():
        table.add_row(f"files skipped: {reason}", str(n))
    for encoding, n in r.get("files_transcoded", {}).items():
        table.add_row(f"files read as {encoding} (byte-order mark)", str(n))
    if r.get("nul_bytes_removed"):
        table.add_row("NUL bytes removed (files)", f"{r['nul_bytes_removed']} ({r['files_with_nul']})")
    table.add_row("documents read", str(r["docs_read"]))
    for reason, n in r["docs_dropped"].items():
        table.add_row(f"documents dropped: {reason}", str(n))
    table.add_row("documents kept", str(r["docs_kept"]))
    for split, info in meta["splits"].items():
        table.add_row(f"{split}: documents / tokens", f"{info['documents']} / {info['tokens']:,}")
    table.add_row("vocabulary / dtype", f"{meta['vocab_size']} / {meta['dtype']}")
    console.print(table)
