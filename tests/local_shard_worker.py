"""Run under torchrun by tests/test_sharded.py: each rank times an FSDP2-wrapped proxy on a mesh of
itself alone (`train.parallel.local_sharding`, as a launched run's `cluster.facts.LocalView` does) at
sizes no other rank uses, so a collective crossing ranks would hang; rank r saves the sizes it timed
and the wrapped and bare models' logits."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hetforge.cluster.facts import CPU, LocalView
from hetforge.cluster.run_plan import RankFacts
from hetforge.config import build_config
from hetforge.model.accounting import ShardLayout
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.train.parallel import local_sharding

SEQ, VOCAB = 16, 256
CFG = GPTNeoXConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=VOCAB)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu = torch.device("cpu")
    bare = GPTNeoX.build(CFG, cpu, seed=0)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = bare(x)
    wrapped = GPTNeoX.build(CFG, cpu, seed=0)
    with local_sharding(cpu, "fsdp", None, 1) as wrap:
        wrap(wrapped)
        with torch.no_grad():
            got = wrapped(x)
    cfg = build_config({"model": {"preset": None, "n_layers": 2, "d_model": 32, "n_heads": 4, "d_ff": 64},
                        "train": {"seq_len": SEQ}, "cluster": {"probe_steps": 2}})
    view = LocalView(RankFacts(rank, 0, "localhost", "cpu", CPU, None), cfg, CFG, cpu,
                     sharding=lambda layout, precision: local_sharding(cpu, layout.strategy, None, layout.unit_params))
    # rank 0 times sizes 1, 2, 4; rank 1 size 1 only: their micro-step counts differ
    times = view.step_times([1, 2, 4] if rank == 0 else [1], "fp32", ShardLayout("fsdp", 2, 4, unit_params=1), {},
                            CFG.head_dim)
    result = {"sizes": sorted(times), "positive": all(t > 0 for t in times.values()),
              "wrapped": isinstance(wrapped, FSDPModule), "max_abs_diff": (got - want).abs().max().item()}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
