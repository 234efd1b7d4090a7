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
    """Fixed-length training windows over a shard."""

    def __init__(self, shard: TokenShard, seq_len: int, split: str = "train"):
        self.shard, self.seq_len = shard, seq_len
        self.num_samples = (shard.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ShardError(
                f"train.seq_len={seq_len} is larger than the {split} split allows: it holds "
                f"{shard.num_tokens} tokens, and one sample needs seq_len + 1; "
                f"use train.seq_len <= {max(shard.num_tokens - 1, 1)} or add data"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
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


def batch_from_numpy(arr: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split packed windows into model inputs and next-token targets on the device."""
    t = torch.from_numpy(arr)
    return t[:, :-1].to(device, non_blocking=True), t[:, 1:].to(device, non_blocking=True)
