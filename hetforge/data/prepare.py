"""`hetforge prepare`: corpus -> cleaned, deduplicated documents -> tokenizer -> token shards.

Streaming and in bounded memory, in four stages over the chunks of `data.chunks`:

1. tokenizer: each chunk draws a seeded sample of its documents (by a keyed hash of the raw
   text, at a rate per source that makes about `data.tokenizer.sample_bytes` in all, in proportion
   to bytes x weight); the BPE trains on the sample through the `tokenizers` iterator trainer.
2. chunks: each chunk is read, cleaned, filtered, exact-hashed, MinHash-signed (datatrove) and
   encoded on its own, by `data.workers` processes or by `--task i/N` jobs on many machines; a
   finished chunk is renamed into place, so a killed prepare resumes at the next chunk.
3. dedup: exact duplicates (first occurrence in corpus order kept) and near-duplicate clusters
   (datatrove's buckets and clusters; the first kept member stays).
4. merge: the kept documents' tokens are copied, in corpus order, into `train.bin` / `val.bin`
   (the split drawn from the seed over the kept documents), sources contiguous, and `meta.json`.

Nothing in the output depends on the number of workers or tasks: chunks are cut from the files
alone, and each decision is a function of the corpus order. The output directory is written under
a temporary name and renamed; `meta.json` records `inputs_key` (paths, sizes, mtimes, settings: is
the output up to date?) and `fingerprint` (the settings, every document's raw text and the
tokenizer: what checkpoints compare).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from hetforge.core.checkpoint_io import remove_dead_temps, temp_dir
from hetforge.core.console import console, make_progress, warn
from hetforge.core.errors import HetforgeError
from hetforge.core.sizes import format_bytes, parse_size
from hetforge.data.chunks import Chunk, Plan, iter_chunk, plan_chunks
from hetforge.data.corpus import CorpusReport, clean_text
from hetforge.data.tokenizer import EOT, load_tokenizer, token_dtype, tokenizer_hash, train_bpe

if TYPE_CHECKING:
    from hetforge.config import DataConfig

FORMAT_VERSION = 2
# Text per encode_batch call (parallel over its documents inside). While it works the tokenizer
# holds ~150 bytes per character (offsets and alignments per byte, token strings): these bound it.
ENCODE_BATCH_CHARS = 1 << 20
ENCODE_PIECE_CHARS = 1 << 17  # a long document is encoded in pieces this long, a few at a time
LONG_GROUP_CHARS = 1 << 18
SAMPLE_PIECE_CHARS = 1 << 17  # the BPE trainer's memory grows with the longest sequence it is given


class PrepareError(HetforgeError, ValueError):
    pass


@dataclass
class PrepareResult:
    out_dir: Path
    meta: dict
    cached: bool


# --- settings the workers need (plain data: they import neither torch nor the config) ----------
def _settings(cfg: "DataConfig") -> dict:
    from hetforge.data.dedup import resolve_bands

    near = cfg.dedup.near
    bands, rows = resolve_bands(near) if near.enabled else (0, 0)
    return {
        "normalize": cfg.normalize, "min_chars": cfg.min_chars, "max_doc_chars": cfg.max_doc_chars,
        "long_docs": cfg.long_docs, "text_fields": [s.text_field for s in cfg.sources],
        "near": {"bands": bands, "rows": rows, "ngram": near.ngram, "seed": near.seed} if near.enabled else None,
        "seed": cfg.seed,
    }


def _inputs_key(cfg: "DataConfig", plan: Plan) -> str:
    h = hashlib.sha256()
    settings = cfg.model_dump(mode="json", exclude={"out_dir", "workers"})
    h.update(json.dumps({"format": FORMAT_VERSION, "data": settings, "files": plan.inputs_key()}).encode())
    if cfg.tokenizer.path:
        h.update(tokenizer_hash(cfg.tokenizer.path).encode())
    return h.hexdigest()


def _is_complete(out_dir: Path, key: str) -> dict | None:
    meta_path = out_dir / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("inputs_key") != key:
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, info in meta["splits"].items():
        f = out_dir / f"{split}.bin"
        if not f.is_file() or f.stat().st_size != max(info["tokens"], 1) * itemsize:
            return None
    return meta


_LOCKS: dict[Path, int | None] = {}  # temporary directory -> the lock this process holds on it


def _atomic_dir(final: Path) -> Path:
    """A temporary directory to fill and publish as `final` whole; a writer killed meanwhile leaves
    it to the next start, which removes it (`core.checkpoint_io.remove_dead_temps`)."""
    tmp, _LOCKS[tmp] = temp_dir(final)
    return tmp


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    lock = _LOCKS.pop(tmp, None)
    if lock is not None:
        os.close(lock)


def split_for_encoding(text: str, limit: int) -> list[str]:
    """Pieces of at most `limit` characters, cut where a run of whitespace starts (a paragraph
    break, else after a sentence, else between words): byte-level BPE never merges across such a
    cut, so the pieces' tokens are the whole text's. Only a text with no space in `limit` characters
    is cut mid-word."""
    return list(iter_pieces(text, limit))


def iter_pieces(text: str, limit: int) -> Iterator[str]:
    pos = 0
    while len(text) - pos > limit:
        lo, hi = pos + limit // 2, pos + limit
        cut = -1
        for sep, shift in (("\n\n", 0), (". ", 1), ("\n", 0), (" ", 0)):
            i = text.rfind(sep, lo, hi)
            while i > lo and text[i + shift - 1].isspace():  # the start of the whitespace run
                i -= 1
            if i > lo and not text[i + shift - 1].isspace():
                cut = i + shift
                break
        cut = cut if cut > pos else hi
        yield text[pos:cut]
        pos = cut
    yield text[pos:]


def _clean_docs(chunk: Chunk, settings: dict, report: CorpusReport) -> Iterator[tuple[str, str]]:
    """(doc id, cleaned text) of the documents the filters keep; the rest counted."""
    for doc in iter_chunk(chunk, settings["text_fields"][chunk.source], report):
        report.docs_read += 1
        doc_id, text = doc.doc_id, clean_text(doc.text, settings["normalize"])
        del doc  # a 50 MB document: its raw text goes now
        if not text:
            report.docs_dropped["empty"] += 1
            continue
        if len(text) < settings["min_chars"]:
            report.docs_dropped[f"shorter than min_chars={settings['min_chars']}"] += 1
            continue
        yield doc_id, text


# --- stage 1: the tokenizer's sample -------------------------------------------------------------
def _sampled(raw: str, seed: int, rate: float) -> bool:
    if rate >= 1.0:
        return True
    h = hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") < rate * 2**64


def sample_chunk(chunk_d: dict, settings: dict, rate: float, out_path: str) -> dict:
    """Write this chunk's share of the tokenizer sample (JSON lines of text pieces)."""
    chunk = Chunk.from_dict(chunk_d)
    report = CorpusReport()
    n_bytes = n_docs = 0
    tmp = Path(out_path + f".tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for doc in iter_chunk(chunk, settings["text_fields"][chunk.source], report):
            long = len(doc.text) > SAMPLE_PIECE_CHARS
            if not long and not _sampled(doc.text, settings["seed"], rate):
                continue
            text = clean_text(doc.text, settings["normalize"])
            del doc
            if len(text) < max(settings["min_chars"], 1):
                continue
            text = text[: settings["max_doc_chars"]] if settings["long_docs"] == "truncate" else text
            drawn = 0
            # a long document is sampled piece by piece: one 50 MB document is not 50 MB of sample
            for piece in iter_pieces(text, SAMPLE_PIECE_CHARS):
                if not long or _sampled(piece, settings["seed"], rate):
                    f.write(json.dumps(piece) + "\n")
                    drawn += len(piece.encode("utf-8"))
            n_bytes += drawn
            n_docs += drawn > 0
    os.replace(tmp, out_path)
    return {"bytes": n_bytes, "documents": n_docs}


def _sample_texts(paths: list[Path]) -> Iterator[str]:
    for p in paths:
        with p.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def _with_end(items: Iterator) -> Iterator:
    yield from items
    yield None


# --- stage 2: one chunk -------------------------------------------------------------------------
_TOKENIZER = None


def _init_worker(threads: int | None) -> None:
    if threads:
        os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the tokenizer first runs in parallel


def _tokenizer(path: str):
    global _TOKENIZER
    if _TOKENIZER is None or _TOKENIZER[0] != path:
        _TOKENIZER = (path, load_tokenizer(path))
    return _TOKENIZER[1]


def encode_chunk(chunk_d: dict, settings: dict, tokenizer_path: str, dtype: str, work: str) -> dict:
    """Clean, filter, hash, sign and encode one chunk into work/chunks/NNNNNN (renamed into place
    when whole). Returns its summary."""
    from hetforge.data.dedup import content_hash, make_signer

    chunk = Chunk.from_dict(chunk_d)
    final = Path(work) / "chunks" / f"{chunk.index:06d}"
    tmp = _atomic_dir(final)
    tok = _tokenizer(tokenizer_path)
    report = CorpusReport()
    lengths: list[int] = []
    hashes: list[bytes] = []
    nbytes: list[int] = []
    ids_out = (tmp / "doc_ids.txt").open("w", encoding="utf-8")
    tokens_out = (tmp / "tokens.bin").open("wb")
    long_split = long_truncated = 0
    batch: list[str] = []
    batch_chars = 0

    def flush() -> None:
        nonlocal batch, batch_chars
        for enc in tok.encode_batch(batch, add_special_tokens=False) if batch else []:
            tokens_out.write(np.asarray(enc.ids, dtype=dtype).tobytes())
            lengths.append(len(enc.ids))
        batch, batch_chars = [], 0

    def encode_long(text: str) -> None:
        """A few pieces at a time, each written as it comes: neither the pieces nor the tokens are
        ever all in memory."""
        total = 0
        group: list[str] = []
        for piece in _with_end(iter_pieces(text, ENCODE_PIECE_CHARS)):
            if piece is None or (group and sum(map(len, group)) + len(piece) > LONG_GROUP_CHARS):
                for e in tok.encode_batch(group, add_special_tokens=False):
                    tokens_out.write(np.asarray(e.ids, dtype=dtype).tobytes())
                    total += len(e.ids)
                group = []
            if piece is not None:
                group.append(piece)
        lengths.append(total)

    def kept() -> Iterator:
        nonlocal batch_chars, long_split, long_truncated
        from datatrove.data import Document as DTDocument

        for k, (doc_id, text) in enumerate(_clean_docs(chunk, settings, report)):
            if len(text) > settings["max_doc_chars"]:
                if settings["long_docs"] == "truncate":
                    text, long_truncated = split_for_encoding(text, settings["max_doc_chars"])[0], long_truncated + 1
                else:
                    long_split += 1
                    flush()  # keep the order: what waits is encoded first
                    encode_long(text)
            if len(text) <= settings["max_doc_chars"]:
                batch.append(text)
                batch_chars += len(text)
                if batch_chars >= ENCODE_BATCH_CHARS:
                    flush()
            digest, size = content_hash(text)
            hashes.append(digest)
            nbytes.append(size)
            ids_out.write(doc_id.replace("\n", " ") + "\n")
            yield DTDocument(text=text, id=str(k))

    near = settings["near"]
    if near:
        signer = make_signer(Path(work) / "minhash" / "sigs", near["bands"], near["rows"], near["ngram"], near["seed"])
        signer.run(kept(), rank=chunk.index)
    else:
        for _ in kept():
            pass
    flush()
    tokens_out.close()
    ids_out.close()
    report.docs_kept = len(lengths)
    summary = {"index": chunk.index, "source": chunk.source, "documents": len(lengths), "tokens": int(sum(lengths)),
               "bytes": int(sum(nbytes)), "long_split": long_split, "long_truncated": long_truncated,
               "report": report.to_dict()}
    _write_chunk(tmp, final, lengths, hashes, nbytes, summary)
    return summary


def _write_chunk(tmp: Path, final: Path, lengths: list[int], hashes: list[bytes], nbytes: list[int],
                 summary: dict) -> None:
    """A chunk's per-document arrays and summary beside its tokens, then the chunk renamed into place."""
    np.save(tmp / "lengths.npy", np.asarray(lengths, dtype=np.int64))
    np.save(tmp / "hashes.npy", np.frombuffer(b"".join(hashes), dtype=np.uint64).reshape(-1, 2))
    np.save(tmp / "bytes.npy", np.asarray(nbytes, dtype=np.int64))
    (tmp / "summary.json").write_text(json.dumps(summary))
    _publish(tmp, final)


# --- running chunks on workers ------------------------------------------------------------------
class Workers:
    """`n` encoding processes (spawned: each sets its own tokenizer thread count, and none inherits
    the parent's threads), shared by the sampling and encoding stages. With n = 1 the work runs
    in this process, with the tokenizer's own threads. A script that calls `prepare` with more than
    one worker needs the usual `if __name__ == "__main__":` guard (spawned processes import it)."""

    def __init__(self, n: int):
        self.n = n
        self.pool = None

    def __enter__(self) -> "Workers":
        if self.n > 1:
            threads = max(1, (os.cpu_count() or 1) // self.n)
            self.pool = ProcessPoolExecutor(max_workers=self.n, mp_context=get_context("spawn"),
                                            initializer=_init_worker, initargs=(threads,))
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def run(self, jobs: list[tuple[Callable, tuple, int]], progress: bool, label: str) -> list:
        """Each job is (function, args, weight for the progress bar); results in job order."""
        results: list = [None] * len(jobs)
        with make_progress(enabled=progress) as bar:
            task = bar.add_task(label, total=sum(w for _, _, w in jobs) or 1)
            if self.pool is None:
                for i, (fn, args, weight) in enumerate(jobs):
                    results[i] = fn(*args)
                    bar.advance(task, weight)
                return results
            pending = {}
            queue = list(enumerate(jobs))
            while queue or pending:
                while queue and len(pending) < 2 * self.n:  # bounded: never the whole plan in flight
                    i, (fn, args, weight) = queue.pop(0)
                    pending[self.pool.submit(fn, *args)] = (i, weight)
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    i, weight = pending.pop(fut)
                    results[i] = fut.result()
                    bar.advance(task, weight)
        return results


def _work_dir(cfg: "DataConfig", key: str) -> Path:
    out = Path(cfg.out_dir)
    return out.parent / f".{out.name}.work-{key[:16]}"


def _ensure_tokenizer(cfg: "DataConfig", plan: Plan, work: Path, settings: dict, workers: Workers,
                      progress: bool) -> Path:
    path = work / "tokenizer.json"
    if path.is_file():
        return path
    if cfg.tokenizer.path:
        load_tokenizer(cfg.tokenizer.path)  # a clear error if it is not one
        shutil.copyfile(cfg.tokenizer.path, f"{path}.tmp-{os.getpid()}")
        os.replace(f"{path}.tmp-{os.getpid()}", path)
        return path
    target = parse_size(cfg.tokenizer.sample_bytes)
    weighted = [b * s.weight for b, s in zip(plan.source_bytes, cfg.sources)]
    rates = [min(1.0, target * w / sum(weighted) / max(b, 1)) if sum(weighted) else 1.0
             for w, b in zip(weighted, plan.source_bytes)]
    sample_dir = work / "sample"
    sample_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(sample_chunk, (c.to_dict(), settings, rates[c.source], str(sample_dir / f"{c.index:06d}.jsonl")),
             max(c.size, 1)) for c in plan.chunks]
    t0 = time.perf_counter()
    drawn = workers.run(jobs, progress, "sampling for the tokenizer")
    files = [sample_dir / f"{c.index:06d}.jsonl" for c in plan.chunks]
    sample_bytes = sum(d["bytes"] for d in drawn)
    with console.status(f"training byte-level BPE (vocab {cfg.tokenizer.vocab_size}) on "
                        f"{format_bytes(sample_bytes)} from {sum(d['documents'] for d in drawn)} documents"):
        tok = train_bpe(_sample_texts(files), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
    tok.save(f"{path}.tmp-{os.getpid()}")
    os.replace(f"{path}.tmp-{os.getpid()}", path)
    (work / "tokenizer_sample.json").write_text(json.dumps(
        {"bytes": sample_bytes, "documents": sum(d["documents"] for d in drawn), "rates": rates,
         "seconds": round(time.perf_counter() - t0, 2)}))
    shutil.rmtree(sample_dir, ignore_errors=True)
    return path


def _chunk_done(work: Path, index: int) -> bool:
    return (work / "chunks" / f"{index:06d}" / "summary.json").is_file()


def _encode_chunks(cfg: "DataConfig", plan: Plan, work: Path, settings: dict, tokenizer_path: Path,
                   indices: list[int], workers: Workers, progress: bool) -> None:
    dtype = token_dtype(load_tokenizer(tokenizer_path).get_vocab_size())
    todo = [plan.chunks[i] for i in indices if not _chunk_done(work, i)]
    if len(todo) < len(indices):
        console.print(f"prepare: {len(indices) - len(todo)} of {len(indices)} chunk(s) already encoded, resuming")
    jobs = [(encode_chunk, (c.to_dict(), settings, str(tokenizer_path), dtype, str(work)), max(c.size, 1))
            for c in todo]
    workers.run(jobs, progress, "cleaning, deduplicating, encoding")


# --- stages 3 and 4: dedup and merge ------------------------------------------------------------
def _split_documents(n: int, val_fraction: float, seed: int, report: dict | None = None) -> np.ndarray:
    """Boolean mask over the kept documents, in corpus order: True = validation."""
    if n < 2:
        why = ""
        if report is not None and (report["files_skipped"] or report["docs_dropped"]):
            parts = [f"{k} file(s) {r} (e.g. {report['skipped_examples'][r][0]})" for r, k in report["files_skipped"].items()]
            parts += [f"{k} document(s) {r}" for r, k in report["docs_dropped"].items()]
            why = f" (skipped: {'; '.join(parts)})"
        raise PrepareError(
            f"the corpus has {n} usable document(s) after cleaning; at least 2 are needed "
            f"(one for training, one for validation){why}. Check data.sources and data.min_chars."
        )
    perm = np.random.default_rng(seed).permutation(n)
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    is_val = np.zeros(n, dtype=bool)
    is_val[perm[:n_val]] = True
    return is_val


def _merge_reports(plan: Plan, summaries: list[dict]) -> dict:
    total = CorpusReport()
    total.files_skipped.update(plan.report.files_skipped)
    total.skipped_examples = {k: list(v) for k, v in plan.report.skipped_examples.items()}
    for s in summaries:
        r = s["report"]
        total.files_read += r["files_read"]
        total.docs_read += r["docs_read"]
        total.files_skipped.update(r["files_skipped"])
        for reason, ex in r["skipped_examples"].items():
            total.skipped_examples.setdefault(reason, [])
            total.skipped_examples[reason] = (total.skipped_examples[reason] + ex)[:5]
        total.docs_dropped.update(r["docs_dropped"])
        total.files_transcoded.update(r["files_transcoded"])
        total.nul_bytes_removed += r["nul_bytes_removed"]
        total.files_with_nul += r["files_with_nul"]
        total.files_truncated += r.get("files_truncated", 0)
        total.truncated_examples = (total.truncated_examples + r.get("truncated_examples", []))[:5]
    return total.to_dict()


def _doc_text(plan: Plan, settings: dict, chunk: int, index: int) -> str:
    """One kept document's cleaned text, read again (for the report's examples)."""
    for k, (_, text) in enumerate(_clean_docs(plan.chunks[chunk], settings, CorpusReport())):
        if k == index:
            return text
    return ""


def _merge(cfg: "DataConfig", plan: Plan, work: Path, key: str, settings: dict, progress: bool,
           timings: dict | None = None) -> tuple[dict, float]:
    """Every encoded chunk into the output: duplicates dropped across chunks, documents split into
    train and val, the shards, the index and meta.json written into a temporary directory and
    published whole."""
    missing = [c.index for c in plan.chunks if not _chunk_done(work, c.index)]
    if missing:
        raise PrepareError(f"prepare --merge: {len(missing)} of {len(plan.chunks)} chunk(s) are not encoded yet "
                           f"(e.g. chunk {missing[0]}); run the remaining `hetforge prepare CONFIG --task i/N` first")
    t0 = time.perf_counter()
    chunk_dirs = [work / "chunks" / f"{c.index:06d}" for c in plan.chunks]
    summaries = [json.loads((d / "summary.json").read_text()) for d in chunk_dirs]
    report = _merge_reports(plan, summaries)
    report["docs_dropped"] = dict(report["docs_dropped"])
    kept, examples = _deduplicate(cfg, plan, work, settings, chunk_dirs, summaries, report)
    n = int(sum(k.sum() for k in kept))
    report["docs_kept"] = n
    is_val = _split_documents(n, cfg.val_fraction, cfg.seed, report)

    tok_path = work / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    dtype = token_dtype(tok.get_vocab_size())
    out_dir = Path(cfg.out_dir)
    tmp = _atomic_dir(out_dir)
    splits, per_source = _write_shards(cfg, tmp, chunk_dirs, summaries, kept, is_val, dtype,
                                       tok.token_to_id(EOT), progress)
    shutil.copyfile(tok_path, tmp / "tokenizer.json")
    weighted = sum(src["tokens"]["train"] * s.weight for src, s in zip(per_source, cfg.sources)) or 1
    sources = [{**s.model_dump(mode="json"), "documents": src["documents"], "bytes": src["bytes"],
                "tokens": src["tokens"], "train_range": src["train_range"] or [0, 0],
                "mix_share": src["tokens"]["train"] * s.weight / weighted, "epochs_per_pass": s.weight}
               for src, s in zip(per_source, cfg.sources)]
    report["long_docs_split"] = sum(s["long_split"] for s in summaries)
    report["long_docs_truncated"] = sum(s["long_truncated"] for s in summaries)
    report["near_duplicate_examples"] = examples
    sample = json.loads((work / "tokenizer_sample.json").read_text()) if (work / "tokenizer_sample.json").is_file() else None
    near = settings["near"]
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": _fingerprint(cfg, chunk_dirs, kept, tok_path),
        "inputs_key": key,
        "tokenizer_sha256": tokenizer_hash(tmp / "tokenizer.json"),
        "tokenizer_sample": sample,
        "vocab_size": tok.get_vocab_size(),
        "eot_id": tok.token_to_id(EOT),
        "pad_id": tok.token_to_id("<|padding|>"),
        "dtype": dtype,
        "splits": splits,
        "sources": sources,
        "dedup": {"exact": cfg.dedup.exact, "near": {**near, "threshold": cfg.dedup.near.threshold} if near else None},
        "chunks": len(plan.chunks),
        "seconds": {**(timings or {}), "merge": round(time.perf_counter() - t0, 2)},
        "report": report,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if examples:
        with (tmp / "near_duplicates.jsonl").open("w", encoding="utf-8") as f:
            for e in examples:
                f.write(json.dumps(e) + "\n")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _publish(tmp, out_dir)
    return meta, time.perf_counter() - t0


def _deduplicate(cfg: "DataConfig", plan: Plan, work: Path, settings: dict, chunk_dirs: list[Path],
                 summaries: list[dict], report: dict) -> tuple[list[np.ndarray], list[dict]]:
    """Per chunk, which of its documents stay: the first of each exact hash in corpus order, then
    the first member of each near-duplicate cluster (datatrove's) that exact dedup kept; and a few
    removed pairs as examples for the report."""
    from hetforge.data.dedup import first_of_each_cluster, near_duplicate_clusters

    counts = [s["documents"] for s in summaries]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    kept = [np.ones(n, dtype=bool) for n in counts]
    if cfg.dedup.exact and starts[-1]:
        hashes = np.concatenate([np.load(d / "hashes.npy") for d in chunk_dirs])
        _, first = np.unique(hashes, axis=0, return_index=True)
        keep_all = np.zeros(len(hashes), dtype=bool)
        keep_all[first] = True
        del hashes
        kept = [keep_all[a:b].copy() for a, b in zip(starts[:-1], starts[1:])]
        n_exact = int(len(keep_all) - keep_all.sum())
        if n_exact:
            report["docs_dropped"]["exact duplicate"] = n_exact
    examples = []
    near = settings["near"]
    if near:
        with console.status("finding near-duplicates (MinHash-LSH)"):
            clusters = near_duplicate_clusters(work / "minhash" / "sigs", work / "minhash", near["bands"], near["rows"],
                                               near["ngram"], near["seed"])
        remove, pairs = first_of_each_cluster(clusters, dict(enumerate(kept)))
        for c, docs in remove.items():
            kept[c][docs] = False
        n_near = sum(len(v) for v in remove.values())
        if n_near:
            report["docs_dropped"]["near duplicate"] = n_near
        for (ca, da), (cb, db) in pairs[:5]:
            ids = [(chunk_dirs[c] / "doc_ids.txt").read_text().splitlines()[d] for c, d in ((ca, da), (cb, db))]
            examples.append({"kept": ids[0], "removed": ids[1], "kept_text": _doc_text(plan, settings, ca, da)[:300],
                             "removed_text": _doc_text(plan, settings, cb, db)[:300]})
    return kept, examples


def _write_shards(cfg: "DataConfig", tmp: Path, chunk_dirs: list[Path], summaries: list[dict],
                  kept: list[np.ndarray], is_val: np.ndarray, dtype: str, eot: int,
                  progress: bool) -> tuple[dict, list[dict]]:
    """The kept documents of every chunk, in corpus order, each followed by the end-of-text token,
    into train.bin / val.bin with their document ids and index; per split its size, per source its
    documents, bytes, tokens and its range of train positions."""
    eot_bytes = np.asarray([eot], dtype=dtype).tobytes()
    files = {s: (tmp / f"{s}.bin").open("wb") for s in ("train", "val")}
    ids_files = {s: (tmp / f"{s}.doc_ids.txt").open("w", encoding="utf-8") for s in ("train", "val")}
    lengths: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    per_source = [{"documents": 0, "bytes": 0, "tokens": {"train": 0, "val": 0}, "train_range": None}
                  for _ in cfg.sources]
    position, split_bytes, g = {"train": 0, "val": 0}, {"train": 0, "val": 0}, 0
    with make_progress(enabled=progress) as bar:
        task = bar.add_task("writing shards", total=len(chunk_dirs))
        for d, s, keep in zip(chunk_dirs, summaries, kept):
            src = per_source[s["source"]]
            if src["train_range"] is None:
                src["train_range"] = [position["train"], position["train"]]
            lens = np.load(d / "lengths.npy")
            offs = np.concatenate([[0], np.cumsum(lens)])
            nb = np.load(d / "bytes.npy")
            tokens = np.fromfile(d / "tokens.bin", dtype=dtype) if offs[-1] else np.empty(0, dtype=dtype)
            doc_ids = (d / "doc_ids.txt").read_text(encoding="utf-8").splitlines()
            val_here = is_val[g:g + int(keep.sum())]
            g += int(keep.sum())
            for split_name, mask in (("train", ~val_here), ("val", val_here)):
                idx = np.flatnonzero(keep)[mask]
                f = files[split_name]
                for i in idx.tolist():
                    f.write(tokens[offs[i]:offs[i + 1]].tobytes())
                    f.write(eot_bytes)
                    ids_files[split_name].write(doc_ids[i] + "\n")
                lengths[split_name].append(lens[idx] + 1)
                added = int((lens[idx] + 1).sum())
                position[split_name] += added
                src["tokens"][split_name] += added
                src["documents"] += len(idx)
                src["bytes"] += int(nb[idx].sum())
                split_bytes[split_name] += int(nb[idx].sum())
            src["train_range"][1] = position["train"]
            del tokens
            bar.advance(task)
    for f in (*files.values(), *ids_files.values()):
        f.close()
    splits = {}
    for split_name in ("train", "val"):
        lens = np.concatenate(lengths[split_name]) if lengths[split_name] else np.empty(0, np.int64)
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        np.save(tmp / f"{split_name}.idx.npy", offsets)
        if offsets[-1] == 0:  # an empty memmap cannot exist: one padding token, not counted
            np.zeros(1, dtype=dtype).tofile(tmp / f"{split_name}.bin")
        splits[split_name] = {"tokens": int(offsets[-1]), "documents": int(len(lens)), "file": f"{split_name}.bin",
                              "bytes": split_bytes[split_name]}
    return splits, per_source


def _fingerprint(cfg: "DataConfig", chunk_dirs: list[Path], kept: list[np.ndarray], tok_path: Path) -> str:
    """What the shards are a function of: the settings, every document the filters kept in corpus
    order and what became of it, and the tokenizer."""
    fp = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "settings": cfg.model_dump(
        mode="json", exclude={"out_dir", "workers", "chunk_bytes"})}, sort_keys=True).encode())
    for d in chunk_dirs:
        fp.update(np.load(d / "hashes.npy").tobytes())
    fp.update(np.packbits(np.concatenate(kept) if kept else np.empty(0, bool)).tobytes())
    fp.update(tokenizer_hash(tok_path).encode())
    return fp.hexdigest()


# --- entry points -------------------------------------------------------------------------------
def _setup(cfg: "DataConfig") -> tuple[Plan, str, Path, dict]:
    plan = plan_chunks(cfg.sources, int(parse_size(cfg.chunk_bytes)))
    if not plan.chunks:
        _split_documents(0, cfg.val_fraction, cfg.seed, plan.report.to_dict())
    key = _inputs_key(cfg, plan)
    return plan, key, _work_dir(cfg, key), _settings(cfg)


def _cached(cfg: "DataConfig", verbose: bool) -> tuple[PrepareResult | None, Plan, str, Path, dict]:
    """The output where it is up to date; else what there is to do, in a work directory made now
    (not before: an up-to-date prepare leaves nothing behind). What a killed prepare was writing
    (a partial output, partial chunks) goes first."""
    plan, key, work, settings = _setup(cfg)
    out = Path(cfg.out_dir)
    for stale in remove_dead_temps(out.parent, out.name):
        warn(f"removed {stale}, a partial output a killed prepare left")
    remove_dead_temps(work / "chunks")
    meta = _is_complete(out, key)
    if meta is not None:
        if verbose:
            console.print(f"prepare: {cfg.out_dir} is up to date (fingerprint {meta['fingerprint'][:12]}), nothing to do")
        return PrepareResult(out, meta, cached=True), plan, key, work, settings
    work.mkdir(parents=True, exist_ok=True)
    return None, plan, key, work, settings


def _finish(cfg: "DataConfig", plan: Plan, key: str, work: Path, settings: dict, progress: bool, t0: float,
            timings: dict | None = None) -> PrepareResult:
    meta, _ = _merge(cfg, plan, work, key, settings, progress, timings)
    out = Path(cfg.out_dir)
    for stale in out.parent.glob(f".{out.name}.work-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for reason, count in meta["report"]["files_skipped"].items():
        examples = ", ".join(meta["report"]["skipped_examples"].get(reason, []))
        warn(f"skipped {count} file(s): {reason} (e.g. {examples})")
    r = meta["report"]
    if r["nul_bytes_removed"]:
        warn(f"removed {r['nul_bytes_removed']} NUL byte(s) from {r['files_with_nul']} file(s)")
    if r.get("files_truncated"):
        warn(f"{r['files_truncated']} compressed file(s) end early (cut short): their complete lines before the cut "
             f"were kept (e.g. {', '.join(r['truncated_examples'])})")
    for reason in ("bad JSON line", "not UTF-8"):
        if r["docs_dropped"].get(reason):
            warn(f"dropped {r['docs_dropped'][reason]} document(s): {reason}")
    _print_summary(out, meta, time.perf_counter() - t0)
    return PrepareResult(out, meta, cached=False)


def prepare(cfg: "DataConfig", force: bool = False, progress: bool = True, verbose: bool = True,
            workers: int | None = None) -> PrepareResult:
    """The whole preparation on this machine: `workers` processes (default data.workers)."""
    t0 = time.perf_counter()
    if force:
        _remove_output(cfg)
    cached, plan, key, work, settings = _cached(cfg, verbose)
    if cached is not None:
        return cached
    timings = {}
    with Workers(workers or cfg.workers) as pool:
        t = time.perf_counter()
        tok = _ensure_tokenizer(cfg, plan, work, settings, pool, progress)
        timings["tokenizer"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        _encode_chunks(cfg, plan, work, settings, tok, list(range(len(plan.chunks))), pool, progress)
        timings["chunks"] = round(time.perf_counter() - t, 2)
    return _finish(cfg, plan, key, work, settings, progress, t0, timings)


def prepare_task(cfg: "DataConfig", task: int, tasks: int, progress: bool = True, workers: int | None = None) -> int:
    """Task `task` of `tasks` (a Slurm array job, say): encodes chunks task, task + tasks, ...
    The tokenizer is trained first if no task has yet (every task trains the same one)."""
    if not 0 <= task < tasks:
        raise PrepareError(f"prepare --task {task}/{tasks}: the task index must be in 0..{tasks - 1}")
    cached, plan, key, work, settings = _cached(cfg, True)
    if cached is not None:
        return 0
    mine = list(range(task, len(plan.chunks), tasks))
    with Workers(workers or cfg.workers) as pool:
        tok = _ensure_tokenizer(cfg, plan, work, settings, pool, progress)
        _encode_chunks(cfg, plan, work, settings, tok, mine, pool, progress)
    console.print(f"prepare: task {task}/{tasks} encoded {len(mine)} of {len(plan.chunks)} chunk(s) in {work}")
    return len(mine)


def prepare_merge(cfg: "DataConfig", progress: bool = True) -> PrepareResult:
    """After every task: dedup across all chunks and write the shards."""
    t0 = time.perf_counter()
    cached, plan, key, work, settings = _cached(cfg, True)
    if cached is not None:
        return cached
    if not (work / "tokenizer.json").is_file():
        raise PrepareError("prepare --merge: no task has run yet (no tokenizer in the work directory "
                           f"{work}); run `hetforge prepare CONFIG --task i/N` for every i first")
    return _finish(cfg, plan, key, work, settings, progress, t0)


def _remove_output(cfg: "DataConfig") -> None:
    out = Path(cfg.out_dir)
    if (out / "meta.json").is_file():
        shutil.rmtree(out)
    for stale in out.parent.glob(f".{out.name}.work-*"):
        shutil.rmtree(stale, ignore_errors=True)


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
    if r.get("files_truncated"):
        table.add_row("files cut short (complete lines kept)", str(r["files_truncated"]))
    table.add_row("documents read", str(r["docs_read"]))
    for reason, n in r["docs_dropped"].items():
        table.add_row(f"documents dropped: {reason}", str(n))
    if r.get("long_docs_split"):
        table.add_row("documents encoded in pieces (longer than max_doc_chars)", str(r["long_docs_split"]))
    if r.get("long_docs_truncated"):
        table.add_row("documents truncated to max_doc_chars", str(r["long_docs_truncated"]))
    table.add_row("documents kept", str(r["docs_kept"]))
    for split, info in meta["splits"].items():
        table.add_row(f"{split}: documents / tokens", f"{info['documents']} / {info['tokens']:,}")
    if len(meta["sources"]) > 1:
        for i, s in enumerate(meta["sources"]):
            table.add_row(f"source {i} ({s.get('path') or s['type']}): train tokens, weight, share",
                          f"{s['tokens']['train']:,}, {s['weight']:g}, {s['mix_share']:.1%}")
    if meta.get("tokenizer_sample"):
        table.add_row("tokenizer sample", format_bytes(meta["tokenizer_sample"]["bytes"]))
    table.add_row("vocabulary / dtype", f"{meta['vocab_size']} / {meta['dtype']}")
    console.print(table)
    if r.get("near_duplicate_examples"):
        console.print(f"near-duplicate examples: {out_dir / 'near_duplicates.jsonl'}")
