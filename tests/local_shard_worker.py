"""Run under torchrun by tests/test_sharded.py: each rank probes an FSDP2-wrapped proxy on a mesh of
itself alone (`train.parallel.local_sharding`) at sizes no other rank uses, so a collective crossing
ranks would hang; rank r saves its time model's sizes and the wrapped and bare proxies' logits."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hetforge.cluster.probe import probe, saved_bytes_per_sample
from hetforge.cluster.spec import Slowdown
from hetforge.core.precision import Precision
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.train.parallel import local_sharding

SEQ, VOCAB = 16, 256
CFG = GPTNeoXConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=VOCAB)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu = torch.device("cpu")
    prec = Precision("fp32", cpu)
    bare = GPTNeoX.build(CFG, cpu, seed=0)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = bare(x)
    proxy = GPTNeoX.build(CFG, cpu, seed=0)
    with local_sharding(cpu, "fsdp", None, 1) as wrap:
        # rank 0 times sizes 1, 2, 4; rank 1 size 1 only: their micro-step counts differ
        tm, facts = probe(proxy, SEQ, VOCAB, cpu, prec.autocast, 4 if rank == 0 else 1, None, Slowdown(None),
                          steps=2, wrap=wrap)
        with torch.no_grad():
            got = proxy(x)
    result = {"sizes": [b for b, _ in tm.points], "wrapped": isinstance(proxy, FSDPModule),
              "max_abs_diff": (got - want).abs().max().item(), "act": facts["activation_bytes_per_sample"],
              "act_bare": saved_bytes_per_sample(bare, SEQ, VOCAB, cpu, prec.autocast)}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
