"""Pipeline parallelism on torch.distributed.pipelining (gloo, 2-4 ranks, tiny models): the update
equals one process's on the same global batch, with uneven stages and unequal replica shares;
checkpoints reshard between a pipeline and other layouts; the layout is decided from recorded
inputs, with one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hetforge.cluster.pipeline_plan import PipelinePlan, inflight, micro_counts, plan_pipeline, split_blocks
from hetforge.config import ConfigError, build_config
from hetforge.core.metrics import read_metrics
from hetforge.model.gpt_neox import GPTNeoXConfig
from hetforge.train.loop import train
from tests.conftest import tiny_raw
from tests.test_distributed import losses, max_diff, run_train
from tests.test_sharded import weights


def cpus(n: int) -> dict:
    return {"nodes": [{"host": "localhost", "devices": [{"type": "cpu"} for _ in range(n)]}]}


def piped(make_cfg, name: str, world: int, stages: int, shares=None, layers=None, n_layers=2, schedule="auto",
          strategy="auto", **train_kw):
    cfg = make_cfg(name, **train_kw)
    cluster = cpus(world)
    if shares is not None:
        cluster.update(balance="fixed", assignments=[{"samples": n, "micro_batch_size": b} for n, b in shares])
    raw = cfg.model_dump(mode="json")
    raw["cluster"] = cluster
    raw["model"]["n_layers"] = n_layers
    raw["parallel"] = {"strategy": strategy,
                       "pipeline": {"stages": stages, "schedule": schedule, **({"layers": layers} if layers else {})}}
    return build_config(raw)


def reference_run(root: Path, data_dir: Path, n_layers: int, steps: int = 5):
    raw = tiny_raw(root / f"ref{n_layers}", data_dir, steps=steps, micro_batch_size=8, checkpoint_interval=steps,
                   eval_interval=1000)
    raw["model"]["n_layers"] = n_layers
    cfg = build_config(raw)
    train(cfg)
    return cfg


@pytest.fixture(scope="module")
def refs(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("pipe-ref")
    return {n: reference_run(root, data_dir, n) for n in (2, 4)}


CASES = {  # world, stages, replica shares (samples, micro-batch) or None (equal), blocks per stage, model blocks,
    # schedule (interleaved: two chunks a rank, the blocks looped 0,2 | 1,3 over the ranks), and
    # strategy (fsdp: each stage sharded over its two replicas, which run 1 and 3 or 0 and 4 micro-batches)
    "2-stages": (2, 2, None, None, 2, "auto"),
    "2x2-shares-1-3": (4, 2, [(2, 2), (6, 2)], None, 2, "auto"),
    "2x2-zero-share": (4, 2, [(0, 2), (8, 2)], None, 2, "auto"),
    "uneven-1+3": (2, 2, None, [1, 3], 4, "auto"),
    "interleaved": (2, 2, None, None, 4, "interleaved"),
    "interleaved-2x2-shares-1-3": (4, 2, [(2, 2), (6, 2)], None, 4, "interleaved"),
    "interleaved-2x2-zero-share": (4, 2, [(0, 2), (8, 2)], None, 4, "interleaved"),
    "fsdp-stages-2x2-shares-1-3": (4, 2, [(2, 2), (6, 2)], None, 2, "auto", "fsdp"),
    "fsdp-stages-2x2-zero-share": (4, 2, [(0, 2), (8, 2)], None, 2, "auto", "fsdp"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_update_equals_one_process(make_cfg, tmp_path, refs, case):
    world, stages, shares, layers, n_layers, schedule, *strategy = CASES[case]
    # sharded stages are also evaluated every 2 steps: a replica's first forward after a step gathers
    cfg = piped(make_cfg, f"pipe-{case}", world, stages, shares, layers, n_layers, schedule, *strategy, steps=5,
                micro_batch_size=2, global_batch_tokens=8 * 32, checkpoint_interval=5,
                eval_interval=2 if strategy else 1000)
    res = run_train(cfg, world, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "data parallelism: pipeline" in res.stdout
    ref = refs[n_layers]
    got, want = losses(cfg), losses(ref)
    assert sorted(got) == list(range(1, 6))
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want), (got, want)
    assert max_diff(weights(cfg), weights(ref)) <= 2e-4
    plan = json.loads((Path(cfg.run_dir) / "plan.json").read_text())
    assert plan["strategy"] == "pipeline" and sum(plan["pipeline"]["layers"]) == n_layers
    if layers:
        assert plan["pipeline"]["layers"] == layers
    if schedule == "interleaved":
        assert plan["pipeline"]["virtual"] == 2 and set(plan["pipeline"]["schedules"]) == {"interleaved"}
    assert plan["pipeline"]["shard"] is (strategy == ["fsdp"])
    if strategy:  # validation ran between steps (the last stages' summed figures)
        val = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")["val"]
        assert [v["step"] for v in val][:2] == [2, 4] and all(math.isfinite(v["loss"]) for v in val)
    if shares:
        assert [s["samples"] for s in plan["balance"]["shares"]] == [n for n, _ in shares]


@pytest.mark.slow
def test_recomputed_stages_give_the_same_update(make_cfg, tmp_path, refs):
    """Every block recomputed in its backward (dropout masks replayed): the update is still one
    process's."""
    cfg = piped(make_cfg, "pipe-recompute", 2, 2, steps=5, micro_batch_size=2, global_batch_tokens=8 * 32,
                checkpoint_interval=5, eval_interval=1000)
    raw = cfg.model_dump(mode="json")
    raw["parallel"]["pipeline"]["recompute"] = "blocks"
    cfg = build_config(raw)
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((Path(cfg.run_dir) / "plan.json").read_text())["pipeline"]["recomputed"] == [1, 1]
    got, want = losses(cfg), losses(refs[2])
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want), (got, want)
    assert max_diff(weights(cfg), weights(refs[2])) <= 2e-4


@pytest.mark.slow
def test_stage_activation_plans_give_the_same_update(make_cfg, tmp_path, refs):
    """memory.strategy full under a 2-stage 1F1B pipeline: each stage's blocks run under its
    per-tensor plan's executor (every block recomputed, the first stage's two micro-batches in
    flight at once): the update is still one process's."""
    cfg = piped(make_cfg, "pipe-memory-plan", 2, 2, steps=5, micro_batch_size=2, global_batch_tokens=8 * 32,
                checkpoint_interval=5, eval_interval=1000)
    raw = cfg.model_dump(mode="json")
    raw["memory"] = {**raw["memory"], "strategy": "full", "budget": "8GiB"}
    cfg = build_config(raw)
    res = run_train(cfg, 2, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    plan = json.loads((Path(cfg.run_dir) / "plan.json").read_text())
    assert [r["activation_plan"] for r in plan["ranks"]] == [["recompute"], ["recompute"]]
    got, want = losses(cfg), losses(refs[2])
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want), (got, want)
    assert max_diff(weights(cfg), weights(refs[2])) <= 2e-4


@pytest.mark.slow
def test_a_pipeline_trains_in_fp16_with_one_loss_scale(make_cfg, tmp_path, data_dir):
    """fp16 on 2 stages x 2 replicas: the loss is scaled on the last stage, every rank unscales its
    own gradients and the inf/NaN check is agreed over all ranks (ShardedGradScaler), so the run
    follows one process's fp16 run: same losses to fp16's precision, the same loss scale."""
    raw = tiny_raw(tmp_path / "ref16", data_dir, steps=4, micro_batch_size=8, eval_interval=1000, precision="fp16")
    ref = build_config(raw)
    train(ref)
    cfg = piped(make_cfg, "pipe-fp16", 4, 2, steps=4, micro_batch_size=2, global_batch_tokens=8 * 32,
                eval_interval=1000, precision="fp16")
    res = run_train(cfg, 4, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got, want = (read_metrics(Path(c.run_dir) / "metrics.jsonl")["train"] for c in (cfg, ref))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all(g["loss_scale"] == w["loss_scale"] > 1 for g, w in zip(got, want))
    assert all(g["loss"] == pytest.approx(w["loss"], rel=2e-3) for g, w in zip(got, want)), (got, want)


def finishes_like_one_process(base, ref) -> None:
    """The last two of six steps in one process, resumed from what the layouts before it wrote: the
    losses and weights of one uninterrupted process's run (`ref`)."""
    assert train(base, stop_after=2).step == 6
    got, want = losses(base), losses(ref)
    assert sorted(got) == list(range(1, 7))
    assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in want), (got, want)
    assert max_diff(weights(base), weights(ref)) <= 2e-4


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_fsdp_and_one_process(make_cfg, tmp_path, data_dir):
    """Two steps as a 2-stage pipeline, two under FSDP on 2 ranks, two in one process: the sample
    sequence and losses are one uninterrupted process's."""
    ref = reference_run(tmp_path, data_dir, 2, steps=6)
    base = make_cfg("chain-pipe", steps=6, micro_batch_size=8, checkpoint_interval=2, eval_interval=1000)
    pipe = piped(make_cfg, "chain-pipe", 2, 2, steps=6, micro_batch_size=2, global_batch_tokens=8 * 32,
                 checkpoint_interval=2, eval_interval=1000)
    assert run_train(pipe, 2, tmp_path, "--stop-after", "2").returncode == 0
    fsdp = base.model_copy(update={
        "cluster": type(base.cluster).model_validate({**cpus(2), "balance": "fixed", "assignments": [
            {"samples": 3, "micro_batch_size": 3}, {"samples": 5, "micro_batch_size": 5}]}),
        "parallel": type(base.parallel).model_validate({"strategy": "fsdp"})})
    res = run_train(fsdp, 2, tmp_path, "--stop-after", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    finishes_like_one_process(base, ref)


@pytest.mark.slow
def test_sharded_stages_resume_from_their_checkpoint_and_on_one_process(make_cfg, tmp_path, data_dir):
    """Two steps as 2 stages x 2 replicas with each stage sharded over its replicas (1:3 shares),
    two more resumed the same way (sharded weights and AdamW state read back into the shards), two
    in one process: the losses are one uninterrupted process's."""
    ref = reference_run(tmp_path, data_dir, 2, steps=6)
    base = make_cfg("chain-fsdp-stages", steps=6, micro_batch_size=8, checkpoint_interval=2, eval_interval=1000)
    pipe = piped(make_cfg, "chain-fsdp-stages", 4, 2, [(2, 2), (6, 2)], strategy="fsdp", steps=6,
                 micro_batch_size=2, global_batch_tokens=8 * 32, checkpoint_interval=2, eval_interval=1000)
    for _ in range(2):
        res = run_train(pipe, 4, tmp_path, "--stop-after", "2")
        assert res.returncode == 0, res.stderr[-3000:]
    finishes_like_one_process(base, ref)


# --- the layout, from recorded inputs ------------------------------------------------------------
SHAPE = GPTNeoXConfig(n_layers=8, d_model=64, n_heads=4, d_ff=256, vocab_size=512)


def test_blocks_follow_speed_and_memory():
    # per block 1 s on a rate-1 stage; the last stage also runs the head (3 s)
    even = split_blocks(8, [(1.0, 0.0), (1.0, 3.0)], [None, None], lambda s, n: 0.0)
    assert even == [5, 3]  # 5 vs 3 + 3: the head's stage takes fewer blocks
    fast_first = split_blocks(8, [(0.5, 0.0), (1.0, 3.0)], [None, None], lambda s, n: 0.0)
    assert fast_first == [7, 1]  # a twice-as-fast card carries more: 7 x 0.5 against 1 + 3
    # the first stage holds at most 3 blocks: the split moves blocks to the next stage
    capped = split_blocks(8, [(1.0, 0.0), (1.0, 3.0)], [3.0, None], lambda s, n: float(n))
    assert capped == [3, 5]
    with pytest.raises(ConfigError, match="stage 0 does not fit even with one block: it needs 2 B of 1 B \\(short by 1 B\\)"):
        split_blocks(8, [(1.0, 0.0), (1.0, 0.0)], [1.0, None], lambda s, n: float(n + 1))


def test_inflight_micro_batches_follow_the_schedule():
    assert [inflight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [inflight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert inflight("gpipe", 4, 0, 8) == 8
    # interleaved, 2 chunks: PyTorch's warm-up forwards ((chunks - 1) x a round + 2 per hop from
    # the last stage) and one more, in chunk micro-batches
    assert [inflight("interleaved", 4, s, 8, 2) for s in range(4)] == [11, 9, 7, 5]
    assert inflight("interleaved", 4, 0, 2, 2) == 4  # capped at every chunk micro-batch


def test_interleaved_chunks_loop_over_the_ranks():
    """Two stages, two chunks each, blocks 3 + 2: chunk c of stage p is virtual stage 2c + p, so the
    blocks run 0-1 (stage 0), 2 (stage 1), 3 (stage 0), 4 (stage 1); the fill and drain are half
    a slot a step, not one."""
    plan = PipelinePlan(2, 1, [3, 2], 2, [4], ["interleaved"], [1.0, 1.0], [0.0, 0.0], "", virtual=2)
    assert plan.chunk_layers(0) == [2, 1] and plan.chunk_layers(1) == [1, 1]
    assert [list(plan.virtual_blocks(g)) for g in range(4)] == [[0, 1], [2], [3], [4]]
    assert plan.chunks(0) == [0, 2] and plan.blocks(0) == [0, 1, 3] and plan.blocks(1) == [2, 4]
    assert plan.blocks_text(0) == "0-1,3-3"
    assert plan.slots(0) == 4.5 and plan.bubble(0) == pytest.approx(0.5 / 4.5)


def test_interleaved_plan_and_its_errors():
    cfg = _cfg(2, 2, pipeline={"schedule": "interleaved", "virtual_stages": 4})
    plan = plan_pipeline(cfg, SHAPE, ["V100"] * 2, [None] * 2, [None] * 2, "fp32", 16)
    assert plan.virtual == 4 and plan.layers == [4, 4] and plan.schedules == ["interleaved"]
    assert sorted(i for s in range(2) for i in plan.blocks(s)) == list(range(8))
    with pytest.raises(ConfigError, match="4 stages x 4 chunks each need 16 blocks; the model has 8"):
        plan_pipeline(_cfg(4, 4, pipeline={"schedule": "interleaved", "virtual_stages": 4}), SHAPE, ["cpu"] * 4,
                      [None] * 4, [None] * 4, "fp32", 16)
    # 5 micro-batches on 4 stages: one round of 5 runs; 6 on 4 stages: 1 round of 6; 10 on 4 stages: 2 of 5;
    # 9 on 4 stages: 2 rounds do not split 9
    odd = _cfg(4, 4, pipeline={"schedule": "interleaved"}, train={"seq_len": 32, "micro_batch_size": 1,
                                                                    "global_batch_tokens": 9 * 32})
    with pytest.raises(ConfigError, match="in 2 equal rounds; a replica has 9"):
        plan_pipeline(odd, SHAPE, ["cpu"] * 4, [None] * 4, [None] * 4, "fp32", 16)
    with pytest.raises(ValueError, match="at least 2 block\\(s\\) \\(one per chunk"):
        _cfg(2, 2, pipeline={"schedule": "interleaved", "layers": [1, 7]})


def _cfg(world: int, stages: int, **over):
    raw = {"model": {"preset": None, "n_layers": 8, "d_model": 64, "n_heads": 4},
           "train": {"seq_len": 32, "micro_batch_size": 2, "global_batch_tokens": 16 * 32},
           "parallel": {"pipeline": {"stages": stages, **over.pop("pipeline", {})}}, **over}
    return build_config(raw)


def test_a_pipeline_plan_on_declared_cards():
    """Two stages of one V100-32GB and one P100-16GB each, two replicas: the faster card's stage
    carries more blocks; replicas get equal micro-batch counts; ranks are stage-major."""
    cfg = _cfg(4, 2)
    plan = plan_pipeline(cfg, SHAPE, ["V100-32GB", "V100-32GB", "P100", "P100"], [None] * 4,
                         [32 * 2**30] * 2 + [16 * 2**30] * 2, "fp32", 16)
    assert plan.layers[0] > plan.layers[1] and sum(plan.layers) == 8
    assert plan.micro_batches == [4, 4] and plan.schedules == ["1f1b", "1f1b"]
    assert [plan.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.pipeline_ranks(1) == [1, 3] and plan.stage_ranks(1) == [2, 3]
    assert PipelinePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_stages_shard_over_their_replicas_before_recomputing():
    """2 stages x 4 replicas of V100s in fp16: sharding a stage over its replicas keeps a quarter of
    its fp32 state and the gathered fp16 weights and unsharded fp32 gradients (stage_state_bytes);
    with memory just above the sharded split's, strategy auto shards rather than recomputes, strategy
    ddp recomputes."""
    from hetforge.cluster.pipeline_plan import WORKSPACE
    from hetforge.model.accounting import stage_static_bytes

    cards = ["V100"] * 8
    kept = plan_pipeline(_cfg(8, 2), SHAPE, cards, [None] * 8, [None] * 8, "fp16", 16)
    sharded = plan_pipeline(_cfg(8, 2, parallel={"strategy": "fsdp", "pipeline": {"stages": 2}}), SHAPE, cards,
                            [None] * 8, [None] * 8, "fp16", 16)
    assert not kept.shard and sharded.shard and sharded.layers == kept.layers
    n = kept.layers[0]
    saved = stage_static_bytes(SHAPE, n, True, False) - stage_static_bytes(SHAPE, n, True, False, shards=4, gather_bytes=2)
    assert kept.stage_bytes[0] - sharded.stage_bytes[0] == pytest.approx(WORKSPACE * saved)
    budget = [max(sharded.stage_bytes) * 1.001] * 8  # no split of replicated stages fits under it
    auto = plan_pipeline(_cfg(8, 2), SHAPE, cards, [None] * 8, budget, "fp16", 16)
    assert auto.shard and not any(auto.recomputed) and "sharded over its 4 replicas" in auto.why
    ddp = plan_pipeline(_cfg(8, 2, parallel={"strategy": "ddp", "pipeline": {"stages": 2}}), SHAPE, cards,
                        [None] * 8, budget, "fp16", 16)
    assert not ddp.shard and any(ddp.recomputed)


def test_stages_recompute_their_blocks_where_kept_activations_do_not_fit():
    """Declared memory below what kept activations need: under auto each stage recomputes the
    fewest of its blocks that make it fit (a recomputed block holds its input per in-flight
    micro-batch; the first adds one block's working set), each recomputed block costing a third of
    its FLOPs again; less memory, more blocks recomputed; `recompute: none` names the stage short
    of memory instead, `blocks` recomputes them all."""
    cards = ["V100"] * 2
    kept = plan_pipeline(_cfg(2, 2), SHAPE, cards, [None] * 2, [None] * 2, "fp32", 16)
    assert kept.recomputed == [0, 0] and kept.layers == [4, 4]
    tight = [0.8 * max(kept.stage_bytes)] * 2
    redone = plan_pipeline(_cfg(2, 2), SHAPE, cards, [None] * 2, tight, "fp32", 16)
    assert redone.layers == [4, 4] and redone.recomputed == [3, 2] and "recomputed in the backward: 3+2" in redone.why
    assert all(b <= m for b, m in zip(redone.stage_bytes, tight))
    per_block = kept.stage_micro_s[0] / 4  # the first stage's embedding lookup has no FLOPs
    for s in range(2):
        assert redone.stage_micro_s[s] == pytest.approx(kept.stage_micro_s[s] + redone.recomputed[s] / 3 * per_block)
    looser = plan_pipeline(_cfg(2, 2), SHAPE, cards, [None] * 2, [0.95 * max(kept.stage_bytes)] * 2, "fp32", 16)
    assert looser.layers == [4, 4] and sum(looser.recomputed) < sum(redone.recomputed)
    assert plan_pipeline(_cfg(2, 2), SHAPE, cards, [None] * 2, tight, "fp32", 16).recomputed_blocks(0) == {0, 1, 2}
    with pytest.raises(ConfigError, match="pipeline stage|no split"):
        plan_pipeline(_cfg(2, 2, pipeline={"recompute": "none"}), SHAPE, cards, [None] * 2, tight, "fp32", 16)
    forced = plan_pipeline(_cfg(2, 2, pipeline={"recompute": "blocks"}), SHAPE, cards, [None] * 2, [None] * 2,
                           "fp32", 16)
    assert forced.recomputed == forced.layers and max(forced.stage_bytes) < max(kept.stage_bytes)


def test_a_stage_recomputes_only_its_planned_blocks():
    """A stage module recomputing blocks {1} of 0-2: the same output and gradients as keeping all
    (dropout on: its masks replayed), with block 1's forward run again in the backward."""
    import torch

    from hetforge.model.gpt_neox import GPTNeoX
    from hetforge.train.pipeline import StageModule

    shape = GPTNeoXConfig(n_layers=3, d_model=32, n_heads=4, d_ff=64, vocab_size=64, dropout=0.1,
                          tie_embeddings=False)
    x = torch.randint(0, 64, (2, 8))
    outs, grads = [], []
    calls = {"n": 0}
    for recompute in (frozenset(), {1}):
        model = GPTNeoX.build(shape, "cpu", 0)
        hook = model.layers[1].register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
        calls["n"] = 0
        torch.manual_seed(1)
        out = StageModule(model, range(3), True, True, recompute)(x)
        out.square().mean().backward()
        hook.remove()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        assert calls["n"] == (2 if recompute else 1)
    assert torch.equal(outs[0], outs[1])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))


def test_each_stage_plans_its_activations_with_its_micro_batches_in_flight():
    """memory.budget under a fixed pipeline, declared V100s at 1.6 GiB: each rank solves a per-tensor
    plan for its own blocks, with the micro-batches its 1F1B stage holds at once (2 on the first, 1
    on the last) counted, and fits; the first stage, holding more, moves more of its activations."""
    from hetforge.cluster.facts import declared_facts
    from hetforge.cluster.run_plan import resolve_plan
    from hetforge.memory.plan import Plan, stage_profile, simulate
    from tests.test_run_plan import nodes

    cfg = build_config({"model": {"preset": None, "n_layers": 8, "d_model": 1024, "n_heads": 8},
                        "train": {"seq_len": 1024, "micro_batch_size": 2, "global_batch_tokens": 8 * 2 * 1024},
                        "memory": {"budget": "auto"}, "parallel": {"pipeline": {"stages": 2}}})
    facts = declared_facts(cfg, BIG, nodes({"type": "V100-16GB", "count": 2, "memory_gb": 1.6}), "x")
    plan = resolve_plan(cfg, BIG, facts)
    pipe = plan.pipeline
    assert pipe.layers == [4, 4] and pipe.recomputed == [0, 0] and "activations planned per stage" in pipe.why
    moved = []
    for r in plan.ranks:
        assert len(r.activation_plan) == 4 and r.predicted_peak_bytes <= r.memory_bytes
        moved.append(sum(o != "keep" for o in r.activation_plan))
        # the prediction is the simulator's on the stage's profile, with its in-flight micro-batches
        prof = facts.views[r.rank].profile(2, plan.precision, r.head_dim, False)
        buffers = 4 * 2 * 1024 * 1024 * 4  # received activations and sent gradients: micro x seq x d_model, fp32
        stage = stage_profile(prof, 4, r.rank == 1, r.static_bytes, 2 - r.rank, buffers)
        assert simulate(stage, Plan(r.activation_plan)).peak_bytes == pytest.approx(r.predicted_peak_bytes)
        assert simulate(stage, Plan(["keep"] * 4)).peak_bytes > r.memory_bytes  # keeping all would not fit
    assert moved[0] >= moved[1] > 0
    with pytest.raises(ValueError, match="not interleaved"):
        build_config({"memory": {"budget": "1GiB"}, "parallel": {"pipeline": {"stages": 2, "schedule": "interleaved"}}})
    # with a plan, stages: auto prices no interleaved pipeline (its chunks would share one plan)
    auto = cfg.model_copy(update={"parallel": build_config({"parallel": {"pipeline": {"stages": "auto"}}}).parallel})
    ranks = Ranks(["V100-16GB"] * 2, [0, 1], [None] * 2, [1.6 * GIB] * 2, {0: None, 1: None})
    layouts = [c.layout for c in candidates(auto, BIG, ranks, "fp32", 128, Links(10e9, 1e9, 50e-6))]
    assert any(name.startswith("pipeline 2 stages") for name in layouts)
    assert not any("interleaved" in name for name in layouts)


def test_replica_shares_by_speed_and_whole_micro_batches():
    cfg = _cfg(4, 2)
    assert micro_counts(cfg, 2, 2, [1.0, 3.0]) == [2, 6]
    fixed = _cfg(4, 2, cluster={**cpus(4), "balance": "fixed", "assignments": [
        {"samples": 3, "micro_batch_size": 3}, {"samples": 13, "micro_batch_size": 3}]})
    with pytest.raises(ConfigError, match="every replica's micro-batch is train.micro_batch_size=2"):
        micro_counts(fixed, 2, 2, [1.0, 1.0])


@pytest.mark.parametrize("world,over,message", [
    (3, {}, "parallel.pipeline.stages=2 does not divide the 3 ranks"),
    (2, {"pipeline": {"layers": [2, 2]}}, None),
    (2, {"pipeline": {"stages": 2, "schedule": "1f1b"}, "train": {"seq_len": 32, "micro_batch_size": 16,
                                                                   "global_batch_tokens": 16 * 32}},
     "schedule=1f1b needs at least 2 micro-batches per replica"),
])
def test_layout_errors_are_one_line(world, over, message):
    if message is None:  # a split that does not cover the model: refused when the config is read
        with pytest.raises(ValueError, match="cover 4 blocks but the model has 8"):
            _cfg(world, 2, **over)
        return
    pipeline = over.pop("pipeline", {})
    pipeline.pop("stages", None)
    cfg = _cfg(world, 2, pipeline=pipeline, **over)
    with pytest.raises(ConfigError, match=message):
        plan_pipeline(cfg, SHAPE, ["cpu"] * world, [None] * world, [None] * world, "fp32", 16)


def test_pipeline_config_errors():
    with pytest.raises(ValueError, match="needs untied embeddings"):
        _cfg(2, 2, model={"preset": None, "n_layers": 8, "d_model": 64, "n_heads": 4, "tie_embeddings": True})
    with pytest.raises(ValueError, match="strategy=zero2"):
        build_config({"parallel": {"strategy": "zero2", "pipeline": {"stages": 2}}})
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        build_config({"parallel": {"pipeline": {"stages": 3, "layers": [1, 1]}}})


# --- which layout: data parallelism or a pipeline, at the declared links (recorded inputs) ---------
from hetforge.cluster.layouts import Links, Ranks, candidates, choose  # noqa: E402
from hetforge.core.hardware import lookup  # noqa: E402
from hetforge.memory.analytic import HOST_STEP_S_PER_PARAM  # noqa: E402
from hetforge.model.accounting import collective_bytes_per_step, count_parameters  # noqa: E402

BIG = GPTNeoXConfig(n_layers=8, d_model=1024, n_heads=8, d_ff=4096, vocab_size=8192)
GIB = 2**30


def _layouts(inter_gbit: float, host_gib: float = 0.1):
    """Two nodes of two V100s declared at 0.8 GiB each: the whole training state (1.9 GiB) fits
    neither one node's pair (DDP, ZeRO, FSDP within nodes, a 2-stage pipeline replicated per node)
    nor anything but FSDP over all four ranks or a 4-stage pipeline; each node's host holds
    `host_gib` for offloaded state."""
    cfg = build_config({"model": {"preset": None, "n_layers": 8, "d_model": 1024, "n_heads": 8},
                        "train": {"seq_len": 128, "micro_batch_size": 1, "global_batch_tokens": 16 * 128},
                        "parallel": {"pipeline": {"stages": "auto"}}})
    links = Links(10e9, inter_gbit * 1e9 / 8, 50e-6)
    ranks = Ranks(["V100"] * 4, [0, 0, 1, 1], [None] * 4, [0.8 * GIB] * 4, {0: host_gib * GIB, 1: host_gib * GIB})
    return cfg, links, candidates(cfg, BIG, ranks, "fp32", 128, links)


def test_a_slow_link_picks_the_pipeline_and_a_fast_one_fsdp():
    cfg, links, slow = _layouts(1.0)
    offloaded = [c for c in slow if c.offload != "none"]
    assert {c.layout for c in offloaded} == {"ddp + optimizer offload", "zero2 + params offload",
                                             "fsdp + params offload", "fsdp within nodes (2 x 2) + params offload"}
    assert not any(c.fits for c in offloaded)
    assert "node 0's host needs" in next(c for c in offloaded if c.layout == "fsdp + params offload").note
    fits = {c.layout.split(" (")[0] for c in slow if c.fits}
    assert fits == {"fsdp", "pipeline 4 stages x 1", "pipeline 4 stages x 1 interleaved x2"}
    best, line = choose(slow)
    by = {c.layout.split(" (")[0]: c for c in slow}
    looped = by["pipeline 4 stages x 1 interleaved x2"]
    # the link binds: two chunks a stage send each micro-batch's activations twice as often, so
    # the interleaved pipeline's shorter fill and drain does not pay
    assert best.stages == 4 and best.schedule == "auto" and "against pipeline 4 stages x 1 interleaved" in line
    assert looped.comm_s == pytest.approx(2 * best.comm_s) and looped.step_s > best.step_s
    fsdp = next(c for c in slow if c.layout == "fsdp")
    # FSDP's step is its collectives: each micro-batch gathers the weights twice and reduce-scatters
    # the gradients, over the inter-node link (ring: (4-1)/4 of the buffer each)
    sent = collective_bytes_per_step(BIG, "fsdp", 4, 4, 4)
    assert fsdp.comm_s == pytest.approx(sent / links.inter_bytes_per_s + 8 * links.latency_s)
    assert fsdp.step_s == fsdp.comm_s > 100 * best.step_s
    # the pipeline's: 16 micro-batches + 3 fill/drain slots of its slowest stage; interleaved: 3 / 2
    assert best.bubble == pytest.approx(3 / 19) and looped.bubble == pytest.approx(1.5 / 17.5)
    _, _, fast = _layouts(800.0)
    best_fast, line_fast = choose(fast)
    assert best_fast.layout == "fsdp" and best_fast.step_s == pytest.approx(best_fast.compute_s)
    assert "against pipeline 4 stages x 1 interleaved x2" in line_fast
    by_fast = {c.layout.split(" (")[0]: c for c in fast}
    # where compute binds, the shorter fill and drain wins: 17.5 slots against 19
    assert by_fast["pipeline 4 stages x 1 interleaved x2"].step_s < by_fast["pipeline 4 stages x 1"].step_s


def test_offload_is_priced_with_the_hosts_step_and_copies_and_fits_the_hosts_memory():
    _, _, cands = _layouts(800.0, host_gib=64)
    by = {c.layout: c for c in cands}
    fsdp, offloaded = by["fsdp"], by["fsdp + params offload"]
    n = count_parameters(BIG)["total"]
    # each rank's host steps its quarter of the parameters; per micro-batch (4 a rank) its weight
    # shard goes to the card for both gathers and its gradient shard comes back, over PCIe
    copies = (2 * 4 + 4) * n / 4 * 4 / (lookup("V100").link_gbps * 1e9)
    assert offloaded.fits and offloaded.host_s == pytest.approx(HOST_STEP_S_PER_PARAM * n / 4 + copies)
    assert offloaded.step_s == pytest.approx(fsdp.step_s + offloaded.host_s)
    assert offloaded.peak_bytes < fsdp.peak_bytes / 2  # only the gathered units stay on the card
    # DDP keeps everything but the optimizer's state on the card: still more than 0.8 GiB
    assert not by["ddp + optimizer offload"].fits and "needs" in by["ddp + optimizer offload"].note
    assert choose(cands)[0].layout == "fsdp"  # offload only where it is needed to fit


def test_no_layout_fitting_names_the_closest():
    cfg = build_config({"model": {"preset": None, "n_layers": 8, "d_model": 1024, "n_heads": 8},
                        "train": {"seq_len": 128, "micro_batch_size": 1, "global_batch_tokens": 16 * 128},
                        "parallel": {"pipeline": {"stages": "auto"}}})
    ranks = Ranks(["V100"] * 2, [0, 1], [None] * 2, [0.1 * GIB] * 2, {0: None, 1: None})
    cands = candidates(cfg, BIG, ranks, "fp32", 128,
                       Links(10e9, 1e9, 50e-6))
    with pytest.raises(ConfigError, match=r"no layout fits: the least memory-hungry \(fsdp \+ params offload\) needs"):
        choose(cands)
