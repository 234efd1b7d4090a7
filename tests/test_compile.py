"""Regional torch.compile: the same training within float rounding; decided from the device and
whether a memory plan is active."""

import pytest
import torch
from torch._dynamo.utils import counters

from hetforge.core.metrics import read_metrics
from hetforge.train.loop import train
from hetforge.core.hardware import compile_decision


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_and_the_cold_start_is_logged(make_cfg):
    eager = train(make_cfg("eager", steps=4, compile="off", eval_interval=100))
    compiled = train(make_cfg("compiled", steps=4, compile="on", eval_interval=100))
    for s in eager.losses:
        assert compiled.losses[s] == pytest.approx(eager.losses[s], rel=1e-4)
    events = read_metrics(compiled.run_dir / "metrics.jsonl")["event"]
    assert [e["first_step_s"] > 0 for e in events if e["event"] == "compile"] == [True]


def test_compile_decision():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert compile_decision("auto", gpu, False)[0] and not compile_decision("auto", cpu, False)[0]
    assert compile_decision("on", cpu, False)[0] and not compile_decision("off", gpu, False)[0]
    # under a memory plan too, saying that the plan's per-op choices run eager
    on, why = compile_decision("auto", gpu, True)
    assert on and "per-op choices run eager" in why
    assert compile_decision("on", cpu, True)[0] and not compile_decision("auto", cpu, True)[0]


def compiled_tiny_model():
    """A 3-block model, its eager gradients on a batch, then its blocks compiled (branches only)."""
    from hetforge.model.gpt_neox import GPTNeoX
    from hetforge.train.parallel import compile_blocks
    from tests.test_memory_exec import _cfg, _step

    torch.manual_seed(0)
    cfg = _cfg(True)
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    ref, _ = _step(model, idx)
    compile_blocks(model)
    return cfg, model, idx, ref


def test_plans_run_compiled_branches_where_no_op_is_chosen_and_give_the_eager_gradients():
    """Keeping a branch or recomputing it whole runs the compiled branch (inside the checkpoint);
    a branch whose plan caches or offloads some of its units runs the eager one. Every plan's
    gradients equal the plain eager model's within compiled float rounding, and an offloaded block
    input comes back at the layout the compiled backward checks."""
    from hetforge.memory.executor import apply_plan, per_op_decisions
    from hetforge.memory.plan import OPTIONS, Plan, resolve_option, sqrt_segments
    from tests.test_memory_exec import MIXED, _step
    from hetforge.memory.executor import input_users

    users = input_users(True)
    rebuilt = "attn:keep | mlp:keep-rebuild[gelu-out]"
    routes = {o: [per_op_decisions(resolve_option(o, users).branch(b)) for b in ("attn", "mlp")]
              for o in ["keep", "recompute", "offload", "recompute-mlp", rebuilt] + MIXED[:1]}
    assert routes == {"keep": [False, False], "recompute": [False, False], "offload": [True, True],
                      "recompute-mlp": [False, False], rebuilt: [False, True], MIXED[0]: [True, True]}

    cfg, model, idx, ref = compiled_tiny_model()
    calls = {"eager": 0}
    for block in model.layers:  # count the eager branches the runner falls back to
        for name in ("attn_branch", "mlp_branch"):
            orig = getattr(block, name)._torchdynamo_orig_callable

            def counted(*a, _f=orig):
                calls["eager"] += 1
                return _f(*a)
            getattr(block, name)._torchdynamo_orig_callable = counted
    plans = [Plan([o] * cfg.n_layers) for o in list(OPTIONS) + MIXED[:2] + [rebuilt]]
    plans.append(Plan(["keep"] * cfg.n_layers, segments=sqrt_segments(cfg.n_layers)))
    plans.append(Plan(["attn:keep | mlp:recompute | offload[x]"] * cfg.n_layers))  # the block input offloaded, branches compiled
    counters.clear()
    for plan in plans:
        calls["eager"] = 0
        runner = apply_plan(model, plan)
        got, _ = _step(model, idx)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{plan.options[0]}: {m}")
        assert runner.ledger.device_bytes == 0 and runner.ledger.host_bytes == 0
        d = resolve_option(plan.options[0], users)
        per_op = any(per_op_decisions(d.branch(b)) for b in ("attn", "mlp"))
        assert (calls["eager"] > 0) == per_op, (plan.options[0], calls)
    # the runner's module hooks (labels, what the head merge read) run inside the compiled
    # branches without breaking their graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    apply_plan(model, None)


def test_compile_budgets_run_compiled_save_less_and_give_the_eager_gradients():
    """A kept branch at a compile budget under 1 runs compiled by the partitioner at that budget
    (`memory.compiled`): the gradients are the eager model's within compiled float rounding, and
    the saved bytes the ledger counts fall as the budget does (at 0 the partitioner recomputes the
    branch in its backward and saves little beyond its input)."""
    from hetforge.memory.executor import apply_plan
    from hetforge.memory.plan import Plan
    from tests.test_memory_exec import _step

    cfg, model, idx, ref = compiled_tiny_model()
    held = {}
    counters.clear()
    for option in ("keep", "attn:keep@0.7 | mlp:keep@0.5", "attn:keep@0 | mlp:keep@0",
                   "attn:keep@0.5 | mlp:recompute | offload[x]"):
        runner = apply_plan(model, Plan([option] * cfg.n_layers))
        got, _ = _step(model, idx)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{option}: {m}")
        assert runner.ledger.device_bytes == 0 and runner.ledger.host_bytes == 0
        held[option] = runner.ledger.peak_device
    assert held["attn:keep@0 | mlp:keep@0"] < held["attn:keep@0.7 | mlp:keep@0.5"] <= held["keep"]
    assert held["attn:keep@0 | mlp:keep@0"] < 0.5 * held["keep"]
    assert not counters["graph_break"], dict(counters["graph_break"])
    apply_plan(model, None)


def test_a_compiled_profile_measures_each_compile_budget():
    """What a compiled run's planner prices: per kept branch and budget of `COMPILED_BUDGETS` the
    bytes its graph saves (fewer at a lower budget; at 0 fewer than the eager branch's units) and
    the time it adds; the price of a kept branch run eager and of the block under the saved-tensor
    hooks; and the cache keeps it apart from the eager profile."""
    from hetforge.memory.compiled import COMPILED_BUDGETS
    from hetforge.memory.profile import _cache_key, profile_block
    from tests.test_memory_exec import _cfg

    cfg = _cfg(True, n_layers=2)
    cpu = torch.device("cpu")
    blk = profile_block(cfg, 2, 32, "fp32", cpu, repeats=1, chain=1, compiled=True)
    for br in ("attn", "mlp"):
        figs = blk.compiled[br]
        assert sorted(figs) == sorted(f"{b:g}" for b in COMPILED_BUDGETS)
        assert figs["0"]["held"] < figs["0.7"]["held"]
        assert figs["0"]["held"] < sum(u.bytes for u in blk.of("saved", br))
        assert all(f["time_s"] >= 0 for f in figs.values()) and "eager" in blk.recompute[br]
        assert blk.cost(f"{br}:keep@0 | {'mlp' if br == 'attn' else 'attn'}:keep").held < blk.cost("keep").held
    assert "hooks" in blk.recompute["block"]
    key = lambda compiled: _cache_key(cfg, 2, 32, "fp32", cpu, None, "adamw", compiled=compiled)  # noqa: E731
    assert key(True) != key(False)
