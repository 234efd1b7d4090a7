"""A run's data: prepared (on rank 0, a no-op when cached) and opened on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hetforge.cluster.dist import DistContext, post, wait_for_main
from hetforge.config import RunConfig
from hetforge.data.loader import Prefetcher
from hetforge.data.prepare import prepare
from hetforge.data.shards import MixedOrder, PackedSamples, SampleOrder, TokenShard, weighted_regions
from hetforge.data.tokenizer import load_tokenizer, token_byte_lengths


@dataclass
class RunData:
    out_dir: Path
    meta: dict
    train: PackedSamples
    val: PackedSamples
    order: SampleOrder | MixedOrder  # the sample at each global position: a pure function of it
    loader: Prefetcher
    tokenizer: Path
    byte_lengths: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def source_epochs(self, total_samples: int) -> list[dict]:
        """Per source: its share of the samples and how many times a run of `total_samples` sees it."""
        sources = self.meta.get("sources") or []
        if isinstance(self.order, MixedOrder):
            draws = self.order.draws(total_samples)
            return [{"path": s.get("path") or s["type"], "weight": s["weight"], "windows": int(n),
                     "share": float(self.order.shares[i]), "epochs": float(draws[i] / n) if n else 0.0}
                    for i, (s, n) in enumerate(zip(sources, self.order.counts))]
        n = len(self.train)
        return [{"path": s.get("path") or s["type"], "weight": s.get("weight", 1.0),
                 "share": s["tokens"]["train"] / max(self.train.shard.num_tokens, 1), "epochs": total_samples / n}
                for s in sources if "tokens" in s]


def open_data(cfg: RunConfig, ctx: DistContext, device: torch.device) -> RunData:
    """Rank 0 prepares the data; the others wait through the store, for as long as rank 0 is alive
    (preparing may take hours), then open the same shards. Weighted sources draw their share of
    positions exactly (`data.sources[*].weight`)."""
    tc = cfg.train
    if ctx.is_main:
        data = prepare(cfg.data, progress=tc.progress)
        if ctx.distributed:
            post(ctx, "prepared", "ok")
    else:
        wait_for_main(ctx, "prepared", "preparing the data")
        data = prepare(cfg.data, progress=False, verbose=False)
    mix = weighted_regions(data.meta)
    train = PackedSamples(TokenShard(data.out_dir, "train"), tc.seq_len, "train", regions=mix[0] if mix else None)
    val = PackedSamples(TokenShard(data.out_dir, "val"), tc.seq_len, "val")
    order = MixedOrder(train.region_counts, mix[1], tc.seed) if mix else SampleOrder(len(train), tc.seed)
    tokenizer = data.out_dir / "tokenizer.json"
    return RunData(data.out_dir, data.meta, train, val, order, Prefetcher(train, order, device), tokenizer,
                   token_byte_lengths(load_tokenizer(tokenizer)))
