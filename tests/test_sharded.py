"""Sharded data parallelism (FSDP2 / ZeRO) on gloo: the same update as one process and as DDP with
unequal shares and a rank with none, per-rank state ~1/W, checkpoints that reshard across world
size and strategy."""

import re
import json
import subprocess
from pathlib import Path

import pytest
import torch

from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train
from hetforge.core.metrics import read_metrics
from hetforge.model.load import load_for_inference
from tests.test_distributed import ENV, ROOT, losses, max_diff, run_train, torchrun_cmd, two_cpus, with_cluster


def three_cpus() -> dict:
    return {"nodes": [{"host": "localhost", "devices": [{"type": "cpu"} for _ in range(3)]}]}


def sharded(make_cfg, name, strategy, shares, unit_params=None, slowdown=1.0, accumulation=None, **train_kw):
    nodes = three_cpus() if len(shares) == 3 else {"nodes": two_cpus()["nodes"]}
    for d in nodes["nodes"][0]["devices"]:
        d.pop("memory_gb", None)
    if slowdown > 1:  # the last rank simulated slower: under FSDP, hooks on every module (identities)
        nodes["nodes"][0]["devices"][-1].update(slowdown=slowdown, slowdown_from_step=0)
    cluster = {**nodes, "balance": "fixed", "assignments": [{"samples": n, "micro_batch_size": b} for n, b in shares]}
    cfg = with_cluster(make_cfg, name, cluster, **train_kw)
    parallel = {"strategy": strategy, **({"unit_params": unit_params} if unit_params else {}),
                **({"accumulation": accumulation} if accumulation else {})}
    return cfg.model_copy(update={"parallel": type(cfg.parallel).model_validate(parallel)})


def weights(cfg) -> dict[str, torch.Tensor]:
    model, _ = load_for_inference(cfg.run_dir)  # consolidates a sharded checkpoint in this process
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """One process, global batch 8, 5 steps: what every strategy must reproduce."""
    from tests.conftest import tiny_raw
    from hetforge.config import build_config

    cfg = build_config(tiny_raw(tmp_path_factory.mktemp("ref") / "ref", data_dir, steps=5, micro_batch_size=8,
                                checkpoint_interval=5, eval_interval=1000))
    train(cfg)
    return cfg


# unit_params=1: every block its own FSDP unit (the tiny model's blocks are otherwise one unit);
# "slow": the last rank simulated slower; "unsharded": gradients accumulated unsharded, so the ranks
# run their own numbers of micro-batches (1, 2 and 3; 4 beside a rank with none)
CASES = [("fsdp", [(1, 1), (2, 1), (5, 2)], None), ("fsdp", [(8, 4), (0, 1)], None), ("fsdp", [(5, 3), (3, 3)], "slow"),
         ("fsdp", [(1, 1), (2, 1), (5, 2)], 1), ("zero2", [(1, 1), (2, 2), (5, 3)], None), ("zero1", [(3, 3), (5, 2)], None),
         ("fsdp", [(1, 1), (2, 1), (5, 2)], "unsharded"), ("zero2", [(8, 2), (0, 1)], "unsharded")]


@pytest.mark.parametrize("strategy,shares,unit_params", CASES,
                         ids=[f"{s}-{'+'.join(str(n) for n, _ in sh)}"
                              f"{ {None: '', 1: '-per-block', 'slow': '-slow', 'unsharded': '-unsharded'}[u]}"
                              for s, sh, u in CASES])
@pytest.mark.slow
def test_sharded_update_equals_one_process(make_cfg, tmp_path, reference, strategy, shares, unit_params):
    slow = unit_params == "slow"  # a rank simulated 1.5x slower: its per-module marks leave the update alone
    unsharded = unit_params == "unsharded"
    accumulation = None if strategy == "zero1" else "unsharded" if unsharded else "sharded"
    cfg = sharded(make_cfg, f"{strategy}{len(shares)}", strategy, shares, unit_params if unit_params == 1 else None,
                  1.5 if slow else 1.0, accumulation, steps=5, micro_batch_size=8, checkpoint_interval=5,
                  eval_interval=1000)
    res = run_train(cfg, len(shares), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"data parallelism: {strategy}" in res.stdout
    got, ref = losses(cfg), losses(reference)
    assert sorted(got) == list(range(1, 6))
    # a few fp32 ulps: the ranks' token-loss sums are added in another order than one process adds them
    assert all(got[s] == pytest.approx(ref[s], rel=1e-6) for s in ref)
    # AdamW's g / sqrt(v) magnifies summation-order rounding on near-zero gradient entries
    assert max_diff(weights(cfg), weights(reference)) <= 2e-4
    plan = json.loads((Path(cfg.run_dir) / "balance.json").read_text())
    assert [s["samples"] for s in plan["shares"]] == [n for n, _ in shares]
    if unsharded:  # collectives once a step: each rank its own count of micro-batches, as assigned
        assert plan["accumulation"] == "unsharded" and state_bytes(cfg)["accumulation"] == "unsharded"
        assert [len(s["micro_batches"]) for s in plan["shares"]] == [-(-n // b) for n, b in shares]
        # for the step, every unit's weights gathered and the gradients whole, as the plan priced
        predicted = state_bytes(cfg)["predicted"]
        assert predicted["gathered gradients"] == pytest.approx(predicted["gradients"] * len(shares))
        assert (ckpt.resolve(cfg.run_dir) / "dcp").is_dir()
    elif strategy in ("zero2", "fsdp"):  # every micro-batch is a collective: the same count on every rank
        assert plan["accumulation"] == "sharded"
        assert len({len(s["micro_batches"]) for s in plan["shares"]}) == 1
        # and each micro-batch's collectives, timed on the run's group, priced the same for every rank
        assert len({m["per_micro_s"] for m in plan["models"]}) == 1 and plan["models"][0]["per_micro_s"] > 0
        assert (ckpt.resolve(cfg.run_dir) / "dcp").is_dir()
        assert not (ckpt.resolve(cfg.run_dir) / "model.safetensors").exists()


def state_bytes(cfg) -> dict:
    return next(e for e in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")["event"] if e["event"] == "state_bytes")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_a_1_over_w_share_of_the_state_as_predicted(make_cfg, tmp_path, world):
    shares = [(2, 2)] * world
    runs = {}
    for strategy in ("ddp", "fsdp"):
        cfg = sharded(make_cfg, f"bytes-{strategy}{world}", strategy, shares[:2], steps=1, micro_batch_size=2 * world,
                      eval_interval=1000, save_checkpoints=False)
        if world == 4:
            cfg = cfg.model_copy(update={"cluster": type(cfg.cluster).model_validate(
                {"nodes": [{"devices": [{"type": "cpu"}] * 4}], "balance": "fixed",
                 "assignments": [{"samples": 2, "micro_batch_size": 2}] * 4})})
        res = run_train(cfg, world, tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[strategy] = state_bytes(cfg)
    for kind in ("weights", "gradients", "optimizer state"):
        full = runs["ddp"]["ranks"][0][kind]
        assert full == runs["ddp"]["predicted"][kind]  # replicated: exactly the accounting's bytes
        for r in runs["fsdp"]["ranks"]:
            assert r[kind] <= 1.1 * full / world, (kind, r, full)  # a 1/W share (dim-0 chunks round up)
            assert r[kind] == pytest.approx(runs["fsdp"]["predicted"][kind], rel=0.1)
        assert sum(r[kind] for r in runs["fsdp"]["ranks"]) == pytest.approx(full, rel=0.01)


@pytest.fixture(scope="module")
def reference6(tmp_path_factory, data_dir):
    from tests.conftest import tiny_raw
    from hetforge.config import build_config

    cfg = build_config(tiny_raw(tmp_path_factory.mktemp("ref6") / "ref6", data_dir, steps=6, micro_batch_size=8,
                                checkpoint_interval=2, eval_interval=1000))
    train(cfg)
    return cfg


def _relaunch(cfg, strategy, world, shares):
    nodes = {"nodes": [{"devices": [{"type": "cpu"}] * world}]} if world > 1 else {}
    cluster = {**nodes, "balance": "fixed", "assignments": [{"samples": n, "micro_batch_size": b} for n, b in shares]} \
        if world > 1 else {}
    return cfg.model_copy(update={"cluster": type(cfg.cluster).model_validate(cluster),
                                  "parallel": type(cfg.parallel).model_validate({"strategy": strategy})})


CHAINS = {
    "fsdp4-fsdp2-one": [("fsdp", 4, [(1, 1), (2, 1), (2, 1), (3, 1)]), ("fsdp", 2, [(3, 2), (5, 3)]), ("ddp", 1, [])],
    "ddp2-fsdp2-zero1": [("ddp", 2, [(4, 4), (4, 4)]), ("zero2", 2, [(6, 3), (2, 1)]), ("zero1", 2, [(3, 3), (5, 5)])],
    "one-zero1-fsdp3": [("ddp", 1, []), ("zero1", 2, [(5, 5), (3, 3)]), ("fsdp", 3, [(2, 1), (3, 1), (3, 1)])],
}


@pytest.mark.slow
@pytest.mark.parametrize("chain", list(CHAINS))
def test_resume_across_strategy_and_world_size(make_cfg, tmp_path, reference6, chain):
    """Two steps under each: the sample sequence and the losses are the single process's."""
    base = make_cfg(f"chain-{chain}", steps=6, micro_batch_size=8, checkpoint_interval=2, eval_interval=1000)
    for strategy, world, shares in CHAINS[chain]:
        cfg = _relaunch(base, strategy, world, shares)
        if world == 1:
            res = train(cfg, stop_after=2)
            assert res.step in (2, 6) and res.interrupted == (res.step < 6)
        else:
            res = run_train(cfg, world, tmp_path, "--stop-after", "2")
            assert res.returncode == 0, res.stderr[-3000:]
    got, ref = losses(base), losses(reference6)
    assert sorted(got) == list(range(1, 7))
    assert all(got[s] == pytest.approx(ref[s], abs=1e-5) for s in ref), (got, ref)
    assert max_diff(weights(base), weights(reference6)) <= 2e-4


# --- the decision, on recorded inputs (no timing, no processes) ------------------------------------
from hetforge.memory.sharding import NoStrategyFits, RankNeed, choose_strategy  # noqa: E402
from hetforge.model.accounting import count_parameters, sharded_static_bytes  # noqa: E402
from hetforge.model.presets import PRESETS  # noqa: E402

GIB = 2**30
V100 = 14.4 * GIB  # usable of 16 GB (memory.analytic.usable_bytes)


def test_small_blocks_are_grouped_into_fsdp_units_and_large_ones_are_not():
    from hetforge.model.accounting import block_groups, shard_units

    assert [len(g) for g in block_groups(PRESETS["forge-s"])] == [1] * 24  # 51M parameters a block
    assert [len(g) for g in block_groups(PRESETS["125m"])] == [1] * 12  # 7.1M
    tiny = PRESETS["tiny"]
    assert [list(g) for g in block_groups(tiny)] == [[0, 1, 2, 3]]  # 0.2M a block: one unit of four
    assert [len(g) for g in block_groups(tiny, 1)] == [1] * 4
    groups = block_groups(PRESETS["small"], 1 << 21)  # 0.8M a block, units of 2M+: 3 blocks each
    assert [list(g) for g in groups] == [[0, 1, 2], [3, 4, 5]]
    units = shard_units(tiny)
    assert sum(units) == count_parameters(tiny)["total"] and len(units) == 3
    # what each micro-batch launches: fsdp gathers every unit twice (forward, backward) and
    # reduce-scatters it once; zero2 keeps the forward's gather; ddp and zero1 once a step, not per micro-batch
    from hetforge.model.accounting import collectives_per_micro_batch

    assert collectives_per_micro_batch(tiny, "fsdp") == 9
    assert collectives_per_micro_batch(tiny, "fsdp", 1) == 3 * (4 + 2)
    assert collectives_per_micro_batch(tiny, "zero2") == 6
    assert collectives_per_micro_batch(tiny, "ddp") == collectives_per_micro_batch(tiny, "zero1") == 0


def test_sharded_bytes_follow_the_zero_paper():
    shape = PRESETS["forge-s"]
    n = count_parameters(shape)["total"]
    ddp = sharded_static_bytes(shape, "adamw", "ddp", 8)
    assert sum(ddp.values()) == 16 * n  # 4 + 4 + 8 bytes a parameter
    z1 = sharded_static_bytes(shape, "adamw", "zero1", 8)
    assert z1["optimizer state"] == 8 * n / 8 and z1["weights"] == 4 * n
    fsdp = sharded_static_bytes(shape, "adamw", "fsdp", 8, gather_bytes=2)
    assert fsdp["weights"] + fsdp["gradients"] + fsdp["optimizer state"] == pytest.approx(16 * n / 8)
    # gathered: the two largest units (embedding and output head, 52000 x 2064 each) in 16 bits
    assert fsdp["gathered weights"] == 2 * (52000 * 2064 + 52000 * 2064 + 2 * 2064)
    off = sharded_static_bytes(shape, "adamw", "fsdp", 8, offload="params", gather_bytes=2)
    assert off["weights"] == off["gradients"] == 0 and "optimizer state" not in off
    # accumulating unsharded: for the step, every unit's weights gathered and the full gradients
    whole = sharded_static_bytes(shape, "adamw", "fsdp", 8, gather_bytes=2, accumulation="unsharded")
    assert whole["gathered weights"] == 2 * n and whole["gathered gradients"] == 4 * n
    assert whole["optimizer state"] == fsdp["optimizer state"] and whole["weights"] == fsdp["weights"]


@pytest.mark.parametrize("preset,cards,expected", [
    ("forge-s", [V100] * 8, "zero1"),  # 21.5 GiB replicated; 12.1 GiB with the state sharded
    ("forge-s", [V100] * 4, "zero2"),  # zero1 keeps 4+4 bytes a parameter whole: 10.7 + 2.7 GiB + activations
    ("forge-s", [V100] * 2, "fsdp"),  # zero2's gathered weights (2.7 GiB) no longer fit beside the shards
    ("forge-s", [40 * GIB] * 4, "ddp"),  # an A100-40GB holds a replica
    ("forge-m", [V100] * 32, "fsdp"),  # 13.1B: only ZeRO-3 fits (over 16 V100s it is 14.7 GiB: no)
])
def test_auto_takes_the_least_sharding_that_fits(preset, cards, expected):
    shape = PRESETS[preset]
    needs = [RankNeed(r, "V100", b, 1.0 * GIB) for r, b in enumerate(cards)]
    strategy, why = choose_strategy(shape, "adamw", needs, len(cards), gather_bytes=2)
    assert strategy == expected, why
    assert why.startswith(f"auto: {expected}")


def test_auto_puts_the_shards_on_the_host_where_no_sharding_fits_and_names_the_rank_short_of_memory():
    from hetforge.memory.sharding import HOST_PARAMS

    # forge-m over two cards: 13.1B x 16 B is 98 GiB a rank under FSDP, on the host only the
    # gathered units stay on the card
    needs = [RankNeed(0, "V100", V100, GIB), RankNeed(1, "P100", 8 * GIB, GIB)]
    strategy, why = choose_strategy(PRESETS["forge-m"], "adamw", needs, 2, gather_bytes=2)
    assert strategy == HOST_PARAMS and re.search(r"fsdp needs .* on rank 1 \(P100\)", why)
    needs[1] = RankNeed(1, "P100", 8 * GIB, 8 * GIB)  # its activations alone fill the card
    with pytest.raises(NoStrategyFits, match=r"fsdp\+host-params needs .* on rank 1 \(P100\)"):
        choose_strategy(PRESETS["forge-m"], "adamw", needs, 2, gather_bytes=2)
    with pytest.raises(NoStrategyFits, match=r"fits: ddp needs .* on rank 1 \(P100\) with 8.00 GiB; add"):
        choose_strategy(PRESETS["forge-m"], "adamw", needs[:1] + [RankNeed(1, "P100", 8 * GIB, GIB)], 2, 2,
                        offload="optimizer")  # an offload the config sets is kept: no fallback


def test_auto_without_known_memory_replicates():
    needs = [RankNeed(r, "cpu", None, 0.0) for r in range(3)]
    assert choose_strategy(PRESETS["forge-s"], "adamw", needs, 3)[0] == "ddp"


def test_pick_strategy_prefers_sharding_to_the_host_optimizer():
    from hetforge.memory.sharding import HOST_OPTIMIZER, HOST_PARAMS, pick_strategy

    fits = [{"ddp": True, "zero1": True, "zero2": True, "fsdp": True, HOST_OPTIMIZER: True},
            {"ddp": False, "zero1": False, "zero2": True, "fsdp": True, HOST_OPTIMIZER: True}]
    strategy, why = pick_strategy(fits, ["cpu", "small"])
    assert strategy == "zero2" and "ddp has no plan on rank 1 (small)" in why
    fits[1].update(zero2=False, fsdp=False)
    assert pick_strategy(fits, ["cpu", "small"])[0] == "ddp"  # only the host optimizer is left
    fits[1][HOST_OPTIMIZER] = False
    with pytest.raises(NoStrategyFits, match="fsdp has no plan on rank 1"):
        pick_strategy(fits, ["cpu", "small"])
    for f in fits:
        f[HOST_PARAMS] = True  # FSDP with its shards on the host: the last resort
    assert pick_strategy(fits, ["cpu", "small"])[0] == HOST_PARAMS


@pytest.mark.slow
def test_auto_shards_where_a_rank_is_short_of_memory_and_plans_it(make_cfg, tmp_path):
    """The rank declaring 2.6 MiB cannot hold a replica beside any activation plan: auto shards
    (the planner's verdicts per strategy), and the small rank trains under a plan priced with its
    shard bytes; the update is still the global batch's."""
    cluster = {"nodes": [{"host": "localhost", "devices": [
        {"type": "cpu", "memory_gb": 4.0, "speed": 1.0}, {"type": "cpu", "memory_gb": 2.6 / 1024, "speed": 1.0}]}]}
    cfg = with_cluster(make_cfg, "auto-shard", cluster, steps=3, micro_batch_size=8, global_batch_tokens=16 * 32,
                       eval_interval=1000)
    cfg = cfg.model_copy(update={"memory": type(cfg.memory).model_validate({"budget": "auto"})})
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    plan = json.loads((Path(cfg.run_dir) / "plan.json").read_text())
    assert plan["strategy"] in ("zero1", "zero2", "fsdp") and plan["why"]["strategy"].startswith("auto:")
    assert "ddp has no plan on rank 1" in plan["why"]["strategy"]
    small = plan["ranks"][1]
    assert small["predicted_peak_bytes"] <= 2.6 * 2**20 and not small["optimizer_offload"]
    assert small["activation_plan"] is not None
    assert sum(s["samples"] for s in plan["balance"]["shares"]) == 16


@pytest.mark.slow
def test_plan_cluster_prints_the_strategy_and_each_kinds_plan(tmp_path):
    import subprocess
    import sys

    import yaml

    cfg = {"name": "tiny", "run_dir": str(tmp_path / "run"), "data": {"out_dir": str(tmp_path / "d"),
                                                                      "tokenizer": {"vocab_size": 512}},
           "model": {"preset": None, "n_layers": 2, "d_model": 64, "n_heads": 4},
           "train": {"seq_len": 32, "micro_batch_size": 8}, "memory": {"budget": "auto"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "cl.yaml").write_text(yaml.safe_dump({"nodes": [{"devices": [
        {"type": "cpu", "count": 2, "memory_gb": 0.004}, {"type": "cpu", "count": 2, "memory_gb": 0.0026, "speed": 0.5}]}]}))
    for strategy in ("fsdp", "auto", "zero1"):
        res = subprocess.run([sys.executable, "-m", "hetforge", "plan", str(tmp_path / "c.yaml"), "--cluster",
                              str(tmp_path / "cl.yaml"), "--set", f"parallel.strategy={strategy}", "--json"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out == json.loads((tmp_path / "run" / "plan" / "plan.json").read_text())
        assert len(out["ranks"]) == 4 and out["predicted_step_s"] > 0
        assert all(r["predicted_peak_bytes"] <= r["memory_bytes"] for r in out["ranks"])
        assert [r["memory_bytes"] / 2**30 for r in out["ranks"]] == pytest.approx([0.004, 0.004, 0.0026, 0.0026])
        if strategy == "fsdp":
            assert out["strategy"] == "fsdp" and out["mesh"] == [1, 4]
        elif strategy == "zero1":  # the optimizer state in proportion to memory: 4.1 against 2.7 MiB a rank
            shares = [r["state_share"] for r in out["ranks"]]
            assert sum(shares) == pytest.approx(1.0) and shares[0] / shares[2] == pytest.approx(4 / 2.6, rel=0.1)
        else:  # the 2.6 MiB cards hold no replica beside a plan without the host optimizer
            why = out["why"]["strategy"]
            assert out["strategy"] != "ddp" and why.startswith("auto:") and "ddp has no plan on rank 2 (cpu)" in why


# --- ZeRO-1 with the optimizer state in proportion to memory (issue 15, point 6) ----------------

@pytest.mark.parametrize("tie", [False, True])
def test_parameter_sizes_are_the_optimizers_groups(tie):
    from dataclasses import replace

    from hetforge.model.accounting import parameter_sizes
    from hetforge.model.gpt_neox import GPTNeoX
    from hetforge.train.optim import param_groups

    shape = replace(PRESETS["tiny"], tie_embeddings=tie)
    groups = param_groups(GPTNeoX(shape), 0.1)
    assert [sorted(p.numel() for p in g["params"]) for g in groups] == [sorted(s) for s in parameter_sizes(shape)]


def test_proportional_partition_follows_the_weights():
    from hetforge.model.accounting import parameter_sizes, proportional_partition, state_shares

    sizes = parameter_sizes(PRESETS["forge-s"])
    largest = max(max(g) for g in sizes) / sum(sum(g) for g in sizes)
    for weights in ([1, 1, 1, 1], [32, 16], [32, 32, 16, 16], [40, 16, 16, 12]):
        shares = state_shares(sizes, weights)
        assert sum(shares) == pytest.approx(1.0)
        for s, w in zip(shares, weights):  # exact to within one tensor
            assert abs(s - w / sum(weights)) <= largest, (weights, shares)
    # equal weights: ZeroRedundancyOptimizer's own greedy (largest first, least loaded, lowest rank on a tie)
    ranks = proportional_partition([[5, 3, 3, 2, 1]], [1, 1])[0]
    assert ranks == [0, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="positive"):
        proportional_partition(sizes, [1, 0])


def test_memory_proportional_state_lets_zero1_fit_where_equal_parts_do_not():
    from hetforge.model.accounting import parameter_sizes, state_shares

    shape, cards = PRESETS["forge-s"], [2 * V100, 2 * V100, V100, V100]  # two 32 GB and two 16 GB cards
    needs = [RankNeed(r, "V100", b, 1.5 * GIB) for r, b in enumerate(cards)]
    shares = state_shares(parameter_sizes(shape), cards)
    assert shares[0] == pytest.approx(1 / 3, abs=0.02) and shares[3] == pytest.approx(1 / 6, abs=0.02)
    # equal parts: a 16 GB card's quarter of the state does not fit beside the weights and gradients
    assert choose_strategy(shape, "adamw", needs, 4, gather_bytes=2)[0] == "zero2"
    strategy, why = choose_strategy(shape, "adamw", needs, 4, gather_bytes=2, state_shares=shares)
    assert strategy == "zero1", why
    z = sharded_static_bytes(shape, "adamw", "zero1", 4, state_share=shares[3])
    assert z["optimizer state"] == pytest.approx(8 * count_parameters(shape)["total"] * shares[3])


@pytest.mark.slow
def test_zero1_by_memory_equals_one_process_and_holds_state_in_proportion(make_cfg, tmp_path, reference):
    """Ranks declaring 6 and 2 GB: rank 0 holds ~3/4 of the optimizer state, as predicted, and the
    update is still the global batch's."""
    cluster = {"nodes": [{"host": "localhost", "devices": [{"type": "cpu", "memory_gb": 6.0},
                                                           {"type": "cpu", "memory_gb": 2.0}]}],
               "balance": "fixed", "assignments": [{"samples": 3, "micro_batch_size": 3},
                                                   {"samples": 5, "micro_batch_size": 5}]}
    cfg = with_cluster(make_cfg, "zero1-memory", cluster, steps=5, micro_batch_size=8, checkpoint_interval=5,
                       eval_interval=1000)
    cfg = cfg.model_copy(update={"parallel": type(cfg.parallel).model_validate({"strategy": "zero1"})})
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "zero1: optimizer state in proportion to memory" in res.stdout
    got, ref = losses(cfg), losses(reference)
    assert all(got[s] == pytest.approx(ref[s], rel=1e-6) for s in ref)
    assert max_diff(weights(cfg), weights(reference)) <= 2e-4
    ranks = state_bytes(cfg)["ranks"]
    held = [r["optimizer state"] for r in ranks]
    assert held[0] > 2 * held[1], held
    for r in ranks:
        assert r["optimizer state"] == pytest.approx(r["predicted"]["optimizer state"], rel=0.1)


def test_fsdp_takes_one_block_a_unit_only_where_grouped_units_do_not_fit():
    """sharded_scale's W=4 case: 32 blocks of 3.1M parameters (grouped two a unit by default) on
    512 MiB ranks: the grouped units' gathered bytes leave rank 0 short, one block a unit fits."""
    from hetforge.memory.sharding import unit_size_that_fits
    from hetforge.model.gpt_neox import GPTNeoXConfig

    shape = GPTNeoXConfig(32, 512, 8, 2048, 4096)
    mib = 2**20
    grouped = sum(sharded_static_bytes(shape, "adamw", "fsdp", 4, gather_bytes=4).values())
    single = sum(sharded_static_bytes(shape, "adamw", "fsdp", 4, gather_bytes=4, min_unit_params=1).values())
    assert single < grouped - 30 * mib  # two gathered units and one unit's gradients, half the size
    act = 40 * mib

    def needs(budget):
        return [RankNeed(r, "cpu", budget, act) for r in range(4)]

    units, why = unit_size_that_fits(shape, "adamw", needs(512 * mib), "fsdp", 4, 4)
    assert units == 1 and "one block each" in why and "rank 0" in why
    assert unit_size_that_fits(shape, "adamw", needs(1024 * mib), "fsdp", 4, 4) == (1 << 22, None)  # room: grouped
    assert unit_size_that_fits(shape, "adamw", needs(300 * mib), "fsdp", 4, 4) == (1 << 22, None)  # nothing fits
    assert unit_size_that_fits(shape, "adamw", needs(512 * mib), "zero1", 4, 4) == (1 << 22, None)
    assert unit_size_that_fits(shape, "adamw", [RankNeed(0, "cpu", None, act)] * 4, "fsdp", 4, 4) == (1 << 22, None)


@pytest.mark.slow
def test_probe_times_the_proxy_under_fsdp_hooks_on_a_mesh_of_its_own_rank(tmp_path):
    """A rank's proxy is wrapped as the model is, on its own one-rank mesh: ranks that time
    different sizes never meet in a collective (a shared one would hang or fail), and the wrapped
    model computes what the bare one does."""
    out = tmp_path / "probe"
    res = subprocess.run(torchrun_cmd(2, str(ROOT / "tests" / "local_shard_worker.py"), str(out)),
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1))
    assert r0["sizes"] == [1, 2, 4] and r1["sizes"] == [1]
    for r in (r0, r1):
        assert r["wrapped"] and r["positive"]
        assert r["max_abs_diff"] < 1e-5
