"""Faults an operator of a shared cluster meets: a rank killed or stopped mid-run, a disk that
fills during a checkpoint. Each ends in one hetforge line on the survivors and nothing lost."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hetforge.core.checkpoint_io import list_checkpoints, verify
from hetforge.train.loop import train
from tests.test_distributed import ENV, ROOT, torchrun_cmd


def _workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun agent's worker processes."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


def _launch(make_cfg, tmp_path, name: str, timeout_s: float) -> tuple[subprocess.Popen, Path, Path]:
    cfg = make_cfg(name, steps=100000, log_interval=1, eval_interval=100000, checkpoint_interval=5)
    raw = cfg.model_dump(mode="json")
    raw["cluster"]["collective_timeout_s"] = timeout_s
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(torchrun_cmd(2, "-m", "hetforge", "train", str(path)), cwd=ROOT, env=ENV,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    metrics = Path(cfg.run_dir) / "checkpoints"
    deadline = time.monotonic() + 180
    while not list_checkpoints(metrics):  # training, with a checkpoint behind it
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return proc, log, Path(cfg.run_dir)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _hetforge_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "error: rank" in ln]


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_survivor_in_one_line(make_cfg, tmp_path):
    proc, log, run_dir = _launch(make_cfg, tmp_path, "killed", timeout_s=60)
    try:
        victim = _workers(proc.pid)[1]
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        _stop(proc)
    text = log.read_text()
    lines = _hetforge_lines(text)
    assert proc.returncode != 0
    assert len(lines) == 1, text[-4000:]
    assert re.search(r"rank 0 \(\S+\): lost rank 1 \(\S+\) at step \d+; relaunch the same job .* to resume from "
                     r".*step_\d{8}", lines[0]), lines[0]
    survivor = [ln for ln in text.splitlines() if ln.startswith("[rank0]")]
    assert not any("Traceback" in ln for ln in survivor), "\n".join(survivor)[-3000:]
    assert took < 30  # well within the collective timeout: a closed connection is seen at once
    assert all(verify(p) is None for p in list_checkpoints(run_dir / "checkpoints"))


@pytest.mark.slow
def test_a_stopped_rank_is_detected_within_the_collective_timeout(make_cfg, tmp_path):
    proc, log, run_dir = _launch(make_cfg, tmp_path, "stopped", timeout_s=6)
    try:
        victim = _workers(proc.pid)[1]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        deadline = t0 + 90
        while not _hetforge_lines(log.read_text()):
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        took = time.monotonic() - t0
        os.kill(victim, signal.SIGKILL)  # the launcher would, after its own grace period
        proc.wait(timeout=60)
    finally:
        _stop(proc)
    lines = _hetforge_lines(log.read_text())
    assert len(lines) == 1
    assert re.search(r"rank 0 \(\S+\): rank 1 \(\S+\) stopped answering for 6s \(cluster.collective_timeout_s\) "
                     r"at step \d+; relaunch", lines[0]), lines[0]
    assert 5 < took < 40  # the timeout (6 s) plus the heartbeat check, not 30 minutes
    assert proc.returncode != 0


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(make_cfg, monkeypatch, capsys):
    """ENOSPC half-way through the write: the run warns, goes on, and the previous checkpoint is
    whole; nothing half-written is left; a later write that succeeds is published."""
    import errno

    from hetforge.train import checkpoint as ckpt_mod

    cfg = make_cfg("full", steps=8, checkpoint_interval=2)
    real = ckpt_mod.save_dcp
    calls = {"n": 0}

    def filling_disk(directory, payload, collective):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint (step 4)
            (Path(directory) / "dcp").mkdir()
            (Path(directory) / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(directory, payload, collective)

    monkeypatch.setattr(ckpt_mod, "save_dcp", filling_disk)
    res = train(cfg)
    assert res.step == 8
    root = Path(cfg.run_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006", "step_00000008"]
    assert all(verify(p) is None for p in list_checkpoints(root))
    err = capsys.readouterr()
    assert "No space left on device; the previous checkpoint is intact, training continues" in err.out + err.err


def test_disk_full_on_the_final_checkpoint_is_one_error_and_keeps_the_last(make_cfg, monkeypatch):
    import errno

    from hetforge.train import checkpoint as ckpt_mod
    from hetforge.train.checkpoint import CheckpointError

    cfg = make_cfg("full-final", steps=4, checkpoint_interval=2)
    real = ckpt_mod.save_dcp

    def full_at_the_end(directory, payload, collective):
        if "00000004" in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(directory, payload, collective)

    monkeypatch.setattr(ckpt_mod, "save_dcp", full_at_the_end)
    with pytest.raises(CheckpointError, match="No space left on device"):
        train(cfg)
    root = Path(cfg.run_dir) / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_00000002"] and verify(root / "step_00000002") is None


@pytest.mark.slow
def test_more_ranks_than_declared_devices_fail_alike_on_every_rank(make_cfg, tmp_path):
    """Checked before any collective: each of the three ranks prints the same line (none dies in
    a gloo traceback waiting for a peer that already left)."""
    cfg = make_cfg("three", steps=3)
    raw = cfg.model_dump(mode="json")
    raw["cluster"]["nodes"] = [{"host": "localhost", "devices": [{"type": "cpu", "count": 2}]}]
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(raw))
    res = subprocess.run(torchrun_cmd(3, "-m", "hetforge", "train", str(path)), cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    # every rank that speaks says the same (torchrun stops the others once the first has exited, so
    # on a loaded machine not all three may get to; lines of two ranks can also run together)
    lines = re.findall(r"error: (.*?launch one rank per declared device \(torchrun --nnodes / --nproc-per-node\))", out)
    assert res.returncode != 0 and lines, out[-3000:]
    assert len(set(lines)) == 1 and "declares 2 device(s) on 1 node(s) but 3 ranks were launched" in lines[0]
    assert "Traceback" not in "\n".join(ln for ln in out.splitlines() if ln.startswith("[rank"))
    assert not Path(cfg.run_dir).exists()  # nothing written


def test_declared_memory_a_datasheet_figure_above_the_drivers_is_taken_as_the_drivers():
    from hetforge.cluster.spec import usable_memory
    from hetforge.config import ConfigError

    GiB = 2**30
    v100 = 15.77 * GiB  # what the driver reports for a "16 GB" V100
    assert usable_memory(16 * GiB, v100, "V100") == v100  # the README's {type: V100, memory_gb: 16}
    assert usable_memory(12 * GiB, v100, "V100") == 12 * GiB  # less declared: a budget, kept
    assert usable_memory(None, v100, "V100") == v100 and usable_memory(8 * GiB, None, "cpu") == 8 * GiB
    with pytest.raises(ConfigError, match="memory_gb=32 \\(GiB\\) but reports 15.8 GiB"):
        usable_memory(32 * GiB, v100, "V100")


def test_a_declared_cluster_run_as_one_process_says_so(make_cfg, capsys):
    cfg = make_cfg("alone", steps=3)
    cfg = cfg.model_copy(update={"cluster": type(cfg.cluster).model_validate(
        {"nodes": [{"devices": [{"type": "cpu", "count": 2}]}]})})
    assert train(cfg).step == 3
    err = capsys.readouterr().err
    assert "the cluster declares 2 devices but this is one process" in err
