"""Run under torchrun by tests/test_distributed.py: one gradient step of hetforge's backward_share
with hand-set unequal shares, all-reduced; rank 0 saves the gradients."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetforge.cluster.balance import RankInfo, TimeModel, fixed_plan
from hetforge.data.shards import PackedSamples, SampleOrder, TokenShard
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.train.loop import backward_share
from hetforge.train.parallel import Parallel
from hetforge.core.precision import Precision

SEQ = 32
CFG = GPTNeoXConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=512)


def setup(data_dir):
    torch.manual_seed(0)
    samples = PackedSamples(TokenShard(data_dir, "train"), SEQ)
    return GPTNeoX(CFG), samples, SampleOrder(len(samples), seed=7)


def main(out, data_dir, shares):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, samples, order = setup(data_dir)
    assignments = [tuple(int(v) for v in s.split("x")) for s in shares.split(",")]  # samples x micro
    infos = [RankInfo(r, "h", "cpu", None, TimeModel([(1, 1.0)], 64)) for r in range(world)]
    B = sum(n for n, _ in assignments)
    plan = fixed_plan(infos, B, assignments)
    net = DistributedDataParallel(model)
    prec = Precision("fp32", torch.device("cpu"))
    scaler = prec.grad_scaler()
    consumed = 40  # any step: the global positions [40, 40 + B)
    loss, _ = backward_share(Parallel(net, "ddp", grad_weight=float(world)), samples, order,
                             plan.micro_positions(rank, consumed), consumed, B * SEQ, prec, scaler, torch.device("cpu"))
    dist.all_reduce(loss)
    if rank == 0:
        torch.save({"loss": loss, "grads": {n: p.grad for n, p in model.named_parameters()}}, out)
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
