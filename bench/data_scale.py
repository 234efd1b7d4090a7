"""Data preparation at scale on this machine: memory against corpus size, throughput against the
tokenizer's own limit, near-duplicate recall and precision.

1. Synthetic corpora of 100 MB, 300 MB and 1 GB (JSONL files of 64 MB; documents of varied
   length made of Zipf-distributed invented words in sentences and paragraphs, with numbers and
   formulae: varied text, not a repeated string) are prepared by `hetforge prepare` with one
   worker; the peak RSS of each (the whole process tree, sampled every 50 ms) is printed.
   Goal: peak(1 GB) / peak(100 MB) <= 1.2.
2. Throughput (MB of input per second, the whole prepare: sampling and training the tokenizer,
   cleaning, exact and near-duplicate detection, encoding, writing) with 1 and 2 workers on the
   300 MB corpus, and the limit: the same tokenizer's raw `encode_batch` over the same documents
   with all cores (what encoding alone costs, with nothing else done). Goal: 2 workers >= 0.8 of it.
3. Near-duplicates: 3,000 distinct documents and 1,500 edited copies (1/2/4/8/16% of words
   replaced); recall over the copies whose true 5-gram Jaccard similarity is >= the threshold,
   precision = removed documents that are planted copies / all removed.

    .venv/bin/python bench/data_scale.py            # ~15 minutes on 2 cores, ~4 GB of disk
    .venv/bin/python bench/data_scale.py --quick    # 20 / 60 / 200 MB

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.data.dedup import shingles  # noqa: E402
from hetforge.data.shards import read_doc_ids  # noqa: E402
from hetforge.data.tokenizer import load_tokenizer  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
MB = 1_000_000
FILE_BYTES = 64 * MB


def invented_words(n: int, rng: np.random.Generator) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(2, 12, n)
    return np.array(["".join(rng.choice(letters, k)) for k in lengths])


class TextMaker:
    """Documents from a Zipf vocabulary: sentences of 6-30 words, paragraphs of 3-8 sentences,
    with numbers, units and the odd formula, lengths log-normal around 4 KB."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.words = invented_words(30_000, self.rng)
        ranks = np.arange(1, len(self.words) + 1)
        p = 1.0 / ranks**1.05
        self.cdf = np.cumsum(p / p.sum())

    def document(self) -> str:
        rng = self.rng
        target = int(np.clip(rng.lognormal(np.log(4000), 0.8), 300, 200_000))
        n_words = target // 7
        ids = np.searchsorted(self.cdf, rng.random(n_words))
        words = self.words[np.minimum(ids, len(self.words) - 1)].tolist()
        out, i = [], 0
        while i < len(words):
            paragraph = []
            for _ in range(rng.integers(3, 9)):
                k = int(rng.integers(6, 31))
                sent = words[i:i + k]
                i += k
                if not sent:
                    break
                if rng.random() < 0.3:
                    sent.insert(int(rng.integers(0, len(sent))), f"{rng.normal(300, 80):.1f} K")
                if rng.random() < 0.05:
                    sent.append(f"(E = {rng.integers(1, 9)}.{rng.integers(0, 99):02d} eV)")
                paragraph.append(" ".join(sent).capitalize() + ".")
            out.append(" ".join(paragraph))
        return "\n\n".join(out)


def make_corpus(root: Path, total: int, seed: int) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    maker = TextMaker(seed)
    written, part = 0, 0
    while written < total:
        with (root / f"part-{part:04d}.jsonl").open("w") as f:
            size = 0
            while size < FILE_BYTES and written + size < total:
                line = json.dumps({"text": maker.document()}) + "\n"
                f.write(line)
                size += len(line)
        written += size
        part += 1
    return sorted(str(p) for p in root.glob("*.jsonl"))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total = 0
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(d.name))
            except (OSError, IndexError):
                pass
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_prepare(config: dict, work: Path, name: str) -> dict:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"data": config}))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hetforge", "prepare", str(path)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out[-3000:]}")
    meta = json.loads((Path(config["out_dir"]) / "meta.json").read_text())
    return {"seconds": seconds, "peak_rss": peak[0], "meta": meta}


def corpus_bytes(files: list[str]) -> int:
    return sum(Path(f).stat().st_size for f in files)


def tokenizer_limit(files: list[str], tokenizer: Path) -> float:
    """MB/s of the same tokenizer's encode_batch over the same documents, all cores, nothing else."""
    tok = load_tokenizer(tokenizer)
    texts, size = [], 0
    for f in files:
        with open(f) as fh:
            for line in fh:
                texts.append(json.loads(line)["text"])
    size = sum(len(t.encode()) for t in texts)
    t0 = time.perf_counter()
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= 1 << 20:
            tok.encode_batch(batch, add_special_tokens=False)
            batch, chars = [], 0
    if batch:
        tok.encode_batch(batch, add_special_tokens=False)
    return size / MB / (time.perf_counter() - t0)


def edit(doc: str, rate: float, rng: random.Random, words: list[str]) -> str:
    toks = doc.split(" ")
    for i in rng.sample(range(len(toks)), max(1, round(rate * len(toks)))):
        toks[i] = rng.choice(words)
    return " ".join(toks)


def near_duplicates(work: Path, threshold: float) -> dict:
    maker = TextMaker(99)
    originals = []
    while len(originals) < 3000:
        d = maker.document()
        if 1500 < len(d) < 20_000:
            originals.append(d)
    rng = random.Random(5)
    vocab = maker.words.tolist()
    rates = (0.01, 0.02, 0.04, 0.08, 0.16)
    copies = [(i, edit(originals[i], r, rng, vocab)) for k, r in enumerate(rates) for i in range(300 * k, 300 * k + 300)]
    root = work / "neardup"
    root.mkdir()
    with (root / "docs.jsonl").open("w") as f:
        for d in originals + [c for _, c in copies]:
            f.write(json.dumps({"text": d}) + "\n")
    out = work / "neardup-out"
    run_prepare({"sources": [{"path": str(root)}], "out_dir": str(out), "tokenizer": {"vocab_size": 1024},
                 "dedup": {"near": {"threshold": threshold}}}, work, "neardup")
    kept = {int(d.rsplit(":", 1)[1]) - 1 for s in ("train", "val") for d in read_doc_ids(out, s)}
    n = len(originals)
    removed = set(range(n + len(copies))) - kept

    def jac(a: str, b: str) -> float:
        sa, sb = set(shingles(a, 5).tolist()), set(shingles(b, 5).tolist())
        return len(sa & sb) / len(sa | sb)

    similar = {n + k for k, (i, c) in enumerate(copies) if jac(originals[i], c) >= threshold}
    planted = set(range(n, n + len(copies)))
    by_rate = {}
    for k, r in enumerate(rates):
        ids = set(range(n + 300 * k, n + 300 * k + 300))
        by_rate[str(r)] = round(len(ids & removed) / 300, 3)
    return {"recall": len(similar & removed) / max(len(similar), 1),
            "precision": len(removed & planted) / max(len(removed), 1),
            "pairs_above_threshold": len(similar), "originals_removed": len(removed & set(range(n))),
            "found_by_edit_rate": by_rate}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    args = ap.parse_args()
    sizes = (20 * MB, 60 * MB, 200 * MB) if args.quick else (100 * MB, 300 * MB, 1000 * MB)
    work = Path(tempfile.mkdtemp(prefix="hetforge-data-"))
    figures: dict = {}
    base = {"tokenizer": {"vocab_size": 16384, "sample_bytes": "64MiB"}, "min_chars": 200}
    try:
        corpora = {}
        for size in sizes:
            t0 = time.perf_counter()
            corpora[size] = make_corpus(work / f"corpus-{size // MB}", size, seed=size)
            print(f"generated {corpus_bytes(corpora[size]) / MB:.0f} MB in {time.perf_counter() - t0:.0f}s", flush=True)
        runs = {}
        for size in sizes:
            cfg = {**base, "sources": [{"path": str(work / f"corpus-{size // MB}")}],
                   "out_dir": str(work / f"out-{size // MB}-w1"), "workers": 1}
            runs[size] = run_prepare(cfg, work, f"w1-{size // MB}")
            mb = corpus_bytes(corpora[size]) / MB
            r = runs[size]
            print(f"{mb:.0f} MB, 1 worker: {r['seconds']:.0f}s ({mb / r['seconds']:.2f} MB/s), peak RSS "
                  f"{r['peak_rss'] / 2**20:.0f} MiB, stages {r['meta']['seconds']}, kept "
                  f"{r['meta']['report']['docs_kept']} of {r['meta']['report']['docs_read']} documents", flush=True)
        small, mid, large = sizes
        figures["peak_rss_mib"] = {str(s // MB): round(runs[s]["peak_rss"] / 2**20) for s in sizes}
        figures["rss_ratio_1g_100m"] = runs[large]["peak_rss"] / runs[small]["peak_rss"]
        mid_mb = corpus_bytes(corpora[mid]) / MB
        figures["mb_per_s_1_worker"] = mid_mb / runs[mid]["seconds"]
        def two_workers(name: str, **over) -> dict:
            """The mid-size corpus prepared by 2 workers into out-MB-NAME."""
            return run_prepare({**base, **over, "sources": [{"path": str(work / f"corpus-{mid // MB}")}],
                                "out_dir": str(work / f"out-{mid // MB}-{name}"), "workers": 2}, work, name)

        two = two_workers("w2")
        figures["mb_per_s_2_workers"] = mid_mb / two["seconds"]
        same = (work / f"out-{mid // MB}-w1" / "train.bin").read_bytes() == (work / f"out-{mid // MB}-w2" / "train.bin").read_bytes()
        figures["same_output_1_and_2_workers"] = same
        figures["peak_rss_2_workers_mib"] = round(two["peak_rss"] / 2**20)
        figures["stages_2_workers_s"] = two["meta"]["seconds"]
        limit = tokenizer_limit(corpora[mid], work / f"out-{mid // MB}-w1" / "tokenizer.json")
        figures["tokenizers_limit_mb_per_s"] = limit
        figures["vs_tokenizers_limit"] = figures["mb_per_s_2_workers"] / limit
        figures["vs_tokenizers_limit_1_worker"] = figures["mb_per_s_1_worker"] / limit
        # the same with exact dedup only: what MinHash signing costs beside encoding
        exact = two_workers("w2-exact", dedup={"near": {"enabled": False}})
        figures["mb_per_s_2_workers_exact_only"] = mid_mb / exact["seconds"]
        figures["vs_tokenizers_limit_exact_only"] = figures["mb_per_s_2_workers_exact_only"] / limit
        print(f"{mid_mb:.0f} MB: 1 worker {figures['mb_per_s_1_worker']:.2f} MB/s | 2 workers "
              f"{figures['mb_per_s_2_workers']:.2f} MB/s (peak RSS {figures['peak_rss_2_workers_mib']} MiB, "
              f"stages {two['meta']['seconds']}) | raw encode_batch {limit:.2f} MB/s | "
              f"2 workers / limit {figures['vs_tokenizers_limit']:.2f} (goal >= 0.8); same output: {same}; without "
              f"near-dup {figures['mb_per_s_2_workers_exact_only']:.2f} MB/s "
              f"({figures['vs_tokenizers_limit_exact_only']:.2f} of the limit)", flush=True)
        nd = near_duplicates(work, 0.8)
        figures["neardup_recall"], figures["neardup_precision"] = nd["recall"], nd["precision"]
        figures["neardup"] = nd
        print(f"near-duplicates at threshold 0.8: recall {nd['recall']:.3f} over {nd['pairs_above_threshold']} planted "
              f"pairs above it, precision {nd['precision']:.3f}, originals removed {nd['originals_removed']}; found by "
              f"edit rate {nd['found_by_edit_rate']}", flush=True)
        print(f"peak RSS: {figures['peak_rss_mib']} MiB; 1 GB / 100 MB = {figures['rss_ratio_1g_100m']:.2f} "
              f"(goal <= 1.2)", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    def r4(v):
        return round(v, 4) if isinstance(v, float) else v

    record({"bench": "data_scale", **{k: r4(v) for k, v in figures.items()}}, save=not args.quick)


if __name__ == "__main__":
    main()
