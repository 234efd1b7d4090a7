"""Memory-mapped token shards and the deterministic, resumable sample order.

A split is one flat token file (`train.bin`, uint16 or uint32) with documents separated by the
end-of-text token, plus `train.idx.npy`: the start offset of every document and the total length
(int64, n_docs + 1 entries). Training samples are consecutive windows of `seq_len + 1` tokens taken
at stride `seq_len` (inputs and shifted targets), i.e. documents are packed, GPT-NeoX style.

The order in which samples are visited is a pure function of (seed, global sample index): epoch
`e` visits a permutation drawn from `default_rng([seed, e])`. The checkpoint therefore only needs to
store how many samples were consumed, and any number of ranks can slice the same global sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hetforge.core.errors import HetforgeError


class ShardError(HetforgeError, ValueError):
    pass


def write_split(out_dir: Path, split: str, docs_tokens: list[np.ndarray], eot_id: int, dtype: str) -> dict:
    """Write one split; each element of `docs_tokens` is one document's ids (EOT appended here)."""
    lengths = np.fromiter((len(t) + 1 for t in docs_tokens), dtype=np.int64, count=len(docs_tokens))
    offsets = np.zeros(len(docs_tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    bin_path = out_dir / f"{split}.bin"
    mm = np.memmap(bin_path, dtype=dtype, mode="w+", shape=(max(total, 1),))
    for start, toks in zip(offsets[:-1], docs_tokens):
        mm[start : start + len(toks)] = toks
        mm[start + len(toks)] = eot_id
    mm.flush()
    del mm
    np.save(out_dir / f"{split}.idx.npy", offsets)
    return {"tokens": total, "documents": len(docs_tokens), "file": bin_path.name}


class TokenShard:
    """Read-only view of one split: flat tokens and document boundaries."""

    def __init__(self, data_dir: str | Path, split: str):
        data_dir = Path(data_dir)
        meta_path = data_dir / "meta.json"
        if not meta_path.is_file():
            raise ShardError(f"no prepared data in {data_dir} (run `hetforge prepare CONFIG` first)")
        self.meta = json.loads(meta_path.read_text())
        if split not in self.meta["splits"]:
            raise ShardError(f"{data_dir} has no split {split!r}")
        info = self.meta["splits"][split]
        self.dtype = np.dtype(self.meta["dtype"])
        self.num_tokens = int(info["tokens"])
        expected = self.num_tokens * self.dtype.itemsize
        bin_path = data_dir / f"{split}.bin"
        if not bin_path.is_file() or bin_path.stat().st_size != expected:
            raise ShardError(f"{bin_path} is missing or truncated (expected {expected} bytes); re-run prepare")
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        self.doc_offsets = np.load(data_dir / f"{split}.idx.npy")

    def document(self, i: int) -> np.ndarray:
        """Tokens of document i, without its trailing end-of-text token."""
        return np.asarray(self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1] - 1])

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1


class PackedSamples:
    """Fixed-length training windows over a shard. With `regions` (token ranges, one per source),
    windows never cross a region's end: window ids run over region 0's windows, then region 1's..."""

    def __init__(self, shard: TokenShard, seq_len: int, split: str = "train",
                 regions: list[tuple[int, int]] | None = None):
        self.shard, self.seq_len = shard, seq_len
        if regions is None:
            regions = [(0, shard.num_tokens)]
            self.region_counts = [(shard.num_tokens - 1) // seq_len]
        else:
            self.region_counts = [max(0, (b - a - 1) // seq_len) for a, b in regions]
        self.region_starts = np.asarray([a for a, _ in regions], dtype=np.int64)
        self.region_bases = np.concatenate([[0], np.cumsum(self.region_counts)]).astype(np.int64)
        self.num_samples = int(self.region_bases[-1])
        if self.num_samples < 1:
            raise ShardError(
                f"train.seq_len={seq_len} is larger than the {split} split allows: it holds "
                f"{shard.num_tokens} tokens, and one sample needs seq_len + 1; "
                f"use train.seq_len <= {max(shard.num_tokens - 1, 1)} or add data"
            )

    def __len__(self) -> int:
        return self.num_samples

    def _start(self, i: int) -> int:
        r = int(np.searchsorted(self.region_bases, i, side="right")) - 1
        return int(self.region_starts[r] + (i - self.region_bases[r]) * self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self._start(i)
        return np.asarray(self.shard.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: list[int]) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 array: inputs are [:, :-1], targets [:, 1:]."""
        return np.stack([self[i] for i in indices]) if indices else np.empty((0, self.seq_len + 1), np.int64)


class SampleOrder:
    """Maps a global sample position (0, 1, 2, ... across epochs) to a sample index."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._perm

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        return int(self._permutation(epoch)[offset])

    def indices(self, start: int, count: int) -> list[int]:
        return [self[p] for p in range(start, start + count)]


class MixedOrder:
    """Maps a global sample position to a sample index when sources are weighted.

    Source s holds n_s windows (ids base_s .. base_s + n_s - 1) and gets the share
    n_s * w_s / sum(n * w) of positions. A fixed pattern of `period` positions holds each source
    round(share * period) times (largest remainders; at least once), spread evenly (each source's
    k-th slot sits near (k + 1/2) / count of the way through), so over any window of positions the
    draws follow the weights to within a few positions. Source s's k-th draw is window
    perm(seed, s, k // n_s)[k % n_s]: a fresh permutation per epoch of that source. Everything is a
    function of (seed, position), so resume and world-size changes see the same sequence."""

    PERIOD = 1 << 16

    def __init__(self, counts: list[int], weights: list[float], seed: int, period: int = PERIOD):
        counts_a = np.asarray(counts, dtype=np.int64)
        if counts_a.sum() < 1:
            raise ShardError("no source has a training window")
        mass = counts_a * np.asarray(weights, dtype=np.float64)
        ideal = mass / mass.sum() * period
        slots = np.floor(ideal).astype(np.int64)
        slots[(counts_a > 0) & (slots == 0)] = 1
        rest = period - slots.sum()
        if rest > 0:
            order = np.argsort(-(ideal - slots), kind="stable")
            slots[order[:rest]] += 1
        elif rest < 0:  # the minimum of one slot pushed past the period: take from the largest
            for _ in range(-rest):
                slots[int(np.argmax(slots))] -= 1
        self.counts, self.slots, self.seed, self.period = counts_a, slots, seed, period
        self.shares = slots / period
        times = np.concatenate([(np.arange(c) + 0.5) / c for c in slots if c > 0])
        sources = np.concatenate([np.full(c, s) for s, c in enumerate(slots) if c > 0])
        self.pattern = sources[np.lexsort((sources, times))].astype(np.int64)
        self.rank = np.empty(period, dtype=np.int64)
        for s in range(len(slots)):
            where = np.flatnonzero(self.pattern == s)
            self.rank[where] = np.arange(len(where))
        self.bases = np.concatenate([[0], np.cumsum(counts_a)]).astype(np.int64)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, source, epoch]).permutation(int(self.counts[source])))
            self._perms[source] = cached
        return cached[1]

    def source_of(self, position: int) -> int:
        return int(self.pattern[position % self.period])

    def __getitem__(self, position: int) -> int:
        rounds, q = divmod(position, self.period)
        s = int(self.pattern[q])
        k = rounds * int(self.slots[s]) + int(self.rank[q])
        epoch, offset = divmod(k, int(self.counts[s]))
        return int(self.bases[s] + self._permutation(s, epoch)[offset])

    def indices(self, start: int, count: int) -> list[int]:
        return [self[p] for p in range(start, start + count)]

    def draws(self, positions: int) -> np.ndarray:
        """How many samples of each source the first `positions` positions draw."""
        rounds, q = divmod(positions, self.period)
        partial = np.bincount(self.pattern[:q], minlength=len(self.slots))
        return rounds * self.slots + partial


def weighted_regions(meta: dict) -> tuple[list[tuple[int, int]], list[float]] | None:
    """(train token range, weight) of each source when the weights are not all equal; None when
    the corpus is one uniform stream (every window equally likely, as without sources)."""
    sources = meta.get("sources") or []
    if len(sources) < 2 or len({float(s.get("weight", 1.0)) for s in sources}) < 2:
        return None
    return [tuple(s["train_range"]) for s in sources], [float(s["weight"]) for s in sources]


def read_doc_ids(data_dir: str | Path, split: str) -> list[str]:
    """Where each document of a split came from (file and line, byte offset or row)."""
    path = Path(data_dir) / f"{split}.doc_ids.txt"
    if not path.is_file():
        raise ShardError(f"{path} is missing; re-run prepare")
    return path.read_text(encoding="utf-8").splitlines()


def batch_from_numpy(arr: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split packed windows into model inputs and next-token targets on the device."""
    t = torch.from_numpy(arr)
    return t[:, :-1].to(device, non_blocking=True), t[:, 1:].to(device, non_blocking=True)
