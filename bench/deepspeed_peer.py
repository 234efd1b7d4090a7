"""The peer a user would otherwise pick: the same model and global batch under DeepSpeed ZeRO-1 on
its CPU accelerator with gloo. Run under torchrun by bench/hetero_balance.py (2 ranks); DeepSpeed
can only split the batch equally, so rank 1 is slowed with the same rule as hetforge's `slowdown`
knob: after each forward a sleep of (k-1) x (forward + the last backward), on the thread's CPU
clock (OMP_NUM_THREADS=1).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 bench/deepspeed_peer.py OUT.json K STEPS BATCH [STAGE]

STAGE is the ZeRO stage (default 1; bench/sharded_scale.py runs 3, falling back to 2). At stage 3
every parameter is sharded (`stage3_param_persistence_threshold: 0`), as hetforge's FSDP does: by
default DeepSpeed keeps parameters under 1e5 elements whole, which here is every weight of a block,
so its "ZeRO-3" would gather only the embeddings.

Needs the bench extra: pip install -e '.[bench]'.
"""

from __future__ import annotations

from dataclasses import replace
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetforge.data.shards import TokenShard  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoX  # noqa: E402
from hetforge.model.presets import PRESETS  # noqa: E402

SEQ = 128


def main(out: str, k: str, steps: str, batch: str, stage: str = "1") -> None:
    k, steps, batch, stage = float(k), int(steps), int(batch), int(stage)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = replace(PRESETS["tiny"], vocab_size=4096)
    data = TokenShard(ROOT / "data_cache" / "aclsum-4k", "train").tokens
    torch.manual_seed(0)
    model = GPTNeoX(shape)
    config = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch // world,
        "gradient_accumulation_steps": 1,
        # every parameter sharded at stage 3, as at scale (its default keeps parameters under 1e5
        # elements whole, which at this bench's width is every weight of a block)
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rng = np.random.default_rng(rank)
    times = []
    bwd_ratio = 2.0
    for _ in range(steps):
        t0 = time.perf_counter()
        ix = rng.integers(0, len(data) - SEQ - 1, batch // world)
        chunk = torch.from_numpy(np.stack([np.asarray(data[i:i + SEQ + 1], dtype=np.int64) for i in ix]))
        tf = time.thread_time()
        logits = engine(chunk[:, :-1])
        fwd = time.thread_time() - tf
        if rank == 1 and k > 1:
            time.sleep((k - 1) * (1 + bwd_ratio) * fwd)
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        tb = time.thread_time()
        engine.backward(loss)
        bwd_ratio = min(max((time.thread_time() - tb) / fwd, 0.5), 20.0) if fwd > 0 else 2.0
        engine.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        step_s = statistics.median(times[2:])
        Path(out).write_text(json.dumps({"step_s": step_s, "tokens_per_s": batch * SEQ / step_s}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
