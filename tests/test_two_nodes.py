"""Two nodes on this machine (tests/netns.py: network namespaces, their own host names, a shaped
link): a run launched as `hetforge launch` prints it finds each declared node by its host."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hetforge.config import build_config
from tests.conftest import tiny_raw
from tests.netns import TwoNodes, why_not
from tests.test_distributed import ENV, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not() is not None, reason=str(why_not()))]

PORT = 29611


def test_the_link_is_shaped_and_the_namespaces_are_removed():
    with TwoNodes(rate_mbit=200) as nodes:
        names = {h: nodes.run(h, ["hostname"], capture_output=True, text=True).stdout.strip() for h in ("node-a", "node-b")}
        server = nodes.popen("node-a", [sys.executable, "-c", (
            "import socket, time\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5561))\n"
            "s.listen(1); c, _ = s.accept(); t, n = time.monotonic(), 0\n"
            "while (b := c.recv(1 << 20)): n += len(b)\n"
            "print(n * 8 / (time.monotonic() - t) / 1e6)")], stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        nodes.run("node-b", [sys.executable, "-c", (
            "import socket, time\n"
            "s = socket.create_connection(('node-a', 5561)); t = time.monotonic()\n"
            "while time.monotonic() - t < 2: s.sendall(b'x' * (1 << 20))\n")], check=True)
        mbit = float(server.communicate(timeout=60)[0])
        made = list(nodes.ns.values())
    assert names == {"node-a": "node-a", "node-b": "node-b"}
    assert 0 < mbit <= 200 * 1.05  # the shape caps the link (a shared machine may give it less)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in made)


def uneven_nodes_config(tmp_path, data_dir, hosts: tuple[str, str], link_gbps: float) -> Path:
    """A run on two nodes: the first declares two ranks of 1 GiB at speed 1, the second one rank
    of 3 GiB at speed 2, so the plan shows whether each node got its own devices."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": [
        {"host": hosts[0], "devices": [{"type": "cpu", "count": 2, "memory_gb": 1.0, "speed": 1.0}]},
        {"host": hosts[1], "devices": [{"type": "cpu", "memory_gb": 3.0, "speed": 2.0}]}]}))
    raw = tiny_raw(tmp_path / "run", data_dir, steps=3, global_batch_tokens=16 * 32, eval_interval=1000)
    raw.update(cluster={"file": str(cluster)}, parallel={"link_gbps": link_gbps})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(build_config(raw).model_dump(mode="json")))
    return path


def _run_config(tmp_path, data_dir) -> Path:
    return uneven_nodes_config(tmp_path, data_dir, ("node-a", "node-b"), 0.1)


def _launch(nodes: TwoNodes, path: Path, hosts: tuple[str, str]) -> list[tuple[int, str]]:
    """Every node's command as `hetforge launch` printed it, run on `hosts` (by host name alone:
    HETFORGE_NODE left out), node 0's first."""
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    printed = subprocess.run([sys.executable, "-m", "hetforge", "launch", str(path), "--port", str(PORT),
                              "--max-restarts", "0", "--json"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    procs = []
    for c, host in zip(json.loads(printed.stdout), hosts):
        own = {k: v for k, v in c["env"].items() if k != "HETFORGE_NODE"}
        procs.append(nodes.popen(host, c["argv"], cwd=ROOT, env={**env, **own}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
        time.sleep(2)
    try:
        return [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_each_node_finds_its_declaration_by_host(data_dir, tmp_path):
    path = _run_config(tmp_path, data_dir)
    with TwoNodes(rate_mbit=1000) as nodes:
        results = _launch(nodes, path, ("node-a", "node-b"))
    assert all(rc == 0 for rc, _ in results), "\n".join(out[-3000:] for _, out in results)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [(r["node"], r["host"], r["memory_bytes"] / 2**30) for r in plan["ranks"]] == [
        (0, "node-a", 1.0), (0, "node-a", 1.0), (1, "node-b", 3.0)]
    assert [s["samples"] for s in plan["balance"]["shares"]] == [4, 4, 8]


def test_a_node_launched_on_the_other_host_is_one_line_naming_both(data_dir, tmp_path):
    path = _run_config(tmp_path, data_dir)
    with TwoNodes() as nodes:
        results = _launch(nodes, path, ("node-b", "node-a"))  # each node's command on the other host
    assert all(rc != 0 for rc, _ in results)
    lines = {ln[ln.index("error:"):] for _, out in results for ln in out.splitlines() if "error:" in ln}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert re.search(r"node 0 \(node-a\) declares 2 device\(s\) but 1 rank\(s\) run there .*host node-a.*"
                     r"node 1 \(node-b\) declares 1 device\(s\) but 2 rank\(s\) run there .*host node-b", line), line
