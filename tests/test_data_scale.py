"""Data at scale: the same shards whatever the workers or tasks, resume after kill -9, MinHash
near-duplicates, weighted mixing, bounded memory on a huge document, the formats a lab has."""

import gzip
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from hetforge.config import DataConfig, SourceConfig
from hetforge.data.dedup import shingles
from hetforge.data.prepare import PrepareError, prepare, prepare_merge, prepare_task, split_for_encoding
from hetforge.data.shards import MixedOrder, PackedSamples, TokenShard, read_doc_ids
from hetforge.data.tokenizer import load_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def vocabulary(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10))) for _ in range(n)]


WORDS = vocabulary()


def text(seed: int, words: int = 250) -> str:
    """Distinct documents: random words in sentences and paragraphs (letters differ, not digits:
    MinHash folds digits)."""
    rng = random.Random(seed)
    out, sentence = [], []
    for i in range(words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(6, 14):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
        if i % 60 == 59:
            out.append("\n\n")
    out.append(" ".join(sentence) + ".")
    return " ".join(out).replace(" \n\n ", "\n\n")


def corpus(root: Path, n: int = 120) -> Path:
    """Every format: a large JSONL (cut into byte ranges), .jsonl.gz, .jsonl.zst, text files,
    parquet with several row groups, and a Hugging Face dataset saved to disk."""
    import zstandard
    from datasets import Dataset

    root.mkdir(parents=True)
    docs = [text(i) for i in range(n)]
    with (root / "big.jsonl").open("w") as f:
        for d in docs[:40]:
            f.write(json.dumps({"text": d}) + "\n")
    with gzip.open(root / "more.jsonl.gz", "wt") as f:
        for d in docs[40:55]:
            f.write(json.dumps({"text": d}) + "\n")
    (root / "more.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": d}) + "\n" for d in docs[55:70]).encode()))
    for i, d in enumerate(docs[70:80]):
        (root / f"paper{i}.txt").write_text(d)
    pq.write_table(pa.table({"text": docs[80:100]}), root / "table.parquet", row_group_size=4)
    hf = root.parent / f"{root.name}-hf"
    Dataset.from_dict({"text": docs[100:n]}).save_to_disk(str(hf))
    (root / "dup.txt").write_text(docs[3])  # an exact duplicate of a JSONL document
    return hf


def shards_digest(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "tokenizer.json"):
        h.update((out / name).read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def lab_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab") / "corpus"
    hf = corpus(root)
    return root, hf


def lab_config(lab_corpus, out: Path, **kw) -> DataConfig:
    root, hf = lab_corpus
    return DataConfig(sources=[SourceConfig(path=str(root)), SourceConfig(path=str(hf), format="hf")],
                      out_dir=str(out), tokenizer={"vocab_size": 400, "sample_bytes": "40KiB"}, chunk_bytes="16KiB",
                      min_chars=50, **kw)


@pytest.mark.slow
def test_every_format_is_read_and_the_output_is_the_same_for_1_or_2_workers_and_3_tasks(lab_corpus, tmp_path):
    one = prepare(lab_config(lab_corpus, tmp_path / "one"), progress=False)
    r = one.meta["report"]
    assert r["docs_read"] == 121 and r["docs_dropped"] == {"exact duplicate": 1} and r["docs_kept"] == 120
    assert one.meta["chunks"] >= 8  # byte ranges of big.jsonl, parquet row groups, dataset rows
    assert any("@" in d for d in read_doc_ids(one.out_dir, "train"))  # a document found inside a byte range
    assert one.meta["tokenizer_sample"]["bytes"] < 80_000  # ~40 KiB drawn, not the corpus

    two = prepare(lab_config(lab_corpus, tmp_path / "two", workers=2), progress=False)
    cfg = lab_config(lab_corpus, tmp_path / "tasks")
    for i in (2, 0, 1):  # any order, as an array job's tasks finish
        prepare_task(cfg, i, 3, progress=False)
    merged = prepare_merge(cfg, progress=False)
    assert shards_digest(one.out_dir) == shards_digest(two.out_dir) == shards_digest(merged.out_dir)
    assert one.meta["fingerprint"] == two.meta["fingerprint"] == merged.meta["fingerprint"]
    coarse = prepare(lab_config(lab_corpus, tmp_path / "coarse").model_copy(update={"chunk_bytes": "4MiB"}),
                     progress=False)
    assert shards_digest(coarse.out_dir) == shards_digest(one.out_dir)  # chunking changes nothing either
    assert not list(tmp_path.glob(".*.work-*"))  # the work directories are gone


def test_merge_before_every_task_names_what_is_missing(lab_corpus, tmp_path):
    cfg = lab_config(lab_corpus, tmp_path / "part")
    prepare_task(cfg, 0, 4, progress=False)
    with pytest.raises(PrepareError, match=r"chunk\(s\) are not encoded yet"):
        prepare_merge(cfg, progress=False)


def _prepare_cmd(cfg: DataConfig, path: Path) -> list[str]:
    path.write_text(yaml.safe_dump({"data": cfg.model_dump(mode="json")}))
    return [sys.executable, "-m", "hetforge", "prepare", str(path)]


@pytest.mark.slow
def test_killed_prepare_resumes_and_equals_an_uninterrupted_run(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    with (root / "docs.jsonl").open("w") as f:
        for i in range(600):
            f.write(json.dumps({"text": text(i, 400)}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(path=str(root))], out_dir=str(tmp_path / "killed"), chunk_bytes="32KiB",
                     tokenizer={"vocab_size": 400, "sample_bytes": "64KiB"})
    proc = subprocess.Popen(_prepare_cmd(cfg, tmp_path / "k.yaml"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 120
    done = []
    while time.time() < deadline and not done:
        done = [p for p in tmp_path.glob(".killed.work-*/chunks/*/summary.json")]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    chunks = len(list(tmp_path.glob(".killed.work-*/chunks/*/summary.json")))
    assert 0 < chunks < 60, chunks  # killed mid-way: some chunks finished, not all
    res = subprocess.run(_prepare_cmd(cfg, tmp_path / "k.yaml"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "already encoded, resuming" in res.stdout
    clean = prepare(cfg.model_copy(update={"out_dir": str(tmp_path / "clean")}), progress=False)
    killed = json.loads((tmp_path / "killed" / "meta.json").read_text())
    assert shards_digest(tmp_path / "killed") == shards_digest(clean.out_dir)
    assert killed["fingerprint"] == clean.meta["fingerprint"]


def edit(doc: str, rate: float, seed: int) -> str:
    rng = random.Random(seed)
    words = doc.split(" ")
    for i in rng.sample(range(len(words)), max(1, round(rate * len(words)))):
        words[i] = rng.choice(WORDS)
    return " ".join(words)


def jaccard(a: str, b: str, n: int = 5) -> float:
    sa, sb = set(shingles(a, n).tolist()), set(shingles(b, n).tolist())
    return len(sa & sb) / len(sa | sb)


def test_planted_near_duplicates_are_found_and_distinct_documents_kept(tmp_path):
    originals = [text(1000 + i, 300) for i in range(300)]
    rates = (0.005, 0.01, 0.02, 0.04, 0.08)  # of the words replaced: Jaccard ~0.95 down to ~0.5
    copies = [(i, r, edit(originals[i], r, i)) for k, r in enumerate(rates) for i in range(40 * k, 40 * k + 40)]
    root = tmp_path / "c"
    root.mkdir()
    with (root / "docs.jsonl").open("w") as f:
        for d in originals:
            f.write(json.dumps({"text": d}) + "\n")
        for _, _, d in copies:
            f.write(json.dumps({"text": d}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(path=str(root))], out_dir=str(tmp_path / "out"),
                     tokenizer={"vocab_size": 400}, dedup={"near": {"threshold": 0.8}})
    res = prepare(cfg, progress=False)
    kept_lines = {int(d.rsplit(":", 1)[1]) - 1 for s in ("train", "val") for d in read_doc_ids(res.out_dir, s)}
    removed = set(range(len(originals) + len(copies))) - kept_lines
    assert not removed & set(range(len(originals)))  # every distinct original is kept
    similar = {len(originals) + k for k, (i, _, d) in enumerate(copies) if jaccard(originals[i], d) >= 0.8}
    assert len(similar) >= 80  # the test plants enough pairs above the threshold to measure recall
    recall = len(similar & removed) / len(similar)
    precision = len(removed & set(range(len(originals), len(originals) + len(copies)))) / max(len(removed), 1)
    assert recall >= 0.95 and precision >= 0.99, (recall, precision)
    assert res.meta["report"]["docs_dropped"]["near duplicate"] == len(removed)
    examples = [json.loads(line) for line in (res.out_dir / "near_duplicates.jsonl").read_text().splitlines()]
    assert examples and examples[0]["kept_text"][:40] != "" and examples[0]["removed"] != examples[0]["kept"]


def test_mixing_follows_the_weights_over_any_long_window():
    counts, weights = [1000, 50_000, 7_000], [3.0, 0.5, 1.0]
    order = MixedOrder(counts, weights, seed=7)
    share = np.asarray(counts) * weights / np.dot(counts, weights)
    for start in (0, 123_457, 5_000_000):
        window = 200_000
        src = np.searchsorted(order.bases, order.indices(start, window), side="right") - 1
        got = np.bincount(src, minlength=3) / window
        assert np.all(np.abs(got - share) / share < 0.01), (got, share)
    # random access equals sequential; the same seed the same sequence; each source's epoch is a permutation
    assert MixedOrder(counts, weights, seed=7).indices(99_999, 50) == order.indices(99_999, 50)
    assert MixedOrder(counts, weights, seed=8).indices(0, 50) != order.indices(0, 50)
    first = [i for i in order.indices(0, 60_000) if i < 1000]
    assert sorted(first[:1000]) == list(range(1000))
    assert np.array_equal(order.draws(300_000), np.bincount(
        np.searchsorted(order.bases, order.indices(0, 300_000), side="right") - 1, minlength=3))


def test_weighted_sources_are_contiguous_and_windows_stay_inside_their_source(tmp_path):
    dirs = []
    for k, n in ((0, 30), (1, 6)):
        d = tmp_path / f"src{k}"
        d.mkdir()
        for i in range(n):
            (d / f"{i}.txt").write_text(text(10_000 * (k + 1) + i))
        dirs.append(d)
    cfg = DataConfig(sources=[SourceConfig(path=str(dirs[0]), weight=0.5), SourceConfig(path=str(dirs[1]), weight=4.0)],
                     out_dir=str(tmp_path / "out"), tokenizer={"vocab_size": 400})
    meta = prepare(cfg, progress=False).meta
    a, b = meta["sources"]
    assert a["train_range"][0] == 0 and a["train_range"][1] == b["train_range"][0]
    assert b["train_range"][1] == meta["splits"]["train"]["tokens"]
    assert a["mix_share"] < b["mix_share"] and a["epochs_per_pass"] == 0.5
    shard = TokenShard(tmp_path / "out", "train")
    samples = PackedSamples(shard, 16, regions=[tuple(a["train_range"]), tuple(b["train_range"])])
    last_a = samples.region_counts[0] - 1
    assert samples._start(last_a) + 17 <= a["train_range"][1] and samples._start(last_a + 1) == b["train_range"][0]


def test_long_documents_are_encoded_in_pieces_with_the_whole_documents_tokens():
    tok = train_bpe([text(i) for i in range(30)], 400)
    doc = "\n\n".join(text(500 + i, 400) for i in range(20)) + " " + "x" * 3000
    pieces = split_for_encoding(doc, 1000)
    assert "".join(pieces) == doc and max(map(len, pieces)) <= 1000 and len(pieces) > 20
    ids = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
    # the 3000-character word is the only place cut mid-word; everything before it encodes exactly
    head = doc[: doc.index(" " + "x" * 3000)]
    head_ids = tok.encode(head, add_special_tokens=False).ids
    assert ids[: len(head_ids)] == head_ids


@pytest.mark.slow
@pytest.mark.measure
def test_a_50_mb_single_line_document_prepares_in_bounded_memory(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    rng = random.Random(3)
    big = " ".join(rng.choice(WORDS) for _ in range(7_500_000))[: 50 * 2**20]
    with (root / "huge.jsonl").open("w") as f:
        f.write(json.dumps({"text": big}) + "\n")
        for i in range(4):
            f.write(json.dumps({"text": text(i)}) + "\n")
    head = big[:300]
    del big
    cfg = DataConfig(sources=[SourceConfig(path=str(root))], out_dir=str(tmp_path / "out"),
                     tokenizer={"vocab_size": 400, "sample_bytes": "8MiB"})
    _prepare_cmd(cfg, tmp_path / "c.yaml")
    # the process's own peak (`process_peak_rss_bytes`: ru_maxrss would start at pytest's) and its workers'
    code = ("import resource, sys; from hetforge.cli import main; "
            "from hetforge.core.process import process_peak_rss_bytes; rc = main(['prepare', sys.argv[1]]); "
            "print('PEAK', max(process_peak_rss_bytes() // 1024, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
            "sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.yaml")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    peak = int(res.stdout.split("PEAK")[1].split()[0]) * 1024
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["report"]["long_docs_split"] == 1 and meta["report"]["docs_kept"] == 5
    # the first wave needed 10.8 GB for this document (BPE training 4.1 GB, encode_batch 8.1 GB)
    assert peak < 2**30, f"peak RSS {peak / 2**30:.2f} GiB"
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    shard = max((TokenShard(tmp_path / "out", s) for s in ("train", "val")), key=lambda s: s.num_tokens)
    sizes = np.diff(shard.doc_offsets)
    longest = int(np.argmax(sizes))
    assert sizes[longest] > 5_000_000
    assert head.startswith(tok.decode(shard.document(longest)[:60].tolist()))
    print(f"peak RSS {peak / 2**20:.0f} MiB")


def test_a_run_on_weighted_sources_draws_them_by_weight_and_resumes_exactly(tmp_path):
    from hetforge.config import build_config
    from hetforge.core.metrics import read_metrics
    from hetforge.train.loop import train

    dirs = []
    for k, n in ((0, 40), (1, 8)):
        d = tmp_path / f"src{k}"
        d.mkdir()
        for i in range(n):
            (d / f"{i}.txt").write_text(text(20_000 * (k + 1) + i, 400))
        dirs.append(d)

    def cfg(name):
        return build_config({
            "name": name, "run_dir": str(tmp_path / name),
            "data": {"sources": [{"path": str(dirs[0]), "weight": 0.25}, {"path": str(dirs[1]), "weight": 4.0}],
                     "out_dir": str(tmp_path / "data"), "tokenizer": {"vocab_size": 400}},
            "model": {"preset": None, "n_layers": 1, "d_model": 32, "n_heads": 2},
            "train": {"steps": 6, "warmup_steps": 2, "seq_len": 32, "micro_batch_size": 4, "log_interval": 1,
                      "eval_interval": 1000, "checkpoint_interval": 3, "peak_tflops": 1.0, "tensorboard": False, "progress": False,
                      "num_threads": 1}})

    whole = cfg("whole")
    train(whole)
    start = next(e for e in read_metrics(tmp_path / "whole" / "metrics.jsonl")["event"] if e["event"] == "run_start")
    small, large = start["sources"][0], start["sources"][1]
    assert small["weight"] == 0.25 and large["weight"] == 4.0
    assert large["share"] > small["share"]  # 8 documents at weight 4 outdraw 40 at weight 1/4
    assert large["share"] == pytest.approx(large["windows"] * 4.0 / (large["windows"] * 4.0 + small["windows"] * 0.25),
                                           abs=1e-3)
    halves = cfg("halves")
    assert train(halves, stop_after=3).interrupted
    train(halves)
    a = read_metrics(tmp_path / "whole" / "metrics.jsonl")["train"]
    b = read_metrics(tmp_path / "halves" / "metrics.jsonl")["train"]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # the same samples in the same order


def test_word_hashes_are_crc32_and_their_memo_stays_bounded(monkeypatch):
    import zlib

    from hetforge.data import dedup

    small = dedup._WordHashes(limit=5)
    monkeypatch.setattr(dedup, "_WORD_HASHES", small)
    doc = text(7, 300)
    got = shingles(doc, 3)
    assert len(small) <= 5
    words = dedup._words(doc)
    h = np.array([zlib.crc32(w.encode()) for w in words], dtype=np.uint64)
    want = h[:-2] * dedup._NGRAM_MUL * dedup._NGRAM_MUL + h[1:-1] * dedup._NGRAM_MUL + h[2:]
    assert np.array_equal(got, want)
