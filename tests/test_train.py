import errno
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train
from hetforge.core.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def test_loss_decreases_and_outputs_are_written(make_cfg):
    cfg = make_cfg(steps=40, eval_interval=20, checkpoint_interval=20, lr=1e-2, micro_batch_size=8)
    res = train(cfg)
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert res.val is not None and res.val.loss < math.log(512) - 1.0
    assert res.val.bits_per_byte is not None and 0 < res.val.bits_per_byte < 8
    assert res.tokens_per_s > 0 and 0 < res.mfu
    run = Path(cfg.run_dir)
    assert (run / "loss_curve.png").stat().st_size > 1000
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs["train"]] == list(range(1, 41))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_mem_mb"} <= set(recs["train"][0])
    assert [r["step"] for r in recs["val"]] == [20, 40]
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000020", "step_00000040"]


def test_tensorboard_events_are_written(make_cfg):
    cfg = make_cfg(steps=3, tensorboard=True)
    train(cfg)
    assert list((Path(cfg.run_dir) / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_is_bitwise_identical(make_cfg):
    full = train(make_cfg("full"))
    cfg = make_cfg("split")
    first = train(cfg, stop_after=5)
    assert first.interrupted and first.step == 5
    second = train(cfg)  # automatic resume from the newest valid checkpoint
    assert sorted(second.losses) == list(range(6, 13))
    resumed = {**first.losses, **second.losses}
    assert resumed == full.losses  # exact float equality, step for step
    a, b = ckpt.read_tensors(full.run_dir, "optim"), ckpt.read_tensors(cfg.run_dir, "optim")
    assert set(a) == set(b) and all(torch.equal(a[n]["exp_avg"], b[n]["exp_avg"]) for n in a)


def test_grad_accumulation_matches_one_big_micro_batch(make_cfg):
    one = train(make_cfg("one", steps=4, micro_batch_size=8, grad_accum=1))
    acc = train(make_cfg("acc", steps=4, micro_batch_size=2, grad_accum=4))
    # a few fp32 ulps of the loss: the micro-batches' gradients are summed in another order, which
    # AdamW's g / sqrt(v) magnifies on near-zero entries; a missing or doubled 1/accum moves it ~1e-2
    for s in range(1, 5):
        assert acc.losses[s] == pytest.approx(one.losses[s], rel=1e-6)


def test_corrupt_latest_checkpoint_falls_back_to_previous(make_cfg, capsys):
    cfg = make_cfg(steps=12, checkpoint_interval=4)
    train(cfg)
    root = Path(cfg.run_dir) / "checkpoints"
    newest = ckpt.list_checkpoints(root)[-1]
    assert newest.name == "step_00000012"
    weights = next((newest / "dcp").glob("*.distcp"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert ckpt.latest_valid(root).name == "step_00000008"
    assert "corrupt" in capsys.readouterr().err
    # a truncated file is caught by its size alone
    (ckpt.list_checkpoints(root)[0] / "scaler.pt").write_bytes(b"")
    assert ckpt.verify(ckpt.list_checkpoints(root)[0]) is not None


def test_resume_after_corruption_continues_from_previous(make_cfg):
    ref = train(make_cfg("ref", steps=12, checkpoint_interval=4))
    cfg = make_cfg("bad", steps=12, checkpoint_interval=4)
    train(cfg, stop_after=10)  # checkpoints at 8 and 10
    root = Path(cfg.run_dir) / "checkpoints"
    (root / "step_00000010" / "rng.pt").write_bytes(b"garbage")
    res = train(cfg)
    assert sorted(res.losses) == list(range(9, 13))
    assert all(res.losses[s] == ref.losses[s] for s in res.losses)


def test_write_error_keeps_previous_checkpoint(make_cfg, monkeypatch):
    cfg = make_cfg(steps=8, checkpoint_interval=4)
    train(cfg, stop_after=4)
    root = Path(cfg.run_dir) / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000004"]

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    from hetforge.cluster.dist import DistContext

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ckpt.CheckpointManager(root, DistContext(), keep=2, sharded=False)
    path, error = manager.save(99, model, opt, ["weight", "bias"], torch.amp.GradScaler("cpu", enabled=False), {}, None)
    assert path is None and "No space left" in error
    assert [p.name for p in root.iterdir()] == ["step_00000004"]  # no temp dir left behind
    assert ckpt.verify(root / "step_00000004") is None
    # inside training, a failed periodic checkpoint is a warning and the run goes on; the final
    # checkpoint cannot be skipped, so the run reports the error, with step 4 still intact
    with pytest.raises(ckpt.CheckpointError):
        train(cfg)
    assert ckpt.latest_valid(root).name == "step_00000004"


@pytest.mark.parametrize("optimizer,precision", [("lamb", "fp32"), ("adamw", "bf16")])
def test_lamb_and_bf16_train(make_cfg, optimizer, precision):
    res = train(make_cfg(steps=20, optimizer=optimizer, precision=precision, lr=1e-1 if optimizer == "lamb" else 3e-3))
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_writes_checkpoint_before_exit(make_cfg, tmp_path, sig, code):
    cfg = make_cfg(steps=100000, checkpoint_interval=100000, eval_interval=100000)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.Popen([sys.executable, "-m", "hetforge", "train", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    deadline = time.time() + 120
    # mid-training: a step has been logged (the run_start record comes before the loop, and its
    # signal handlers, start; a signal before them ends a run that has nothing to save yet)
    while time.time() < deadline and (not metrics.exists() or '"kind": "train"' not in metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out
    found = ckpt.latest_valid(Path(cfg.run_dir) / "checkpoints")
    assert found is not None and ckpt.read_state(found)["step"] >= 1
    ckpt.load_weights(found, _model_for(found))


def _model_for(path):
    import json

    from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig

    return GPTNeoX(GPTNeoXConfig(**json.loads((path / "state.json").read_text())["model_config"]))


def test_seq_len_too_large_for_data(make_cfg):
    from hetforge.data.shards import ShardError

    with pytest.raises(ShardError, match="seq_len"):
        train(make_cfg(seq_len=10_000_000))


@pytest.mark.slow
def test_wandb_offline_mirrors_the_run_and_a_resume_continues_it(make_cfg):
    """train.wandb=offline: a W&B run under RUN/wandb, no network; resuming reuses its id."""
    cfg = make_cfg("wb", steps=4, checkpoint_interval=2, wandb="offline")
    train(cfg, stop_after=2)
    run_dir = Path(cfg.run_dir)
    run_id = (run_dir / "wandb_id.txt").read_text()
    train(cfg)
    assert (run_dir / "wandb_id.txt").read_text() == run_id
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # (a "-1" follows within one second)
    assert all((r / f"run-{run_id}.wandb").stat().st_size > 0 for r in runs)
