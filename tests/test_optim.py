import math

import pytest
import torch

from hetforge.config import TrainConfig
from hetforge.train.optim import Lamb, lr_at


def test_schedule_warmup_peak_and_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)  # cosine midpoint between peak and floor
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_lamb_step_matches_the_formula():
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    g = torch.randn(5, 3)
    w0 = w.detach().clone()
    opt = Lamb([w], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    w.grad = g.clone()
    opt.step()
    m, v = 0.1 * g / (1 - 0.9), 0.01 * g * g / (1 - 0.99)
    update = m / (v.sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    torch.testing.assert_close(w.detach(), expected)


def test_lamb_zero_weight_uses_unit_trust():
    b = torch.zeros(4, requires_grad=True)
    opt = Lamb([b], lr=0.5)
    b.grad = torch.ones(4)
    opt.step()
    assert torch.all(b.detach() < 0) and math.isfinite(float(b.detach().norm()))


def _overflow_on_one_rank(rank: int, world: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    from hetforge.core.precision import Precision

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.AdamW([w], lr=0.1, fused=True)
        scaler = Precision("fp16", torch.device("cpu")).grad_scaler(synced=True)
        # only rank 1's gradients overflow, as one stage or one shard's would
        scaler.scale((w * (float("inf") if rank == 1 else 1.0)).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        torch.save({"w": w.detach(), "scale": scaler.get_scale()}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_ranks_fp16_overflow_skips_every_ranks_step(tmp_path):
    """Where ranks hold different gradients (pipeline stages, shards), an overflow on one must skip
    the step and halve the scale on all of them, or their weights and scales part ways."""
    import torch.multiprocessing as mp

    mp.spawn(_overflow_on_one_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert all(torch.equal(g["w"], torch.ones(4)) for g in got)  # no rank stepped
    assert got[0]["scale"] == got[1]["scale"] == 2.0**15  # both halved from 2^16
