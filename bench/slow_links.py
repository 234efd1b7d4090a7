"""Layouts over a slow link: FSDP across two nodes against a pipeline, and the planner's choice,
at 1 and 10 Gbit/s, side by side.

Two nodes on this machine (tests/netns.py: network namespaces joined by a veth pair shaped with tc),
two CPU ranks each, launched as `hetforge launch` prints. The model has 4 blocks at d=1024 with an
8k vocabulary (67M parameters: 134 MB of 16-bit weights, 268 MB in fp32), and each rank declares
0.6 GiB: the whole training state (1.07 GB) does not fit on one node's pair, so neither replication,
nor ZeRO, nor FSDP within a node (HSDP) fits; FSDP over all four ranks, a 2-stage pipeline (one
stage a node, replicated over the node's two ranks) and a 4-stage pipeline do. Per link speed: FSDP
across the nodes, the 2-stage pipeline under 1F1B and interleaved (two chunks a rank), the 4-stage
one, and `parallel.pipeline.stages: auto` (the planner's choice at the declared links), each
trained a few steps; the measured step is the median of the steps after the
first two. The predicted steps are the plan's layout table at that link (CPU ranks' rate: this
machine's single-thread matmul peak, halved as four ranks share two cores). The link declared to
the planner (`cluster.inter_node_gbit`) is what gloo's all-gather and reduce-scatter of the
model's weights reach through the shaped link, probed first, as a lab would measure its own.

    sudo .venv/bin/python bench/slow_links.py              # about 10 minutes on 2 cores
    sudo .venv/bin/python bench/slow_links.py --per-node 1 # one rank a node, a core each (0.85 GiB a rank:
                                                           # FSDP over both and a 2-stage pipeline fit)

With two ranks a node, four ranks share this machine's two cores: a pipeline's idle stages lend
their core to the busy ones, which no cluster of separate cards does, so its measured steps are
shorter than predicted; `--per-node 1` gives each rank a core of its own.

Last line: one JSON object with bench, auto_vs_fsdp_1g, auto_vs_best_1g, auto_vs_best_10g,
median_step_error, ranking_right and the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.config import build_config  # noqa: E402
from hetforge.core.metrics import read_metrics  # noqa: E402
from tests.netns import TwoNodes, why_not  # noqa: E402

MEMORY_GB = {2: 0.6, 1: 0.85}  # per rank, by ranks a node: the state fits neither one node nor one rank
LAYOUTS = {"fsdp": {"strategy": "fsdp"}, "pipeline-2": {"pipeline": {"stages": 2, "schedule": "1f1b"}},
           "pipeline-2-interleaved": {"pipeline": {"stages": 2, "schedule": "interleaved"}},
           "pipeline-4": {"pipeline": {"stages": 4, "schedule": "1f1b"}}, "auto": {"pipeline": {"stages": "auto"}}}


def table_row(layout: str, name: str) -> bool:
    """Whether a row of the plan's layout table (its `layout`) is the bench's layout `name`."""
    if name == "fsdp":
        return layout == "fsdp"
    stages, interleaved = int(name.split("-")[1]), name.endswith("interleaved")
    return (layout.startswith(f"pipeline {stages} stages") and ("interleaved" in layout) == interleaved
            and "sharded" not in layout)


def matmul_tflops() -> float:
    """This machine's fp32 matmul rate on one thread (what a rank gets of a core, doubled)."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    return 2 * 512 ** 3 * n / (time.perf_counter() - t0) / 1e12


PARAMS = 67_000_000  # about the model's parameters: the probe's buffer is its fp32 weights


def probe_rank() -> None:
    """One rank of the link probe (run by `probe_link` in each namespace): FSDP's two collectives
    on the model's fp32 weights across the four ranks, timed after a warm-up; prints the bytes each
    rank sent per second."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shard = torch.ones(PARAMS // world)
    full = torch.empty(PARAMS)
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        dist.all_gather_single(full, shard) if i % 2 == 0 else dist.reduce_scatter_single(shard, full)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    sent = 4 * PARAMS * (world - 1) / world
    if dist.get_rank() == 0:
        print(json.dumps({"bytes_per_s": sent / statistics.mean(times)}), flush=True)
    dist.destroy_process_group()


def probe_link(nodes: TwoNodes, port: int, per_node: int) -> float:
    """Gbit/s that gloo's collectives reach across the shaped link (what a lab would measure with
    its own collectives before declaring `cluster.inter_node_gbit`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "node-a",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(2 * per_node)}
    procs = [nodes.popen(host, [sys.executable, __file__, "--probe-rank"], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True, start_new_session=True, env={**env, "RANK": str(rank)})
             for rank, host in enumerate(["node-a"] * per_node + ["node-b"] * per_node)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    return json.loads(outs[0].strip().splitlines()[-1])["bytes_per_s"] * 8 / 1e9


def config(work: Path, name: str, layout: dict, gbit: float, peak: float, steps: int, per_node: int = 2) -> Path:
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": [
        {"host": h, "devices": [{"type": "cpu", "count": per_node, "memory_gb": MEMORY_GB[per_node]}]}
        for h in ("node-a", "node-b")]}))
    raw = {"name": name, "run_dir": str(work / name),
           "data": {"sources": [{"type": "aclsum"}], "out_dir": str(ROOT / "data_cache" / "aclsum-8k"),
                    "tokenizer": {"vocab_size": 8192}},
           "model": {"preset": None, "n_layers": 4, "d_model": 1024, "n_heads": 16},
           "train": {"steps": steps, "seq_len": 32, "micro_batch_size": 2, "global_batch_tokens": 16 * 32,
                     "warmup_steps": 1, "log_interval": 1, "eval_interval": 1000, "final_eval_batches": 1,
                     "save_checkpoints": False, "progress": False, "tensorboard": False, "num_threads": 1,
                     "peak_tflops": peak},
           "cluster": {"file": str(cluster), "inter_node_gbit": gbit, "balance": "equal"},
           "parallel": {"link_gbps": 2.0, **layout}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(build_config(raw).model_dump(mode="json")))
    return path


def run(nodes: TwoNodes, path: Path, port: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    printed = subprocess.run([sys.executable, "-m", "hetforge", "launch", str(path), "--port", str(port),
                              "--max-restarts", "0", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True)
    procs = [nodes.popen(c["host"], c["argv"], cwd=ROOT, env={**env, **c["env"]}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for c in json.loads(printed.stdout)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:  # a launcher's workers outlive it: end each node's whole process group
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{path.name} failed:\n" + "\n".join(o[-3000:] for o in outs))
    run_dir = Path(yaml.safe_load(path.read_text())["run_dir"])
    steps = [r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl")["train"] if r["step"] > 2]
    plan = json.loads((run_dir / "plan.json").read_text())
    pipe = plan.get("pipeline")
    return {"measured_s": statistics.median(steps), "strategy": plan["strategy"],
            "stages": pipe["stages"] if pipe else None, "layouts": plan.get("layouts", []),
            "layout": (f"pipeline {pipe['stages']} stages" + (" interleaved" if pipe["virtual"] > 1 else "")
                       + (", stages sharded" if pipe["shard"] else "")) if pipe else plan["strategy"]}


def predicted(layouts: list[dict], name: str) -> float | None:
    for c in layouts:
        if c["fits"] and table_row(c["layout"], name):
            return c["step_s"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--per-node", type=int, choices=(1, 2), default=2,
                    help="ranks a node: 1 gives each rank a core of its own (no pipeline of 4 stages)")
    ap.add_argument("--probe-rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe_rank:
        return probe_rank()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still tears its namespaces down
    reason = why_not()
    if reason:
        sys.exit(f"bench/slow_links.py {reason}")
    per_node = args.per_node
    peak = matmul_tflops() * (2 / (2 * per_node))  # the ranks share two cores
    fixed = ("fsdp", "pipeline-2", "pipeline-2-interleaved", "pipeline-4") if per_node == 2 else \
        ("fsdp", "pipeline-2", "pipeline-2-interleaved")
    layouts_run = {n: LAYOUTS[n] for n in (*fixed, "auto")}
    work = Path(tempfile.mkdtemp(prefix="hetforge-slow-links-"))
    rows, port = {}, 29800
    effective = {}
    for gbit in (1, 10):
        with TwoNodes(rate_mbit=gbit * 1000) as nodes:
            effective[gbit] = probe_link(nodes, port, per_node)
            print(f"{gbit} Gbit/s shaped: gloo's collectives reach {effective[gbit]:.3g} Gbit/s", flush=True)
            for name, layout in layouts_run.items():
                port += 1
                got = run(nodes, config(work, f"{name}-{gbit}g", layout, effective[gbit], peak, args.steps, per_node),
                          port)
                rows[(gbit, name)] = got
                print(f"{gbit} Gbit/s {name}: {got['measured_s']:.2f} s a step ({got['layout']})", flush=True)
    figures: dict = {"bench": "slow_links" if per_node == 2 else "slow_links_1_per_node"}
    errors, ranking = [], True
    for gbit in (1, 10):
        layouts = rows[(gbit, "auto")]["layouts"]
        measured = {n: rows[(gbit, n)]["measured_s"] for n in layouts_run}
        best = min(measured[n] for n in fixed)
        figures[f"auto_vs_best_{gbit}g"] = round(best / measured["auto"], 3)
        if gbit == 1:
            figures["auto_vs_fsdp_1g"] = round(measured["fsdp"] / measured["auto"], 3)
        pred = {n: predicted(layouts, n) for n in fixed}
        for n in fixed:
            errors.append(abs(pred[n] / measured[n] - 1))
            figures[f"{n}_{gbit}g_s"] = {"measured": round(measured[n], 3), "predicted": round(pred[n], 3)}
        auto = rows[(gbit, "auto")]
        figures[f"auto_{gbit}g"] = auto["layout"]
        ranking &= sorted(fixed, key=pred.get) == sorted(fixed, key=measured.get)
    figures["declared_gbit"] = {f"{g}g": round(effective[g], 3) for g in effective}
    figures["median_step_error"] = round(statistics.median(errors), 3)
    figures["ranking_right"] = ranking
    record(figures)


if __name__ == "__main__":
    main()
