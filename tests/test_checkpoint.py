"""Checkpoints carry what they need (tokenizer, data fingerprint, every rank's RNG, registered
components) and leave nothing behind when a writer dies."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from hetforge.cli import main
from hetforge.core.checkpoint_io import remove_stale_temps
from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train


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
    assert {"optimizer.pt", "scaler.pt"} <= {f.name for f in found.iterdir()}

    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    run = str(work / "runs" / "rel")
    assert main(["generate", run, "--prompt", "We propose", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("We propose")
    assert main(["eval", run, "--json", "--max-batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] > 0
    assert main(["export", run, "--to", "hf", str(elsewhere / "hf")]) == 0
    assert (elsewhere / "hf" / "tokenizer.json").is_file()


def test_stale_temp_dirs_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000004").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = os.uname().nodename
        stale = root / f".step_00000008.tmp-{host}-{dead.pid}"
        busy = root / f".step_00000008.tmp-{host}-{live.pid}"
        other_host = root / f".step_00000008.tmp-not-{host}-{dead.pid}"
        for d in (stale, busy, other_host):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"x" * 1000)
        assert remove_stale_temps(root) == [stale]
        assert busy.exists() and other_host.exists() and (root / "step_00000004").exists()
    finally:
        live.kill()
        live.wait()


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


def test_components_round_trip_and_a_missing_one_is_an_error(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = ckpt.save_checkpoint(tmp_path, 1, model, {"optimizer": opt}, {"consumed_samples": 5},
                                rng=[{"torch": torch.get_rng_state()}])
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt.load_components(path, {"optimizer": fresh})
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    try:
        ckpt.load_components(path, {"scaler": torch.amp.GradScaler("cpu", enabled=False)})
    except ckpt.CheckpointError as err:
        assert "no scaler state" in str(err)
    else:
        raise AssertionError("a missing component must not pass silently")
