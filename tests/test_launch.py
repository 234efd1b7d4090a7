"""`hetforge launch` prints the per-node commands of a cluster file; run as printed (here two
torchrun launchers on this machine, one c10d rendezvous), each launched node gets its declared
devices whichever joined first."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetforge.cluster.launch import LaunchOptions, node_commands, sbatch_script
from hetforge.config import NodeSpec
from tests.test_distributed import ENV, ROOT
from tests.test_two_nodes import uneven_nodes_config

NODES = [NodeSpec.model_validate({"host": "node-a", "devices": [{"type": "V100", "count": 2, "memory_gb": 32}]}),
         NodeSpec.model_validate({"host": "node-b", "devices": [{"type": "P100"}, {"type": "cpu"}]}),
         NodeSpec.model_validate({"host": "node-c", "devices": [{"type": "P100"}, {"type": "T4"}]})]


def test_one_torchrun_per_node_on_one_rendezvous():
    cmds = node_commands(NODES, ["train", "run.yaml"], LaunchOptions(port=1234, max_restarts=2,
                                                                   env={"NCCL_DEBUG": "WARN"}, job_id="job"))
    assert [c.node for c in cmds] == [0, 1, 2] and [c.devices for c in cmds] == [2, 2, 2]
    for c in cmds:
        a = c.argv
        assert a[a.index("--nnodes") + 1] == "3" and a[a.index("--rdzv-endpoint") + 1] == "node-a:1234"
        assert a[a.index("--rdzv-backend") + 1] == "c10d" and a[a.index("--max-restarts") + 1] == "2"
        assert a[-3:] == ["hetforge", "train", "run.yaml"] and c.env == {"HETFORGE_NODE": str(c.node), "NCCL_DEBUG": "WARN"}
        assert c.shell().startswith(f"HETFORGE_NODE={c.node} NCCL_DEBUG=WARN torchrun ")
    script = sbatch_script(NODES, ["train", "run.yaml"], LaunchOptions(port=1234))
    assert script.count("#SBATCH hetjob") == 1  # two node shapes: (2 tasks, 2 GPUs) twice, (2 tasks, 1 GPU)
    assert "#SBATCH --nodes=2 --ntasks-per-node=2 --gpus-per-node=2" in script
    assert "#SBATCH --nodes=1 --ntasks-per-node=2 --gpus-per-node=1" in script
    assert "srun --het-group=0,1 hetforge train run.yaml" in script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 1])
def test_the_printed_launch_trains_and_each_node_gets_its_devices(data_dir, tmp_path, first):
    """Node 0 declares two ranks of 1 GiB at speed 1, node 1 one rank of 3 GiB at speed 2: the
    plan gives node 1's rank its memory and twice the samples, whichever launcher joined first
    (under c10d the first gets the lowest ranks)."""
    path = uneven_nodes_config(tmp_path, data_dir, ("localhost", "localhost"), 1.0)
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    printed = subprocess.run([sys.executable, "-m", "hetforge", "launch", str(path), "--port", str(_free_port()),
                              "--max-restarts", "0", "--json"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    commands = json.loads(printed.stdout)
    procs = []
    try:
        for c in (commands[first], commands[1 - first]):
            procs.append(subprocess.Popen(c["argv"], cwd=ROOT, env={**env, **c["env"]}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
            time.sleep(3)  # this one joins the rendezvous first
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    by_rank = {r["rank"]: r for r in plan["ranks"]}
    node1 = [r for r in by_rank.values() if r["node"] == 1]
    assert len(node1) == 1 and node1[0]["memory_bytes"] == 3 * 2**30
    assert node1[0]["rank"] == (0 if first == 1 else 2)  # the first launcher's ranks come first
    shares = {s["rank"]: s["samples"] for s in plan["balance"]["shares"]}
    assert shares[node1[0]["rank"]] == 8 and sorted(shares.values()) == [4, 4, 8]
