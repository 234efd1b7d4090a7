"""Legacy and mixed GPUs, tested on the CPU: the run's one precision for each capability mix, the
fp16 loss scaler on an overflow, and optimizer-state offload against the on-device optimizer."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import hetforge.train.loop as loop
from hetforge.core.hardware import Capability, detect, from_compute_capability, run_precision
from hetforge.config import TrainConfig
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train
from hetforge.core.metrics import read_metrics
from hetforge.train.optim import HostOffloadOptimizer, build_optimizer

CARDS = {
    "H100": (9, 0), "A100": (8, 0), "RTX 3090": (8, 6), "V100": (7, 0), "T4": (7, 5), "RTX 2080 Ti": (7, 5),
    "P100": (6, 0), "GTX 1080 Ti": (6, 1), "K80": (3, 7),
}
CPU = Capability("cpu", "cpu", None, None, False, False)


def cards(*names):
    return [from_compute_capability(n, CARDS[n]) for n in names]


@pytest.mark.parametrize("names,expected,blamed", [
    (("H100", "A100", "RTX 3090"), "bf16", None),
    (("A100", "V100"), "fp16", "rank 1 (V100, compute capability 7.0) has no bf16"),
    (("T4", "RTX 2080 Ti", "V100"), "fp16", "rank 0 (T4"),
    (("A100", "P100"), "fp16", "rank 1 (P100"),  # the P100 runs fp16 at twice its fp32 rate
    (("A100", "V100", "GTX 1080 Ti"), "fp32", "rank 2 (GTX 1080 Ti, compute capability 6.1)"),
    (("K80",), "fp32", "rank 0 (K80"),
])
def test_one_precision_for_each_capability_mix(names, expected, blamed):
    chosen, why = run_precision(cards(*names))
    assert chosen == expected
    if blamed:
        assert blamed in why


def test_a_cpu_in_the_mix_trains_fp32():
    assert run_precision(cards("A100") + [CPU]) == ("fp32", "rank 1 is a CPU")
    assert run_precision([])[0] == "fp32"


def test_detect_reads_the_driver(monkeypatch):
    props = SimpleNamespace(name="Tesla V100-SXM2-32GB", major=7, minor=0, total_memory=32 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cap = detect(torch.device("cuda", 0))
    assert cap == Capability("Tesla V100-SXM2-32GB", "cuda", (7, 0), 32.0 * 2**30, bf16=False, fast_fp16=True)
    assert detect(torch.device("cpu")).kind == "cpu"


def test_auto_precision_in_a_run_follows_the_devices(make_cfg, monkeypatch, capsys):
    """A run whose (mocked) device is a V100 trains in fp16 with loss scaling, and says why."""
    monkeypatch.setattr("hetforge.cluster.facts.detect", lambda device: from_compute_capability("V100", (7, 0)))
    res = train(make_cfg("v100", steps=3, precision="auto"))
    assert "fp16 (rank 0 (V100, compute capability 7.0) has no bf16" in capsys.readouterr().out
    plan = json.loads((Path(res.run_dir) / "plan.json").read_text())
    assert plan["precision"] == "fp16" and plan["why"]["precision"].startswith("rank 0 (V100")
    state = json.loads((ckpt.resolve(res.run_dir) / "state.json").read_text())
    assert state["precision"] == "fp16"


def test_fp16_overflow_skips_the_step_halves_the_scale_and_training_goes_on(make_cfg, monkeypatch):
    real = loop.backward_share
    calls = {"n": 0}

    def overflowing(par, *args, **kw):
        out = real(par, *args, **kw)
        calls["n"] += 1
        if calls["n"] == 3:  # step 3's gradients overflow
            next(par.net.parameters()).grad[0, 0] = float("inf")
        return out

    monkeypatch.setattr(loop, "backward_share", overflowing)
    res = train(make_cfg("overflow", steps=6, precision="fp16"))
    recs = {r["step"]: r for r in read_metrics(Path(res.run_dir) / "metrics.jsonl")["train"]}
    assert recs[3]["loss_scale"] == recs[2]["loss_scale"] / 2  # halved on the overflow
    assert not torch.isfinite(torch.tensor(recs[3]["grad_norm"]))
    assert recs[4]["loss_scale"] == recs[3]["loss_scale"]
    assert all(torch.isfinite(torch.tensor(recs[s]["loss"])) for s in recs) and res.step == 6
    opt = ckpt.read_tensors(res.run_dir, "optim")
    assert all(int(s["step"]) == 5 for s in opt.values())  # 6 steps, one skipped


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_host_offload_optimizer_equals_the_device_optimizer(name):
    tc = TrainConfig(optimizer=name, lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    a = GPTNeoX(GPTNeoXConfig(2, 64, 4, 256, 128))
    b = copy.deepcopy(a)
    on_device = build_optimizer(a, tc, torch.device("cpu"))
    on_host = build_optimizer(b, tc, torch.device("cpu"), offload=True)
    assert isinstance(on_host, HostOffloadOptimizer)
    idx = torch.randint(0, 128, (4, 33))
    for step in range(5):
        for model, opt in ((a, on_device), (b, on_host)):
            for g in opt.param_groups:
                g["lr"] = 1e-2 * (step + 1) / 5
            F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    # the state dicts are interchangeable: resume with offload switched off
    c = copy.deepcopy(b)
    back = build_optimizer(c, tc, torch.device("cpu"))
    back.load_state_dict(on_host.state_dict())
    for k, st in on_device.state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], back.state_dict()["state"][k]["exp_avg"])


def test_training_with_the_optimizer_on_the_host_matches(make_cfg):
    free = train(make_cfg("device-opt", steps=5))
    cfg = make_cfg("host-opt", steps=5)
    cfg.memory.optimizer_offload = "on"
    res = train(cfg)
    assert res.losses == free.losses  # bitwise, step for step
    rank = json.loads((Path(cfg.run_dir) / "plan.json").read_text())["ranks"][0]
    assert rank["optimizer_offload"] is True and "optimizer on the host" in rank["summary"]


@pytest.mark.slow
def test_the_planner_offloads_only_where_nothing_fits_otherwise(make_cfg, tmp_path):
    from hetforge.memory.device_plan import plan_for_config
    from hetforge.memory.milp import PlanError

    cfg = make_cfg("budget")
    model_cfg = GPTNeoXConfig.from_model_config(cfg.model, 512)
    cpu = torch.device("cpu")
    cfg.memory.budget = "1GiB"
    roomy = plan_for_config(cfg, model_cfg, cpu, 4, None, tmp_path)
    assert not roomy.optimizer_offload
    static = roomy.profile.static
    # room for weights, gradients and activations, not for Adam's 8 bytes a parameter
    cfg.memory.budget = str(int(static["weights"] + static["gradients"] + roomy.keep_all.activation_peak))
    tight = plan_for_config(cfg, model_cfg, cpu, 4, None, tmp_path)
    assert tight.optimizer_offload and tight.offload_s > 0
    assert tight.prediction.peak_bytes <= float(cfg.memory.budget)
    cfg.memory.optimizer_offload = "off"
    with pytest.raises(PlanError, match="optimizer_offload"):
        plan_for_config(cfg, model_cfg, cpu, 4, None, tmp_path)


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step(tmp_path):
    """bench/gpu_check.sh --dry-run: the GPU check's every step, on the CPU with tiny sizes."""
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--dry-run"], cwd=root,
                         env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    assert {r["preset"] for r in out["throughput"]} == {"tiny", "small"}
    assert {r["precision"] for r in out["throughput"]} == {"bf16", "fp16"}
    assert sorted((r["preset"], r["precision"]) for r in out["throughput"] if r["compiled"]) == [
        ("small", "bf16"), ("tiny", "bf16")]
    assert all(r["tokens_per_s"] > 0 for r in out["throughput"])
    assert [r["budget_fraction"] for r in out["plans"]] == [1.0, 0.6, 0.35]
    assert all(abs(r["activation_peak_ratio"] - 1) < 0.1 for r in out["plans"])
    assert out["offload_gradients"]["max_abs_diff"] <= 1e-6
    assert abs(out["analytic_vs_measured"]["activation_peak_ratio"] - 1) < 0.25
    assert out["precision_losses"]["relative_difference"] < 0.02
    assert (out["head_padding"]["unpadded"]["head_dim"], out["head_padding"]["padded"]["head_dim"]) == (15, 16)
    assert out["head_padding"]["speedup"] > 0 and 0 < out["rank_timer"]["median_ratio"] <= 1.0
    pipe = out["pipeline_smoke"]  # two chunks on one rank give one plain forward and backward's gradients
    assert pipe["virtual_stages"] == 2 and pipe["loss_rel_diff"] <= 1e-6 and pipe["grad_max_rel_diff"] <= 1e-5
    assert (tmp_path / "gpu_check.log").stat().st_size > 0
    assert json.loads(res.stdout.strip().splitlines()[-1])["bench"] == "gpu_check"


def test_attention_kernel_per_card():
    from hetforge.core.hardware import lookup, sdpa_backend

    assert sdpa_backend(lookup("A100-80GB"), "bf16", 64) == "flash"
    assert sdpa_backend(lookup("V100"), "fp16", 64) == "mem-efficient"  # no flash before 8.0
    assert sdpa_backend(lookup("GTX 1080 Ti"), "fp32", 64) == "mem-efficient"
    assert sdpa_backend(lookup("H100"), "bf16", 86) == "math"  # FORGE-s's head size: not a multiple of 8
    assert sdpa_backend(lookup("A100-80GB"), "fp32", 64) == "mem-efficient"  # flash is 16-bit only
    assert sdpa_backend(lookup("MI250X"), "bf16", 128) == "flash"


@pytest.mark.slow
@pytest.mark.measure
def test_fp32_matmul_keeps_16bit_dtypes_results_and_saved_bytes():
    """The analytic proxy's fp32 tiles (this CPU's bf16 matmul is ~300x slower): same dtype and,
    within bf16 rounding, same result as the 16-bit op, for shapes that are not tile multiples, and
    a profile whose saved bytes and head peak are those of the native 16-bit run."""
    from hetforge.memory.profile import Fp32Matmul, profile_model

    torch.manual_seed(0)
    a, b = torch.randn(300, 70), torch.randn(70, 513)
    bias, col = torch.randn(513), torch.randn(300, 1)
    for dt in (torch.bfloat16, torch.float16):
        x, y = a.to(dt), b.to(dt)
        with Fp32Matmul():
            got = [x @ y, torch.addmm(bias.to(dt), x, y), torch.addmm(col.to(dt), x, y, beta=0.5, alpha=2.0)]
        xf, yf = x.float(), y.float()  # the 16-bit inputs, exactly
        want = [xf @ yf, bias.to(dt).float() + xf @ yf, 0.5 * col.to(dt).float() + 2.0 * (xf @ yf)]
        for g, w in zip(got, want):
            assert g.dtype == dt and g.shape == w.shape
            torch.testing.assert_close(g.float(), w.to(dt).float(), rtol=1e-2, atol=1e-2)
    with Fp32Matmul():  # fp32 passes through untouched
        assert torch.equal(a @ b, torch.mm(a, b))

    cfg = GPTNeoXConfig(n_layers=1, d_model=64, n_heads=4, d_ff=256, vocab_size=512)
    native = profile_model(cfg, 2, 64, "bf16", "cpu", 16e9, repeats=1)
    tiled = profile_model(cfg, 2, 64, "bf16", "cpu", 16e9, repeats=1, fp32_matmul=True)
    # What autograd saves is a matter of dtypes and shapes: exactly the same on either path.
    assert [(u.name, u.bytes, u.host_bytes) for u in tiled.blocks[0].units] == \
        [(u.name, u.bytes, u.host_bytes) for u in native.blocks[0].units]
    assert tiled.head_held == native.head_held
    # Peaks are one-sided: a native 16-bit matmul may allocate scratch buffers of its own (oneDNN's
    # on AVX-512 CPUs come from the same allocator the meter reads), the tiles never add any, and
    # no peak is below what the block holds.
    held = tiled.blocks[0].cost("keep").held
    assert tiled.head_peak <= native.head_peak * 1.02
    for mode, peaks in native.blocks[0].peaks.items():  # no fp32 copies counted in the peaks
        for t, n in zip(tiled.blocks[0].peaks[mode], peaks):
            assert 0 < t <= n * 1.02
    assert tiled.blocks[0].peaks["keep/keep"][0] >= held  # the forward keeping all holds all it saves


def test_plan_for_a_card_that_is_not_here(make_cfg, tmp_path, capsys):
    import yaml

    from hetforge.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(make_cfg("card").model_dump(mode="json")))
    assert main(["plan", str(path), "--card", "V100", "--micro-batch", "2", "--budget", "auto", "--out",
                 str(tmp_path / "p"), "--set", "train.precision=auto"]) == 0
    out = capsys.readouterr().out
    assert "V100" in out and "fp16" in out and "mem-efficient" in out and "decision per block" in out
    rank = json.loads((tmp_path / "p" / "plan.json").read_text())["ranks"][0]
    assert rank["memory_bytes"] < 16 * 2**30 and rank["attention"] == "mem-efficient"
    assert rank["predicted_peak_bytes"] <= rank["memory_bytes"]
    assert main(["plan", str(path), "--card", "Z9000", "--out", str(tmp_path / "p")]) == 2
    assert "not in the device table" in capsys.readouterr().err
