"""Multi-process tests: gloo on localhost under torchrun, as a user would launch them."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train
from hetforge.core.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", *args]


def run_train(cfg, nproc: int, tmp_path, *extra, timeout=240, max_restarts=0) -> subprocess.CompletedProcess:
    path = tmp_path / f"{Path(cfg.run_dir).name}-{nproc}.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return run_torchrun(torchrun_cmd(nproc, "-m", "hetforge", "train", str(path), *extra, max_restarts=max_restarts),
                        timeout)


def run_torchrun(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    # its own session, so that a hung launch can be signalled whole; faulthandler prints every rank's
    # stacks on SIGABRT, so the failure says where each rank was waiting
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout}s; its output:\n{out[-4000:]}\n"
                             f"stacks:\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def losses(cfg) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")["train"]}


def final_weights(cfg) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(cfg.run_dir, "model")


def consolidated(cfg) -> dict[str, torch.Tensor]:
    """The final weights, whatever wrote them (a sharded run's are consolidated from its shards)."""
    from hetforge.model.load import load_for_inference

    return {k: v.detach() for k, v in load_for_inference(cfg.run_dir)[0].state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def two_cpus(slowdowns=(1.0, 1.0), memory_gb=4.0, from_step=0) -> dict:
    return {"nodes": [{"host": "localhost", "devices": [
        {"type": "cpu", "memory_gb": memory_gb, "slowdown": s, "slowdown_from_step": from_step if s > 1 else 0}
        for s in slowdowns]}]}


def with_cluster(make_cfg, name, cluster: dict, **train_kw):
    cfg = make_cfg(name, **train_kw)
    return cfg.model_copy(update={"cluster": type(cfg.cluster).model_validate(cluster)})


@pytest.mark.slow
def test_unequal_shares_give_the_global_batch_gradient(tmp_path, data_dir):
    sys.path.insert(0, str(ROOT / "tests"))
    import dist_worker

    out = tmp_path / "grads.pt"
    res = run_torchrun(torchrun_cmd(2, str(ROOT / "tests" / "dist_worker.py"), str(out), str(data_dir), "3x3,5x3"),
                       timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    # the same 8 samples as one micro-batch in one process
    model, samples, order = dist_worker.setup(data_dir)
    from hetforge.train.loop import backward_share
    from hetforge.core.precision import Precision
    from hetforge.train.parallel import Parallel

    prec = Precision("fp32", torch.device("cpu"))
    loss, _ = backward_share(Parallel(model, "single"), samples, order, [(40, 8)], 40, 8 * dist_worker.SEQ, prec,
                             prec.grad_scaler(), torch.device("cpu"))
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert max_diff(got["grads"], ref) <= 1e-6
    assert float(got["loss"]) == pytest.approx(float(loss), abs=1e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """One process, global batch 8, 6 steps: what every distributed variant must reproduce."""
    from tests.conftest import tiny_raw
    from hetforge.config import build_config

    cfg = build_config(tiny_raw(tmp_path_factory.mktemp("ref") / "ref", data_dir, steps=6, micro_batch_size=8,
                                checkpoint_interval=3))
    train(cfg)
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("shares", [[(3, 3), (5, 3)], [(8, 4), (0, 1)]], ids=["3+5", "8+0"])
def test_distributed_run_equals_single_process(make_cfg, tmp_path, reference, shares):
    cluster = {**two_cpus(), "balance": "fixed",
               "assignments": [{"samples": n, "micro_batch_size": b} for n, b in shares]}
    cfg = with_cluster(make_cfg, "dist", cluster, steps=6, micro_batch_size=8, checkpoint_interval=3)
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got, ref = losses(cfg), losses(reference)
    assert sorted(got) == list(range(1, 7))
    assert all(got[s] == pytest.approx(ref[s], abs=1e-6) for s in ref)
    # gradients agree to 1e-6 (test above); Adam's g / sqrt(v) magnifies that rounding on
    # near-zero gradient entries, so after 6 steps the weights agree to ~1e-5 of their scale
    assert max_diff(final_weights(cfg), final_weights(reference)) <= 1e-4
    plan = json.loads((Path(cfg.run_dir) / "balance.json").read_text())
    assert [s["samples"] for s in plan["shares"]] == [n for n, _ in shares]
    # per-rank MFU, each against its own peak (1 TFLOP/s configured): weighted by the peaks they
    # give the job's MFU, and a rank with no samples has none
    for rec in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")["train"]:
        assert len(rec["rank_mfu"]) == 2 and sum(rec["rank_mfu"]) / 2 == pytest.approx(rec["mfu"], rel=1e-9)
        assert (rec["rank_mfu"][1] == 0.0) == (shares[1][0] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_resume_on_a_different_world_size(make_cfg, tmp_path, reference, first, second):
    cfg = with_cluster(make_cfg, f"resume{first}{second}", {}, steps=6, micro_batch_size=8, checkpoint_interval=3)
    if first == 1:
        train(cfg, stop_after=3)
    else:
        assert run_train(cfg, 2, tmp_path, "--stop-after", "3").returncode == 0
    if second == 1:
        train(cfg)
    else:
        res = run_train(cfg, 2, tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    got, ref = losses(cfg), losses(reference)
    assert sorted(got) == list(range(1, 7))
    assert all(got[s] == pytest.approx(ref[s], abs=1e-5) for s in ref)


def _worker_pid(parent: int, local_rank: int) -> int | None:
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            stat = (child / "stat").read_text().split()
            env = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[3]) == parent and f"LOCAL_RANK={local_rank}".encode() in env:
            return int(child.name)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("strategy,victim", [("ddp", 1), ("fsdp", 1), ("fsdp", 0)])
def test_killed_rank_restarts_from_checkpoint_with_identical_result(make_cfg, tmp_path, strategy, victim):
    """kill -9 of a rank (rank 0 too, which holds the checkpoint's publication) while a sharded
    checkpoint is written where the kill lands in one: the survivor names it in one line, the
    launcher restarts the job, which resumes (though started with --no-resume: that is the first
    launch's) and ends with the uninterrupted run's weights, bitwise."""
    cluster = {**two_cpus(slowdowns=(20.0, 20.0)), "balance": "fixed",
               "assignments": [{"samples": 3, "micro_batch_size": 3}, {"samples": 5, "micro_batch_size": 5}]}
    kw = dict(steps=30, micro_batch_size=8, checkpoint_interval=5, eval_interval=1000)
    parallel = {"parallel": type(make_cfg("p").parallel).model_validate({"strategy": strategy})}
    clean = with_cluster(make_cfg, "clean", cluster, **kw).model_copy(update=parallel)
    assert run_train(clean, 2, tmp_path).returncode == 0

    cfg = with_cluster(make_cfg, "faulty", cluster, **kw).model_copy(update=parallel)
    path = tmp_path / "faulty.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.Popen(torchrun_cmd(2, "-m", "hetforge", "train", str(path), "--no-resume", max_restarts=1),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = Path(cfg.run_dir) / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (root / "step_00000010").exists() and not list(root.glob(".step_00000010.tmp-*")):
        time.sleep(0.02)  # step 5's checkpoint is behind it: the restart has one to resume from
    pid = _worker_pid(proc.pid, victim)
    assert pid is not None
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in proc.stdout), daemon=True)
    reader.start()
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=240)
    reader.join(timeout=30)
    out = "".join(ln for _, ln in lines)
    assert proc.returncode == 0, out[-3000:]
    survivor = 1 - victim
    named = [(t, ln) for t, ln in lines if re.search(
        rf"error: rank {survivor} \(\S+\): (lost rank {victim} |rank {victim} \(\S+\) stopped answering)", ln)]
    assert len(named) == 1, out[-4000:]
    print(f"rank {victim} named by rank {survivor} {named[0][0] - killed_at:.1f}s after kill -9")
    assert named[0][0] - killed_at < 60  # one-sided: the heartbeat names a silent peer within seconds
    named = [ln for _, ln in named]
    assert "--no-resume" not in named[0]  # the relaunch hint is to resume
    assert "resumed from" in out
    assert max_diff(consolidated(cfg), consolidated(clean)) == 0.0


@pytest.mark.slow
def test_rebalance_when_a_rank_slows_down(make_cfg, tmp_path):
    # 8x from step 5: the drift is then (8 - 1) / (8 + 1) = 0.78 of the median; load alone, on a
    # shared 2-core machine, once gave 0.4 for two steps in a row (a rebalance at step 5)
    cluster = {**two_cpus(slowdowns=(1.0, 8.0), from_step=5), "rebalance_threshold": 0.6, "rebalance_window": 2}
    cfg = with_cluster(make_cfg, "drift", cluster, steps=14, micro_batch_size=4, grad_accum=4, eval_interval=1000)
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    events = [e for e in read_metrics(Path(cfg.run_dir) / "metrics.jsonl").get("event", [])
              if e["event"] == "rebalance"]
    assert events, res.stdout[-3000:]
    ev = events[0]
    assert ev["step"] > 5
    assert sum(ev["new_samples"]) == sum(ev["old_samples"]) == 16
    assert ev["new_samples"][1] < ev["old_samples"][1]


@pytest.mark.slow
def test_device_without_enough_memory_is_a_clear_error(make_cfg, tmp_path):
    cfg = with_cluster(make_cfg, "oom", two_cpus(memory_gb=0.0001))
    res = run_train(cfg, 2, tmp_path, timeout=120)
    assert res.returncode != 0
    assert "no data-parallel strategy fits" in res.stderr or "GiB but the model needs about" in res.stderr


@pytest.mark.slow
def test_unreachable_rendezvous_fails_fast(make_cfg, tmp_path):
    cfg = make_cfg("lonely")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens there
    env = {**ENV, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "hetforge", "train", str(path), "--set", "cluster.rendezvous_timeout_s=3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert res.returncode == 2
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 3s" in res.stderr
    assert [line for line in res.stderr.splitlines() if line.strip()] == [res.stderr.strip()]  # one line, no trace
    assert time.time() - t0 < 60


@pytest.mark.slow
def test_a_device_with_less_memory_gets_a_plan_and_a_smaller_share(make_cfg, tmp_path):
    """Two CPU ranks of one declared speed, the second declaring 2.6 MiB: the whole tiny model fits
    there only with a recompute/offload plan, each rank trains under its own plan, and the balance
    follows from the plans' predicted slowdowns alone (keep-all time x predicted/keep-all), not from
    timing two processes on a shared machine: the small rank never gets more."""
    from hetforge.cluster.balance import RankInfo, TimeModel, balanced_plan

    cluster = {"nodes": [{"host": "localhost", "devices": [
        {"type": "cpu", "memory_gb": 4.0, "speed": 1.0}, {"type": "cpu", "memory_gb": 2.6 / 1024, "speed": 1.0}]}]}
    cfg = with_cluster(make_cfg, "joint", cluster, steps=4, micro_batch_size=8, global_batch_tokens=16 * 32)
    # replicated (auto would shard the state instead: test_sharded), so the host optimizer can come in
    cfg = cfg.model_copy(update={"memory": type(cfg.memory).model_validate({"budget": "auto"}),
                                 "parallel": type(cfg.parallel).model_validate({"strategy": "ddp"})})
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    big, small = json.loads((Path(cfg.run_dir) / "plan.json").read_text())["ranks"]
    # the run-time check reports every rank's predicted and measured figures
    check = [e for e in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")["event"] if e["event"] == "memory_plan_check"]
    assert len(check) == 1 and [r["rank"] for r in check[0]["ranks"]] == [0, 1]
    assert all(r["predicted_step_s"] > 0 and r["measured_step_s"] > 0 for r in check[0]["ranks"])
    assert set(big["activation_plan"]) == {"keep"}
    assert set(small["activation_plan"]) != {"keep"} or small["optimizer_offload"]  # recomputes or offloads
    assert small["predicted_peak_bytes"] <= 2.6 * 2**20
    balance = json.loads((Path(cfg.run_dir) / "balance.json").read_text())
    shares, models = balance["shares"], balance["models"]
    assert sum(s["samples"] for s in shares) == 16
    assert models[0]["points"] == [[b, float(b)] for b in (1, 2, 4, 8)]  # declared speed, keep-all
    assert models[1]["max_micro"] < 8 and all(t >= b for b, t in models[1]["points"])  # planned: never faster
    assert models[0]["step_costs"] == [] and all(s > 0 for _, s in models[1]["step_costs"]) == bool(
        small["optimizer_offload"])  # the host optimizer step, priced once a step
    infos = [RankInfo(i, "h", "d", None, TimeModel(m["points"], m["max_micro"], m["step_costs"]))
             for i, m in enumerate(models)]
    assert [s.samples for s in balanced_plan(infos, 16).shares] == [s["samples"] for s in shares]
    assert shares[1]["samples"] <= shares[0]["samples"]  # strictly fewer where the profile says so: test_decisions
    assert "per rank" in res.stdout and (Path(cfg.run_dir) / "plan.txt").is_file()
