"""A run is one plan: decided once from the config and the ranks' facts, written to the run
directory, the same object `hetforge plan` prints for the same cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetforge.cluster.facts import DeclaredFacts, card_facts, declared_facts, declared_link
from hetforge.cluster.run_plan import RankFacts, RunPlan, fingerprint, resolve_plan
from hetforge.config import ConfigError, NodeSpec, build_config
from hetforge.model.gpt_neox import GPTNeoXConfig
from tests.conftest import tiny_raw
from tests.test_distributed import ENV, ROOT, run_train

SHAPE = GPTNeoXConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=512)


def nodes(*devices: dict, host: str = "localhost") -> list[NodeSpec]:
    return [NodeSpec.model_validate({"host": host, "devices": list(devices)})]


def cfg_of(**sections):
    raw = {"model": {"preset": None, "n_layers": 2, "d_model": 64, "n_heads": 4},
           "train": {"seq_len": 32, "micro_batch_size": 4, "grad_accum": 6}, "parallel": {"link_gbps": 1.0}}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    return build_config(raw)


def test_shares_follow_the_declared_speeds_and_every_rank_is_described():
    cfg = cfg_of()
    plan = resolve_plan(cfg, SHAPE, declared_facts(cfg, SHAPE, nodes(
        {"type": "cpu", "count": 2, "memory_gb": 1, "speed": 1.0}, {"type": "cpu", "memory_gb": 2, "speed": 2.0}), "x"))
    assert plan.world_size == 3 and plan.strategy == "ddp" and plan.precision == "fp32" and not plan.compile
    assert [s.samples for s in plan.balance.shares] == [6, 6, 12]
    assert all(sum(s.micro_batches) == s.samples for s in plan.balance.shares)
    assert [r.memory_bytes for r in plan.ranks] == [2**30, 2**30, 2**31]
    assert plan.link.source == "declared" and set(plan.step_parts) == {"compute", "collectives"}
    assert plan.predicted_step_s == max(plan.step_parts.values()) > 0
    assert plan.why["strategy"].startswith("auto: ddp")


def test_a_rank_short_of_memory_makes_auto_shard():
    cfg = cfg_of()
    small = 2.2 * 2**20 / 2**30  # a replica's weights, gradients and Adam state (2 MiB) and little more
    plan = resolve_plan(cfg, SHAPE, declared_facts(cfg, SHAPE, nodes(
        {"type": "cpu", "memory_gb": 1, "speed": 1.0}, {"type": "cpu", "memory_gb": small, "speed": 1.0}), "x"))
    assert plan.strategy in ("zero1", "zero2", "fsdp") and "ddp needs" in plan.why["strategy"]
    if plan.strategy == "zero1":  # the optimizer state in proportion to memory
        assert plan.ranks[0].state_share > plan.ranks[1].state_share
    with pytest.raises(ConfigError, match="no data-parallel strategy fits"):
        resolve_plan(cfg, SHAPE, declared_facts(cfg, SHAPE, nodes(
            {"type": "cpu", "count": 2, "memory_gb": 0.5 * 2**20 / 2**30, "speed": 1.0}), "x"))


def test_a_plan_round_trips_through_its_file_and_its_fingerprint_names_what_it_depends_on(tmp_path):
    cfg = cfg_of()
    facts = declared_facts(cfg, SHAPE, nodes({"type": "cpu", "count": 2, "memory_gb": 1, "speed": 1.0}), "x")
    plan = resolve_plan(cfg, SHAPE, facts)
    plan.save(tmp_path)
    assert RunPlan.load(tmp_path).to_dict() == plan.to_dict()
    assert "per rank" in (tmp_path / "plan.txt").read_text()
    assert plan.fingerprint == fingerprint(cfg, SHAPE, facts.ranks)
    other = [RankFacts(r.rank, r.node, "elsewhere", r.device, r.capability, r.memory_bytes, r.speed) for r in facts.ranks]
    assert fingerprint(cfg, SHAPE, other) == plan.fingerprint  # where a rank runs is not what it decides on
    more = [RankFacts(r.rank, r.node, r.host, r.device, r.capability, 2 * r.memory_bytes, r.speed) for r in facts.ranks]
    assert fingerprint(cfg, SHAPE, more) != plan.fingerprint
    assert fingerprint(cfg_of(train={"micro_batch_size": 2}), SHAPE, facts.ranks) != plan.fingerprint


def test_cards_of_a_cluster_get_the_weakest_cards_precision_and_their_kernels():
    cfg = cfg_of(train={"precision": "auto", "seq_len": 256, "micro_batch_size": 2, "grad_accum": 8},
                 memory={"budget": "auto"})
    plan = resolve_plan(cfg, SHAPE, declared_facts(cfg, SHAPE, nodes(
        {"type": "A100-40GB"}, {"type": "V100"}, {"type": "T4"}), "x"))
    assert plan.precision == "fp16" and "no bf16" in plan.why["precision"]
    assert [r.attention for r in plan.ranks] == ["flash", "mem-efficient", "mem-efficient"]  # flash from 8.0
    a100, v100, t4 = plan.balance.shares
    assert a100.samples > v100.samples > t4.samples  # by the cards' datasheets, nothing timed here
    assert all(r.activation_plan is not None and r.predicted_peak_bytes <= r.memory_bytes for r in plan.ranks)
    one = resolve_plan(cfg, SHAPE, card_facts(cfg, SHAPE, "V100"))
    assert one.world_size == 1 and one.strategy == "single" and one.predicted_step_s > 0


def test_one_kind_of_rank_is_planned_once():
    cfg = cfg_of(train={"precision": "auto", "seq_len": 256}, memory={"budget": "auto"})
    facts = declared_facts(cfg, SHAPE, nodes({"type": "T4", "count": 16}), "x")
    assert isinstance(facts, DeclaredFacts) and len({id(v.cache) for v in facts.views}) == 1
    plan = resolve_plan(cfg, SHAPE, facts)
    assert len({tuple(r.activation_plan) for r in plan.ranks}) == 1
    assert declared_link(cfg).bytes_per_s == 1e9


@pytest.mark.slow
def test_a_launched_cpu_cluster_plans_what_plan_cluster_printed(data_dir, tmp_path):
    """Three CPU ranks declared (speeds, memory, the link): the plan a torchrun launch writes to its
    run directory is the very object `hetforge plan --cluster` printed for that cluster."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": [{"host": "localhost", "devices": [
        {"type": "cpu", "count": 2, "memory_gb": 1.0, "speed": 1.0}, {"type": "cpu", "memory_gb": 2.0, "speed": 2.0}]}]}))
    raw = tiny_raw(tmp_path / "run", data_dir, steps=3, global_batch_tokens=12 * 32, eval_interval=1000)
    raw.update(cluster={"file": str(cluster)}, parallel={"link_gbps": 1.0})
    cfg = build_config(raw)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    printed = subprocess.run([sys.executable, "-m", "hetforge", "plan", str(path), "--cluster", str(cluster), "--json"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-3000:]
    res = run_train(cfg, 3, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    launched = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert launched == json.loads(printed.stdout.strip().splitlines()[-1])
    assert [s["samples"] for s in launched["balance"]["shares"]] == [3, 3, 6]



FORGE_CLUSTERS = [  # (preset, cards, cards a node, nodes' host memory GiB)
    ("forge-m", "V100-16GB", 8, 4, 256), ("forge-l", "T4", 16, 4, 192), ("forge-m", "A100-40GB", 4, 4, 512)]


@pytest.mark.parametrize("preset,card,count,per_node,host_gb", FORGE_CLUSTERS)
def test_forge_sizes_find_a_layout_on_the_cards_labs_have(preset, card, count, per_node, host_gb):
    """FORGE's sizes on clusters of 16-40 GB cards: no sharding alone holds the state, so `auto`
    puts the shards on the host (FSDP2's CPU offload) with an activation plan; and `stages: auto`
    compares every layout, offloaded ones included, and the host memory each node declares bounds them."""
    from hetforge.memory.analytic import HOST_STEP_S_PER_PARAM
    from hetforge.model.accounting import count_parameters
    from hetforge.model.presets import PRESETS

    shape = PRESETS[preset]
    cluster = [NodeSpec.model_validate({"host": f"n{i}", "memory_gb": host_gb,
                                        "devices": [{"type": card, "count": per_node}]}) for i in range(count // per_node)]
    raw = {"model": {"preset": preset}, "train": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_tokens": 2**20},
           "memory": {"budget": "auto"}, "cluster": {"inter_node_gbit": 10}}
    plan = resolve_plan(build_config(raw), shape, declared_facts(build_config(raw), shape, cluster, "x"))
    assert (plan.strategy, plan.offload) == ("fsdp", "params") and "host-params" in plan.why["strategy"]
    assert all(r.predicted_peak_bytes <= r.memory_bytes for r in plan.ranks)
    # the host's AdamW step over each rank's shard, after the device's work
    assert plan.step_parts["host"] > HOST_STEP_S_PER_PARAM * count_parameters(shape)["total"] / count
    assert plan.predicted_step_s == pytest.approx(plan.step_parts["compute"] + plan.step_parts["host"])
    raw["parallel"] = {"pipeline": {"stages": "auto"}}
    chosen = resolve_plan(build_config(raw), shape, declared_facts(build_config(raw), shape, cluster, "x"))
    fits = [c for c in chosen.layouts if c["fits"]]
    assert fits and all(c["offload"] == "params" for c in fits if c["strategy"] != "pipeline")
    assert chosen.why["layout"].startswith(min(fits, key=lambda c: c["step_s"])["layout"])
    small = [n.model_copy(update={"memory_gb": 1.0}) for n in cluster]  # hosts too small to take the shards
    with pytest.raises(ConfigError, match="no layout fits"):
        resolve_plan(build_config(raw), shape, declared_facts(build_config(raw), shape, small, "x"))
