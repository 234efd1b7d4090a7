"""Plans run on the real model (CPU): numerics unchanged, bytes as the planner predicts, and the
training loop's own check."""

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_hook
import yaml

from hetforge.cli import main
from hetforge.memory.executor import apply_plan, runner_of
from hetforge.memory.measure import PeakMeter
from hetforge.memory.milp import menu_for, minimum_budget, solve
from hetforge.memory.plan import OPTIONS, Plan, simulate, sqrt_segments
from hetforge.memory.profile import free_memory_bytes, profile_block, profile_model, timing_depth
from hetforge.model.gpt_neox import Block, GPTNeoX, GPTNeoXConfig, set_head_padding
from hetforge.train.loop import train
from hetforge.core.metrics import read_metrics

MIXED = [
    "attn:recompute-cache[qkv,sdpa] | mlp:keep-offload[hidden]",
    "attn:keep-offload[core,merged] | mlp:recompute-cache[up] | offload[x]",
    "attn:recompute-cache[rope] | mlp:recompute-cache[gelu,norm]",
    # rebuilt in the backward: from sources kept, and from sources offloaded to the host
    "attn:keep-rebuild[merged,norm-out] | mlp:keep-rebuild[gelu-out,norm-out]",
    "attn:keep-offload[core]-rebuild[merged,norm-out] | mlp:keep-offload[hidden]-rebuild[gelu-out,norm-out] | offload[x]",
    "attn:recompute | mlp:keep-rebuild[gelu-out]",
]


def _cfg(parallel: bool = True, n_layers: int = 3) -> GPTNeoXConfig:
    return GPTNeoXConfig(n_layers=n_layers, d_model=64, n_heads=4, d_ff=256, vocab_size=128,
                         parallel_residual=parallel)


def _step(model, idx):
    """One forward + backward with the gradients already allocated, so the meter sees activations."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with PeakMeter("cpu") as meter:
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        del logits
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], meter.peak


@pytest.mark.parametrize("parallel", [True, False])
def test_every_strategy_gives_the_keep_all_gradients(parallel):
    torch.manual_seed(0)
    cfg = _cfg(parallel)
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    ref, _ = _step(model, idx)
    plans = [Plan([o] * cfg.n_layers) for o in list(OPTIONS) + MIXED]
    plans.append(Plan(["keep"] * cfg.n_layers, segments=sqrt_segments(cfg.n_layers)))
    plans.append(Plan(["offload", MIXED[0], "recompute-mlp"]))
    for plan in plans:
        runner = apply_plan(model, plan)
        got, _ = _step(model, idx)
        diff = max((a - b).abs().max().item() for a, b in zip(got, ref))
        assert diff <= 1e-6, (plan.options, plan.segments, diff)
        assert runner.ledger.device_bytes == 0 and runner.ledger.host_bytes == 0  # all released
    apply_plan(model, None)
    assert runner_of(model) is None


def test_micro_batches_in_flight_keep_their_own_block_state():
    """As a pipeline's 1F1B runs them: two micro-batches' forwards, then their backwards, under
    per-tensor plans (selective recomputation, offload, rebuilds): the gradients of forward-backward
    one at a time, and every saved byte released."""
    torch.manual_seed(0)
    cfg = _cfg(True)
    model = GPTNeoX(cfg)
    idx = [torch.randint(0, cfg.vocab_size, (2, 33)) for _ in range(2)]

    def loss(i):
        logits = model(idx[i][:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), idx[i][:, 1:].flatten())

    for options in ([MIXED[0], MIXED[1], MIXED[4]], [MIXED[2], "offload", MIXED[3]]):
        runner = apply_plan(model, Plan(options))
        model.zero_grad(set_to_none=True)
        for i in range(2):
            loss(i).backward()
        one_at_a_time = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        first, second = loss(0), loss(1)
        first.backward()
        second.backward()
        overlapped = [p.grad.clone() for p in model.parameters()]
        diff = max((a - b).abs().max().item() for a, b in zip(one_at_a_time, overlapped))
        assert diff <= 1e-6, (options, diff)
        assert runner.ledger.device_bytes == 0 and runner.ledger.host_bytes == 0
    apply_plan(model, None)


@pytest.mark.slow
def test_only_blocks_that_choose_per_unit_carry_the_labels():
    """The labeller's module hooks cost a Python call per submodule: a block that keeps, recomputes
    or offloads its input whole runs without them (its bytes are counted by storage), one that
    offloads, rebuilds or caches units has them, and a recording ledger labels every block."""
    torch.manual_seed(0)
    cfg = _cfg(True, n_layers=5)
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    options = ["keep", "recompute", "attn:keep | mlp:keep | offload[x]", MIXED[0], MIXED[3]]
    plan = Plan(options)

    def hooked() -> list[bool]:
        return [bool(b.input_layernorm._forward_pre_hooks) for b in model.layers]

    ref, _ = _step(model, idx)
    runner = apply_plan(model, plan, measure=False)
    assert hooked() == [False, False, False, True, True]
    got, _ = _step(model, idx)
    assert max((a - b).abs().max().item() for a, b in zip(got, ref)) <= 1e-6
    runner.measure = True  # the run-time check counts bytes by storage: no labels needed
    _step(model, idx)
    assert runner.ledger.peak_device == pytest.approx(
        simulate(profile_model(cfg, 2, 32, repeats=1), plan).held_bytes, rel=0.02, abs=16 * 1024)
    runner.ledger.record = True  # a recording names every unit
    handles = runner.install_labels(model.layers)
    assert hooked() == [True] * 5
    for h in handles:
        h.remove()
    apply_plan(model, None)
    assert not any(bool(b.input_layernorm._forward_pre_hooks) for b in model.layers)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [True, False])
def test_saved_bytes_and_peaks_match_the_prediction(parallel):
    """The profile's units priced right: what the ledger holds and the allocator's activation peak,
    for every named option and some mixed decisions, against `simulate`."""
    torch.manual_seed(0)
    cfg = _cfg(parallel)
    prof = profile_model(cfg, 2, 32, repeats=1)
    # recomputation priced per branch and for the pair, measured as a whole (not a sum); the block
    # under the saved-tensor hooks priced on its own, and on the CPU the host copies as the model made them
    blk = prof.blocks[0]
    assert set(blk.recompute) == {"attn", "mlp", "both", "block"}
    assert set(blk.recompute["block"]) == {"hooks", "copy"}
    assert prof.meta["link_source"] in ("in the model", "on one copy")
    if prof.meta["link_source"] == "in the model":  # every unit and the input went out and came back
        assert prof.link_bytes_per_s == pytest.approx(2 * blk.cost("offload").host / blk.recompute["block"]["copy"])
    assert prof.blocks[0].recompute["both"]["plain"] >= 0.0
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    _step(model, idx)
    for o in list(OPTIONS) + MIXED:
        plan = Plan([o] * cfg.n_layers)
        runner = apply_plan(model, plan)
        _, peak = _step(model, idx)
        pred = simulate(prof, plan)
        assert runner.ledger.peak_device == pytest.approx(pred.held_bytes, rel=0.02, abs=16 * 1024), o
        assert runner.ledger.peak_host == pytest.approx(pred.host_bytes, rel=0.02, abs=16 * 1024), o
        # measured / predicted: 1.00 for keep and recompute; 0.85-0.97 for offload (the CPU finishes its
        # copies early); down to 0.78 where a recomputed branch caches outputs (priced by an upper bound)
        assert peak <= pred.activation_peak * 1.01, o  # the plan never uses more than predicted
        assert peak >= pred.activation_peak * 0.70, o  # and the prediction is not loose


@pytest.mark.parametrize("autocast", [False, True])
def test_a_kept_branch_rebuilds_its_cheap_units_in_the_backward(autocast):
    """The layer norms', the GELU's and the head merge's outputs, rebuilt: the same gradients bit
    for bit, and not held from forward to backward: the ledger holds less by exactly what the
    profile says rebuilding frees. Under a bf16 autocast what a matmul saved is a cast of the norm's
    fp32 output, rebuilt as such, beside the weight's cast, which stays."""
    torch.manual_seed(0)
    cfg = _cfg(True, n_layers=2)
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 33))
    rebuilt = "attn:keep-rebuild[merged,norm-out] | mlp:keep-rebuild[gelu-out,norm-out]"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _step(model, idx)[0]

    held = {}
    for option in ("keep", rebuilt):
        runner = apply_plan(model, Plan([option] * cfg.n_layers))
        grads = step()
        held[option] = runner.ledger.peak_device
        ref = grads if option == "keep" else ref
    apply_plan(model, None)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    blk = profile_block(cfg, 3, 32, "bf16" if autocast else "fp32", torch.device("cpu"), repeats=1)
    units = {u.name: u for u in blk.units if u.rebuild_from}
    assert set(units) == {"attn.norm-out", "mlp.norm-out", "mlp.gelu-out", "attn.merged"}
    assert units["mlp.gelu-out"].rebuild_from == "mlp.hidden" and units["attn.norm-out"].rebuild_from == "x"
    assert units["attn.merged"].rebuild_from == "attn.core"
    frees = sum(u.rebuild_bytes for u in units.values())
    assert frees > 0 and held["keep"] - held[rebuilt] == cfg.n_layers * frees
    if autocast:  # the weights' casts stay
        assert all(u.rebuild_bytes < u.bytes for u in units.values())
    else:
        assert all(u.rebuild_bytes == u.bytes for u in units.values())
    assert blk.recompute["mlp"]["rebuild"] >= 0.0 and blk.recompute["attn"]["rebuild"] >= 0.0


def test_a_merge_of_a_padded_attention_output_is_kept():
    """With the head padded, SDPA saves the padded output and the merge reads a slice of it: no
    saved tensor is what the merge read, so the merged copy stays kept (nothing is made from the
    wrong tensor) and the gradients are unchanged."""
    torch.manual_seed(0)
    cfg = _cfg(True, n_layers=1)
    model = GPTNeoX(cfg)
    set_head_padding(model, cfg.head_dim + 8)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    held = {}
    for option in ("keep", "attn:keep-rebuild[merged] | mlp:keep", "attn:keep-rebuild[norm-out] | mlp:keep"):
        runner = apply_plan(model, Plan([option]))
        grads, _ = _step(model, idx)
        held[option] = runner.ledger.peak_device
        ref = grads if option == "keep" else ref
        assert all(torch.equal(a, b) for a, b in zip(grads, ref)), option
    apply_plan(model, None)
    assert held["attn:keep-rebuild[merged] | mlp:keep"] == held["keep"]
    assert held["attn:keep-rebuild[norm-out] | mlp:keep"] < held["keep"]


@pytest.mark.slow
def test_the_profile_times_distinct_copies_of_the_block_and_frees_them():
    """Timing over a chain (`timing_depth`) runs that many copies of the block, each with its own
    weights, frees them afterwards, and leaves what it measures of memory (peaks, saved units, op
    units' bytes) the one block's."""
    cfg = _cfg(n_layers=4)
    seen: list[tuple[weakref.ref, int]] = []  # each Block that ran (by identity: ids are reused)

    def spy(module, args, out):
        if isinstance(module, Block) and not any(ref() is module for ref, _ in seen):
            seen.append((weakref.ref(module), next(module.parameters()).data_ptr()))

    handle = register_module_forward_hook(spy)
    try:
        alone = profile_block(cfg, 2, 32, "fp32", torch.device("cpu"), repeats=1, chain=1)
        n_alone = len(seen)
        chain = profile_block(cfg, 2, 32, "fp32", torch.device("cpu"), repeats=1, chain=4)
    finally:
        handle.remove()
    assert n_alone == 1 and alone.timing_depth == 1
    assert chain.timing_depth == 4 and len(seen) == 1 + 4
    assert len({ptr for _, ptr in seen[n_alone:]}) == 4  # each copy its own weights
    gc.collect()
    assert all(ref() is None for ref, _ in seen)  # nothing of the chain is left held
    assert chain.peaks == alone.peaks
    assert chain.tensors == alone.tensors
    assert [(u.name, u.kind, u.bytes) for u in chain.units] == [(u.name, u.kind, u.bytes) for u in alone.units]
    assert chain.fwd_s > 0 and chain.bwd_s > 0


def test_timing_depth_is_the_model_depth_within_a_quarter_of_free_memory():
    assert timing_depth(12, 1024, 2**30) == 12
    assert timing_depth(1, 1024, 2**30) == 1
    assert timing_depth(12, 0, 2**30) == 12
    assert timing_depth(12, 2**30, 2**30) == 1  # not even one more copy fits: the block alone
    assert timing_depth(64, 2**20, 8 * 2**22) == 8  # a quarter of 32 MiB holds 8 copies of 1 MiB
    assert free_memory_bytes(torch.device("cpu")) > 0


@pytest.mark.slow
@pytest.mark.parametrize("frac", [1.0, 0.6, 0.35])
def test_planned_model_stays_within_the_budget(frac):
    """Budgets at 100%, 60% and 35% of keep-all's activation memory (or the feasible minimum, if
    higher): held bytes within 10% of the prediction, and the measured peak within the budget."""
    torch.manual_seed(0)
    cfg = _cfg(n_layers=4)
    prof = profile_model(cfg, 4, 32, repeats=1)
    keep = simulate(prof, Plan(["keep"] * cfg.n_layers))
    menu = menu_for("tensor")
    budget = max(prof.static_bytes + frac * keep.activation_peak, minimum_budget(prof, menu))
    plan = solve(prof, budget, menu, gap=0.0)
    pred = simulate(prof, plan)
    assert pred.peak_bytes <= budget
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, 33))
    _step(model, idx)
    runner = apply_plan(model, plan)
    _, peak = _step(model, idx)
    held = runner.ledger.peak_device
    assert held <= budget - prof.static_bytes
    assert held == pytest.approx(pred.held_bytes, rel=0.10)
    assert peak <= budget - prof.static_bytes
    if frac == 1.0:
        assert plan.options == ["keep"] * cfg.n_layers
    else:
        assert held < keep.held_bytes * (frac + 0.1)


@pytest.mark.slow
def test_training_under_a_budget_matches_training_without(make_cfg, tmp_path):
    """Same losses step for step, and the loop's check of measured against predicted."""
    free = train(make_cfg("free", steps=5))
    cfg = make_cfg("planned", steps=5)
    from hetforge.memory.device_plan import plan_for_config
    from hetforge.model.gpt_neox import GPTNeoXConfig as C

    model_cfg = C.from_model_config(cfg.model, 512)
    cfg.memory.budget = "1GiB"
    keep = plan_for_config(cfg, model_cfg, torch.device("cpu"), 4, None, tmp_path / "profiles").keep_all
    static = keep.peak_bytes - keep.activation_peak
    cfg.memory.budget = str(int(static + 0.5 * keep.activation_peak))
    res = train(cfg)
    assert res.losses.keys() == free.losses.keys()
    for s in res.losses:
        assert res.losses[s] == pytest.approx(free.losses[s], abs=1e-6)
    metrics = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    # hardware FLOPs count the plan's recomputation, model FLOPs do not (which plan fits half the
    # activations, recomputing or offloading, follows this machine's measured profile)
    options = json.loads((Path(cfg.run_dir) / "plan.json").read_text())["ranks"][0]["activation_plan"]
    recomputes = any("recompute" in o for o in options)
    assert all(r["hfu"] >= r["mfu"] > 0 and (r["hfu"] > r["mfu"]) == recomputes for r in metrics["train"])
    events = [r for r in metrics["event"] if r.get("event") == "memory_plan_check"]
    assert len(events) == 1
    ev = events[0]
    assert ev["held_ratio"] == pytest.approx(1.0, abs=0.10)
    assert ev["measured_activation_peak_bytes"] <= 0.5 * keep.activation_peak * 1.02
    assert [r["rank"] for r in ev["ranks"]] == [0] and ev["ranks"][0]["held_ratio"] == ev["held_ratio"]


def test_plan_command_tables_files_and_errors(make_cfg, tmp_path, capsys):
    cfg = make_cfg("cli")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "plan"
    assert main(["plan", str(path), "--budget", "4MiB", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for title in ("saved tensors of one block", "units of one block", "decision per block",
                  "predicted peak memory", "recompute-only MILP", "HiGHS"):
        assert title in text
    saved = json.loads((out / "plan.json").read_text())
    assert saved["ranks"][0]["predicted_peak_bytes"] <= 4 * 2**20 and saved["ranks"][0]["activation_plan"]
    assert (out / "memory_timeline.png").stat().st_size > 5000
    # a budget no plan meets names the smallest one; one below the static memory says so
    off = ["--set", "memory.optimizer_offload=off"]
    assert main(["plan", str(path), "--budget", "2.6MiB", "--device", "cpu", "--out", str(out)] + off) == 2
    assert "smallest feasible budget" in capsys.readouterr().err
    assert main(["plan", str(path), "--budget", "1MiB", "--device", "cpu", "--out", str(out)] + off) == 2
    assert "below the weights + gradients + optimizer state alone" in capsys.readouterr().err
    # by default the optimizer's state moves to the host where nothing fits beside it
    assert main(["plan", str(path), "--budget", "2.6MiB", "--device", "cpu", "--out", str(out)]) == 0
    assert "optimizer state in host memory" in capsys.readouterr().out
    assert main(["plan", str(path), "--budget", "1MiB", "--device", "cpu", "--out", str(out)]) == 2
    assert "below the weights + gradients alone" in capsys.readouterr().err


def test_a_keep_all_plan_runs_the_plain_chain_between_measured_steps():
    """Keep-all has nothing to do per block: unmeasured steps run the chain the plan wraps (compiled
    whole where the run compiles it, `memory.compiled.compile_chain`), a measured step runs the
    runner, which counts what is saved; any other plan always runs the runner; and unwrapping gives
    the model its own chain back."""
    torch.manual_seed(0)
    cfg = _cfg(True)
    model = GPTNeoX(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    ref, _ = _step(model, idx)
    chain = model.layers
    calls = []
    own = chain.forward
    chain.forward = lambda *a: (calls.append(1), own(*a))[1]
    runner = apply_plan(model, Plan(["keep"] * cfg.n_layers), measure=True)
    got, _ = _step(model, idx)
    assert calls == [] and runner.ledger.peak_device > 0
    runner.measure = False
    got, _ = _step(model, idx)
    assert calls == [1]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    apply_plan(model, Plan(["recompute-mlp"] * cfg.n_layers), measure=False)
    _step(model, idx)
    assert calls == [1]
    apply_plan(model, None)
    assert model.layers is chain
