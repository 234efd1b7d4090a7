"""Duplicate removal: exact (a 128-bit hash of the cleaned text) and near (MinHash-LSH).

Near-duplicates run on HF datatrove's MinHash pipeline: its signature step writes, per chunk and
band, sorted signature files; its bucket step finds the documents that share a band (a merge of
sorted files, in bounded memory); its cluster step joins them into clusters. Two things are ours:
the shingles (words: lower-cased letter/digit runs, digits folded to 0, hashed with CRC-32 and
combined into n-grams with numpy instead of a Python call per n-gram) and a signature computed in
slices of shingles, so a 50 MB document needs megabytes, not gigabytes; the hash family and the
file formats are datatrove's. Which member of a cluster is kept is decided here, not by the
union-find's root: the first one, in corpus order, that exact dedup kept, so the result does not
depend on how the corpus was spread over workers or tasks.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np

_WORD = re.compile(r"[^\W_]+")
_DIGITS = str.maketrans("123456789", "000000000")
_MERSENNE = np.uint64((1 << 61) - 1)
_NGRAM_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: n-gram hash = polynomial in the word hashes
SEGMENT_CHARS = 1 << 20  # a long document is shingled a megabyte at a time
SLICE = 4096  # shingles per slice of the signature computation


def lsh_params(threshold: float, num_hashes: int, recall: float = 0.95) -> tuple[int, int]:
    """Bands x rows (at most num_hashes) under which a pair at the threshold similarity shares a
    band with probability >= `recall`, with the least probability mass of pairs below it doing so:
    `threshold` then means what a user reads it as, "pairs this similar are found"."""
    s = np.linspace(0.0, threshold, 1001)
    best, best_fp = None, float("inf")
    for rows in range(1, num_hashes + 1):
        bands = num_hashes // rows
        if band_collision_probability(threshold, bands, rows) < recall:
            continue
        fp = float(np.trapezoid(1.0 - (1.0 - s**rows) ** bands, s))
        if fp < best_fp - 1e-12:
            best, best_fp = (bands, rows), fp
    return best or (num_hashes, 1)


def band_collision_probability(similarity: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - similarity**rows) ** bands


def resolve_bands(near) -> tuple[int, int]:
    """(bands, rows) of a `data.dedup.near` config: given, or chosen for its threshold."""
    if near.bands is not None:
        return near.bands, near.rows
    return lsh_params(near.threshold, near.num_hashes)


def content_hash(text: str) -> tuple[bytes, int]:
    """16 bytes of BLAKE2b, what exact dedup compares (collisions at 2^-64 over 10^10 documents),
    and the text's size in UTF-8 bytes."""
    import hashlib

    data = text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).digest(), len(data)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower().translate(_DIGITS))


def shingles(text: str, n: int) -> np.ndarray:
    """uint64 hashes of the word n-grams, in order."""
    parts = list(shingle_segments(text, n))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)


class _WordHashes(dict):
    """crc32 of a word, remembered: word frequencies are Zipfian, so most lookups hit (a dict lookup
    costs a fifth of encoding and hashing the word). Cleared when it reaches `limit` entries, so its
    memory stays bounded whatever the corpus."""

    def __init__(self, limit: int = 1 << 20):
        super().__init__()
        self.limit = limit

    def __missing__(self, word: str) -> int:
        if len(self) >= self.limit:
            self.clear()
        h = self[word] = zlib.crc32(word.encode())
        return h


_WORD_HASHES = _WordHashes()


def shingle_segments(text: str, n: int):
    """The n-gram hashes a segment of text at a time (the last n-1 words of a segment lead the
    next, so no n-gram is lost at a cut)."""
    carry: list[str] = []
    pos = 0
    while pos < len(text):
        end = min(len(text), pos + SEGMENT_CHARS)
        if end < len(text):
            cut = text.rfind(" ", pos, end)
            end = cut + 1 if cut > pos else end
        words = carry + _words(text[pos:end])
        pos = end
        if len(words) >= n:
            h = np.fromiter(map(_WORD_HASHES.__getitem__, words), dtype=np.uint64, count=len(words))
            m = len(words) - n + 1
            g = h[:m].copy()
            for j in range(1, n):
                g *= _NGRAM_MUL
                g += h[j:j + m]
            yield g
        carry = words[-(n - 1):] if n > 1 else []


def minhash(sh: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min over shingles of (a x + b) mod (2^61 - 1), per hash function: datatrove's family,
    computed over slices (one matrix of all shingles x all hashes costs 8 bytes per pair)."""
    out = np.full(a.shape[-1], np.iinfo(np.uint64).max, dtype=np.uint64)
    col = sh.reshape(-1, 1)
    for i in range(0, len(col), SLICE):
        x = col[i:i + SLICE] * a
        x += b
        x %= _MERSENNE
        np.minimum(out, x.min(axis=0), out=out)
    return out


@lru_cache(maxsize=1)
def _quiet() -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")
    from loguru import logger

    logger.disable("datatrove")


def make_signer(folder: Path, bands: int, rows: int, ngram: int, seed: int):
    """datatrove's signature step with our shingles and sliced signature."""
    _quiet()
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Words(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return _words(text)

        def sent_tokenize(self, text: str) -> list[str]:
            raise NotImplementedError

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            raise NotImplementedError

    class Signer(MinhashDedupSignature):
        """`get_shingles` streams the n-grams segment by segment into the minimum (min over a
        union = min of the mins), so what it hands `get_signature` is already the signature: a
        document never holds all its shingles at once."""

        def get_shingles(self, text: str) -> np.ndarray:
            a, b = self.parameters
            sig = None
            for segment in shingle_segments(text, self.config.n_grams):
                m = minhash(segment, a, b)
                sig = m if sig is None else np.minimum(sig, m)
            return np.empty(0, dtype=np.uint64) if sig is None else sig

        def get_signature(self, sig: np.ndarray) -> list[list[int]]:
            return [x.tolist() for x in np.split(sig, self.config.num_buckets)]

    config = MinhashConfig(n_grams=ngram, num_buckets=bands, hashes_per_bucket=rows, seed=seed,
                           hash_config=HashConfig(precision=64, hash_fc="sha1"))
    return Signer(str(folder), config=config, language=Words("en"))


def near_duplicate_clusters(sig_folder: Path, work: Path, bands: int, rows: int, ngram: int, seed: int
                            ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """chunk -> (document index in the chunk, cluster id) of every document that has a near
    duplicate, from datatrove's bucket and cluster steps over the signature files."""
    _quiet()
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster
    from datatrove.utils.hashing import HashConfig

    config = MinhashConfig(n_grams=ngram, num_buckets=bands, hashes_per_bucket=rows, seed=seed,
                           hash_config=HashConfig(precision=64, hash_fc="sha1"))
    if not any((sig_folder / f"bucket_{b:03d}").glob("*.minhash.sig") for b in range(bands)):
        return {}
    buckets, clusters = work / "buckets", work / "clusters"
    for b in range(bands):
        MinhashDedupBuckets(str(sig_folder), str(buckets), config=config).run(rank=b, world_size=bands)
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar: the caller shows its own
        MinhashDedupCluster(str(buckets), str(clusters), config=config, save_cluster_id=True).run(world_size=1)
    out = {}
    for f in sorted(clusters.glob("*.clusters")):
        pairs = np.fromfile(f, dtype="<u4").reshape(-1, 2)
        out[int(f.name.split(".")[0])] = (pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64))
    return out


def first_of_each_cluster(clusters: dict[int, tuple[np.ndarray, np.ndarray]], kept: dict[int, np.ndarray]
                          ) -> tuple[dict[int, np.ndarray], list[tuple[tuple[int, int], tuple[int, int]]]]:
    """Near-duplicates to remove: every member of a cluster but its first one (in corpus order)
    still kept; `kept[chunk]` is the boolean mask after exact dedup. Also (kept, removed) pairs,
    in corpus order, for the report."""
    members: dict[int, list[tuple[int, int]]] = {}
    for chunk in sorted(clusters):
        docs, ids = clusters[chunk]
        for d, c in zip(docs.tolist(), ids.tolist()):
            members.setdefault(c, []).append((chunk, d))
    remove: dict[int, list[int]] = {}
    pairs = []
    for c in sorted(members, key=lambda c: min(members[c])):
        alive = sorted(m for m in members[c] if kept[m[0]][m[1]])
        for m in alive[1:]:
            remove.setdefault(m[0], []).append(m[1])
            pairs.append((alive[0], m))
    return {k: np.asarray(v, dtype=np.int64) for k, v in remove.items()}, pairs
