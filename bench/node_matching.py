"""Declared devices on the right node over many two-node launches in random join order.

Two nodes on this machine (tests/netns.py: network namespaces with their own host names, a 1 Gbit/s
link), a cluster file declaring node-a with two CPU ranks of 1 GiB and node-b with one of 3 GiB;
each launch starts the two torchrun commands `hetforge launch` prints (HETFORGE_NODE left out:
nodes are found by host) in a random order with a random gap, on one c10d rendezvous, and resolves
the run's plan (`hetforge balance`). A launch is mis-mapped when a rank's planned memory is not its
host's declaration.

    sudo .venv/bin/python bench/node_matching.py --launches 20

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.config import build_config  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402
from tests.netns import TwoNodes, why_not  # noqa: E402

DECLARED = {"node-a": 1.0, "node-b": 3.0}  # GiB a rank


def config(work: Path, data: Path, port_run: int) -> Path:
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": [
        {"host": "node-a", "devices": [{"type": "cpu", "count": 2, "memory_gb": DECLARED["node-a"], "speed": 1.0}]},
        {"host": "node-b", "devices": [{"type": "cpu", "memory_gb": DECLARED["node-b"], "speed": 2.0}]}]}))
    raw = {"name": f"match{port_run}", "run_dir": str(work / f"run{port_run}"),
           "data": {"sources": [{"type": "aclsum"}], "out_dir": str(data), "tokenizer": {"vocab_size": 512}},
           "model": {"preset": None, "n_layers": 2, "d_model": 64, "n_heads": 4},
           "train": {"seq_len": 32, "micro_batch_size": 4, "global_batch_tokens": 16 * 32, "progress": False,
                     "tensorboard": False, "num_threads": 1},
           "cluster": {"file": str(cluster)}, "parallel": {"link_gbps": 0.1}}
    path = work / f"run{port_run}.yaml"
    path.write_text(yaml.safe_dump(build_config(raw).model_dump(mode="json")))
    return path


def launch(nodes: TwoNodes, path: Path, port: int, rng: random.Random) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    printed = subprocess.run([sys.executable, "-m", "hetforge", "launch", str(path), "--port", str(port),
                              "--max-restarts", "0", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True)
    commands = json.loads(printed.stdout)
    order = [0, 1] if rng.random() < 0.5 else [1, 0]
    procs = []
    for k in order:
        c = commands[k]
        argv = [a if a != "train" else "balance" for a in c["argv"]]  # resolve the plan, no training
        own = {key: v for key, v in c["env"].items() if key != "HETFORGE_NODE"}
        procs.append(nodes.popen(c["host"], argv, cwd=ROOT, env={**env, **own}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
        time.sleep(rng.uniform(0.0, 2.0))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a launch failed:\n" + "\n".join(o[-2000:] for o in outs))
    plan = json.loads((Path(yaml.safe_load(path.read_text())["run_dir"]) / "plan.json").read_text())
    wrong = [r["rank"] for r in plan["ranks"] if r["memory_bytes"] != DECLARED[r["host"]] * 2**30]
    first_host = plan["ranks"][0]["host"]
    return {"order": "node-b first" if order[0] == 1 else "node-a first", "rank0_host": first_host,
            "mis_mapped": len(wrong)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reason = why_not()
    if reason:
        sys.exit(f"bench/node_matching.py {reason}")
    work = Path(tempfile.mkdtemp(prefix="hetforge-nodes-"))
    data = work / "data"
    prepare(build_config({"data": {"sources": [{"type": "aclsum"}], "out_dir": str(data),
                                   "tokenizer": {"vocab_size": 512}}}).data, progress=False, verbose=False)
    rng = random.Random(args.seed)
    rows = []
    with TwoNodes(rate_mbit=1000) as nodes:
        for i in range(args.launches):
            rows.append(launch(nodes, config(work, data, 29700 + i), 29700 + i, rng))
            print(f"launch {i + 1}/{args.launches}: {rows[-1]}", flush=True)
    record({"bench": "node_matching", "launches": len(rows), "mis_mapped": sum(r["mis_mapped"] > 0 for r in rows),
            "node_b_joined_first": sum(r["order"] == "node-b first" for r in rows),
            "rank0_on_node_b": sum(r["rank0_host"] == "node-b" for r in rows)})


if __name__ == "__main__":
    main()
