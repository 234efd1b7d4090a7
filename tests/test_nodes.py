"""Declared nodes are matched to launched ranks by identity (host, or HETFORGE_NODE), not by the
order the launchers joined in, and every mismatch is one line naming both sides."""

from __future__ import annotations

import pytest

from hetforge.cluster.spec import match_nodes
from hetforge.config import ConfigError, NodeSpec

GIB = 2**30


def node(host: str, *devices: dict) -> NodeSpec:
    return NodeSpec.model_validate({"host": host, "devices": list(devices) or [{"type": "cpu"}]})


def rank(r: int, host: str, local: int, launch_node: int = 0, node_env: str | None = None, device: str = "cpu",
         memory: float | None = None) -> dict:
    return {"rank": r, "host": host, "node": node_env, "launch_node": launch_node, "local_rank": local,
            "device": device, "memory": memory}


TWO = [node("node-a", {"type": "cpu", "count": 2, "memory_gb": 8}), node("node-b", {"type": "cpu", "memory_gb": 2})]


@pytest.mark.parametrize("order", ["a first", "b first"])
def test_ranks_get_their_hosts_node_whatever_the_join_order(order):
    if order == "a first":
        ids = [rank(0, "node-a", 0), rank(1, "node-a", 1), rank(2, "node-b", 0, launch_node=1)]
        assert match_nodes(TWO, ids, "c.yaml") == [0, 0, 1]
    else:  # c10d numbered node-b's launcher 0: its rank is 0, node-a's ranks 1 and 2
        ids = [rank(0, "node-b.cluster.local", 0), rank(1, "NODE-A", 0, launch_node=1), rank(2, "node-a", 1, 1)]
        assert match_nodes(TWO, ids, "c.yaml") == [1, 0, 0]


def test_hetforge_node_names_the_node_where_hosts_cannot():
    same = [node("localhost", {"type": "cpu", "count": 2}), node("localhost", {"type": "cpu"})]
    ids = [rank(0, "vm", 0, node_env="1"), rank(1, "vm", 0, launch_node=1, node_env="0"),
           rank(2, "vm", 1, launch_node=1, node_env="0")]
    assert match_nodes(same, ids, "c.yaml") == [1, 0, 0]
    by_host = [rank(0, "vm", 0, node_env="node-b"), rank(1, "vm", 0, 1, "node-a"), rank(2, "vm", 1, 1, "node-a")]
    assert match_nodes(TWO, by_host, "c.yaml") == [1, 0, 0]
    # several nodes on one host and no name: the launcher's node rank (a static rendezvous honours it)
    static = [rank(0, "vm", 0, 0), rank(1, "vm", 1, 0), rank(2, "vm", 0, 1)]
    assert match_nodes(same, static, "c.yaml") == [0, 0, 1]


def test_a_single_node_without_a_host_runs_anywhere():
    assert match_nodes([node("localhost", {"type": "cpu", "count": 2})], [rank(0, "vm", 0), rank(1, "vm", 1)],
                       "c.yaml") == [0, 0]


def test_mismatches_are_one_line_naming_both_sides():
    swapped = [rank(0, "node-a", 0), rank(1, "node-b", 0, 1), rank(2, "node-b", 1, 1)]
    with pytest.raises(ConfigError, match=r"node 0 \(node-a\) declares 2 device\(s\) but 1 rank\(s\) run there "
                                          r"\(ranks 0 on host node-a\); node 1 \(node-b\) declares 1 device\(s\) "
                                          r"but 2 rank\(s\) run there \(ranks 1-2 on host node-b\)"):
        match_nodes(TWO, swapped, "c.yaml")
    with pytest.raises(ConfigError, match="host node-c, which is no node of c.yaml.*HETFORGE_NODE"):
        match_nodes(TWO, [rank(0, "node-a", 0), rank(1, "node-a", 1), rank(2, "node-c", 0, 1)], "c.yaml")
    with pytest.raises(ConfigError, match="HETFORGE_NODE=node-z names no node of c.yaml"):
        match_nodes(TWO, [rank(0, "vm", 0, node_env="node-z")], "c.yaml")
    twice = [rank(0, "vm", 0, 0, "0"), rank(1, "vm", 1, 0, "0"), rank(2, "vm", 0, 1, "node-a")]
    with pytest.raises(ConfigError, match="both run as node 0"):
        match_nodes(TWO, twice, "c.yaml")


def test_a_gpu_rank_must_have_the_card_its_node_declares():
    gpus = [node("gpu1", {"type": "V100", "memory_gb": 32}, {"type": "P100"})]
    ids = [rank(0, "gpu1", 0, device="Tesla V100-SXM2-32GB", memory=31.7 * GIB),
           rank(1, "gpu1", 1, device="Tesla P100-PCIE-16GB", memory=15.9 * GIB)]
    assert match_nodes(gpus, ids, "c.yaml") == [0, 0]
    ids[1] = rank(1, "gpu1", 1, device="NVIDIA A100-SXM4-40GB", memory=39.4 * GIB)
    with pytest.raises(ConfigError, match="rank 1 on host gpu1 has a NVIDIA A100-SXM4-40GB but c.yaml declares P100"):
        match_nodes(gpus, ids, "c.yaml")
    with pytest.raises(ConfigError, match="has no GPU but c.yaml declares V100"):
        match_nodes(gpus, [rank(0, "gpu1", 0), rank(1, "gpu1", 1)], "c.yaml")


def test_doctor_says_what_a_run_will_see_here(tmp_path, capsys, monkeypatch):
    import yaml

    from hetforge.cli import main
    from hetforge.cluster.doctor import torch_version_problem

    assert torch_version_problem("2.13.0+cu126") is None and torch_version_problem("2.6.0") is None
    assert "older than 2.6" in torch_version_problem("2.5.1+cu121")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": [{"host": "gpu1", "devices": [{"type": "cpu"}]},
                                                 {"host": "gpu2", "devices": [{"type": "cpu", "count": 2}]}]}))
    monkeypatch.setenv("HETFORGE_NODE", "gpu2")
    assert main(["doctor", "--cluster", str(cluster)]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "interface" in out
    assert "node 1 (gpu2)" in out and "HETFORGE_NODE=gpu2" in out
    if not __import__("torch").cuda.is_available():
        assert "runs train on the CPU" in out
