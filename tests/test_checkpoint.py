"""Checkpoints carry what they need (tokenizer, data fingerprint, every rank's RNG, registered
components) and leave nothing behind when a writer dies."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetforge.cli import main
from hetforge.core.checkpoint_io import remove_stale_temps
from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train


ROOT = Path(__file__).resolve().parent.parent


def test_a_checkpoint_serves_eval_generate_and_export_from_any_directory(make_cfg, data_dir, tmp_path, monkeypatch,
                                                                       capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(data_dir, work / "data")
    elsewhere.mkdir()
    monkeypatch.chdir(work)  # relative paths, as configs/demo.yaml has them
    cfg = make_cfg(steps=4, checkpoint_interval=4)
    cfg = cfg.model_copy(update={"run_dir": "runs/rel", "data": cfg.data.model_copy(update={"out_dir": "data"})})
    train(cfg)
    found = ckpt.resolve(work / "runs" / "rel")
    state = ckpt.read_state(found)
    assert (found / "tokenizer.json").read_bytes() == (work / "data" / "tokenizer.json").read_bytes()
    assert state["data_fingerprint"] == json.loads((work / "data" / "meta.json").read_text())["fingerprint"]
    assert Path(state["data_dir"]).is_absolute() and state["balance"]["global_batch"] == 4
    assert set(torch.load(found / "rng.pt", weights_only=True)) == {"ranks"}
    assert {"dcp", "scaler.pt"} <= {f.name for f in found.iterdir()}
    weights, optim = ckpt.read_tensors(found, "model"), ckpt.read_tensors(found, "optim")
    assert set(optim) == {n for n in weights if n in optim} and "layers.0.mlp.dense_h_to_4h.weight" in optim
    assert optim["layers.0.mlp.dense_h_to_4h.weight"]["exp_avg"].shape == weights["layers.0.mlp.dense_h_to_4h.weight"].shape

    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    run = str(work / "runs" / "rel")
    assert main(["generate", run, "--prompt", "We propose", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("We propose")
    assert main(["eval", run, "--json", "--max-batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] > 0
    assert main(["export", run, "--to", "hf", str(elsewhere / "hf")]) == 0
    assert (elsewhere / "hf" / "tokenizer.json").is_file()


WRITER = """
import sys, time
from pathlib import Path
from hetforge.core.checkpoint_io import publish

def write(tmp):
    (tmp / "model.safetensors").write_bytes(b"x" * 100_000)
    print("writing", flush=True)
    time.sleep(float(sys.argv[3]))

publish(Path(sys.argv[1]), int(sys.argv[2]), write, keep=2)
"""


def _writer(root: Path, step: int, sleep_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(step), str(sleep_s)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "writing"  # mid-write from here on
    return proc


@pytest.mark.slow
def test_writers_killed_mid_write_leave_nothing_after_the_next_start_and_a_live_one_is_kept(tmp_path):
    """Ten writers are kill -9'd mid-write; one more is still writing. The next start removes the
    ten (whatever their PIDs became since, and one that claims another host), never the live one,
    which then publishes; disk use is back to the finished checkpoints."""
    root = tmp_path / "checkpoints"
    (root / "step_00000004").mkdir(parents=True)
    for i in range(10):
        w = _writer(root, 8 + i, 60)
        w.kill()
        w.wait()
    temps = [p for p in root.iterdir() if p.name.startswith(".step_")]
    assert len(temps) == 10
    moved = root / f".step_00000099.tmp-some-other-host-{os.getpid()}"  # a dead writer of another node
    temps[0].rename(moved)
    live = _writer(root, 30, 3)
    try:
        removed = remove_stale_temps(root)
        assert len(removed) == 10 and moved in removed
        left = sorted(p.name for p in root.iterdir())
        assert left[0].startswith(".step_00000030.tmp-") and left[1:] == ["step_00000004"]
        assert live.wait(timeout=60) == 0
    finally:
        live.kill()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000030"]


def test_a_run_removes_the_temp_dirs_its_killed_writers_left(make_cfg, tmp_path):
    cfg = make_cfg(steps=4, checkpoint_interval=2)
    train(cfg, stop_after=2)
    root = Path(cfg.run_dir) / "checkpoints"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = root / f".step_00000004.tmp-{os.uname().nodename}-{dead.pid}"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    res = train(cfg)
    assert res.step == 4 and not left.exists()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]


def test_training_state_round_trips_and_a_weights_only_checkpoint_is_an_error(tmp_path):
    from hetforge.cluster.dist import DistContext

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    manager = ckpt.CheckpointManager(tmp_path / "checkpoints", DistContext(), keep=2, sharded=False)
    path, error = manager.save(1, model, opt, ["weight", "bias"], scaler, {"consumed_samples": 5}, None)
    assert error is None and (path / "dcp").is_dir() and ckpt.read_state(path)["consumed_samples"] == 5
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    manager.load_training(path, model, fresh, ["weight", "bias"], scaler)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert fresh.state_dict()["state"][1]["step"] == 1
    weights_only = ckpt.write_weights_checkpoint(tmp_path / "imported", model, {"step": 0})
    with pytest.raises(ckpt.CheckpointError, match="no optimizer state"):
        manager.load_training(weights_only, model, torch.optim.AdamW(model.parameters()), ["weight", "bias"], scaler)


def test_a_checkpoint_of_the_old_format_resumes(make_cfg, tmp_path):
    """model.safetensors + optimizer.pt + scaler.pt, as hetforge wrote them before DCP for every
    strategy: a run resumes from one and ends where an uninterrupted run does."""
    from safetensors.torch import save_file

    full = train(make_cfg("full", steps=8, checkpoint_interval=4))
    cfg = make_cfg("old", steps=8, checkpoint_interval=4)
    train(cfg, stop_after=4)
    new = ckpt.resolve(cfg.run_dir)
    assert new.name == "step_00000004"
    old = new.parent / "step_00000004.old"
    shutil.copytree(new, old)
    save_file(ckpt.read_tensors(new, "model"), str(old / "model.safetensors"))
    from hetforge.train.optim import param_order
    from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig

    order = param_order(GPTNeoX(GPTNeoXConfig(**ckpt.read_state(new)["model_config"])))
    named = ckpt.read_tensors(new, "optim")
    torch.save({"state": {i: named[n] for i, n in enumerate(order)},
                "param_groups": [{"params": list(range(len(order)))}]}, old / "optimizer.pt")
    shutil.rmtree(old / "dcp")
    ckpt.write_manifest(old, 4)
    shutil.rmtree(new)
    old.rename(new)
    res = train(cfg)
    assert res.step == 8 and res.losses[8] == full.losses[8]


def test_writers_of_one_file_at_once_each_publish_a_whole_copy(tmp_path):
    """Ranks on one host write the same cache file (a profile keyed by what was measured): every
    write succeeds, the file is always one writer's whole text, and no temporary file is left."""
    import json
    import threading

    from hetforge.core.checkpoint_io import write_text_atomic

    path = tmp_path / "cache" / "profile.json"
    errors, seen = [], []

    def writer(k: int) -> None:
        try:
            for i in range(40):
                write_text_atomic(path, json.dumps({"writer": k, "i": i, "pad": "x" * 4096}))
                seen.append(json.loads(path.read_text())["writer"])
        except Exception as err:  # noqa: BLE001 - any failure is the test's finding
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(seen) == 160
    assert [p.name for p in path.parent.iterdir()] == ["profile.json"]
