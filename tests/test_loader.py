"""The prefetching loader gives exactly the batches of the synchronous path, in any request order."""

import torch

from hetforge.data.loader import Prefetcher
from hetforge.data.shards import PackedSamples, SampleOrder, TokenShard, batch_from_numpy


def test_prefetched_batches_equal_the_synchronous_ones_and_misses_are_built(data_dir):
    samples = PackedSamples(TokenShard(data_dir, "train"), 32)
    order = SampleOrder(len(samples), 7)
    loader = Prefetcher(samples, order, torch.device("cpu"))
    try:
        keys = [(0, 4), (4, 3), (len(samples) - 2, 5)]  # the last one crosses into the next epoch
        loader.request(keys)
        for start, count in keys + [(100, 2)]:  # (100, 2) was never requested: built on the spot
            x, y = loader.get(start, count)
            rx, ry = batch_from_numpy(samples.batch(order.indices(start, count)), torch.device("cpu"))
            assert torch.equal(x, rx) and torch.equal(y, ry)
        assert (loader.hits, loader.misses) == (3, 1)
        loader.request([(200, 2), (300, 2)])  # a re-balanced step asks for (300, 2) only
        loader.get(300, 2)
        assert not loader._pending  # the request left behind is dropped
    finally:
        loader.close()
