"""Scaling laws, sizing, FLOPs and run accounting."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from scipy.optimize import minimize_scalar

from hetforge.cli import main
from hetforge.core.hardware import choose_precision, lookup
from hetforge.scaling.fit import fit_law
from hetforge.model.accounting import flops_per_token, matmul_params
from hetforge.model.gpt_neox import GPTNeoXConfig
from hetforge.scaling.laws import EPOCH, LossLaw, shape_for
from hetforge.scaling.sizing import cluster_rate, recommend


@pytest.mark.parametrize("compute", [1e18, 1e19, 1e20, 1e21])
def test_epoch_constants_give_chinchilla_token_ratios(compute):
    n, d = EPOCH.optimal_params(compute), EPOCH.optimal_tokens(compute)
    assert 6 * n * d == pytest.approx(compute, rel=1e-9)
    assert 20 <= d / n <= 26
    # the closed form is the minimum of L along C = 6ND
    res = minimize_scalar(lambda logn: EPOCH.loss(math.exp(logn), compute / (6 * math.exp(logn))),
                          bounds=(10, 40), method="bounded", options={"xatol": 1e-10})
    assert math.exp(res.x) == pytest.approx(n, rel=1e-4)


def test_hand_computed_values():
    # G = (alpha A / (beta B))^(1/(alpha+beta)) with the Epoch constants, by hand: 0.11963
    g = (0.3478 * 482.01 / (0.3658 * 2085.43)) ** (1 / (0.3478 + 0.3658))
    assert g == pytest.approx(0.11963, rel=1e-4)
    assert EPOCH.optimal_params(6e20) == pytest.approx(g * 1e20 ** (0.3658 / 0.7136), rel=1e-12)
    # a 70B model on 1.4T tokens (Chinchilla itself), by hand: 70e9^0.3478 = e^(24.972 x 0.3478) = 5924,
    # 1.4e12^0.3658 = e^(27.967 x 0.3658) = 27773; 1.8172 + 482.01/5924 + 2085.43/27773 = 1.9738
    assert EPOCH.loss(70e9, 1.4e12) == pytest.approx(1.9738, abs=2e-4)


def test_tokens_mode_inverts_the_optimum():
    for tokens in (1e9, 3e10, 1e12):
        n = EPOCH.params_for_tokens(tokens)
        assert EPOCH.optimal_tokens(6 * n * tokens) == pytest.approx(tokens, rel=1e-9)


def test_recommendation_shape_and_neighbours():
    best, rows = recommend(EPOCH, 52000, 2048, compute=1e20)
    assert matmul_params(best.shape) == pytest.approx(EPOCH.optimal_params(1e20), rel=0.10)
    assert 40 <= best.shape.d_model / best.shape.n_layers <= 130
    assert best.shape.d_model % best.shape.n_heads == 0
    assert [r.params for r in rows] == sorted(r.params for r in rows)
    assert best.loss == min(r.loss for r in rows)  # the optimum is the best of its neighbours
    assert best.preset == "forge-s"
    # FLOPs include the attention term
    s = best.shape
    assert best.flops == pytest.approx(best.tokens * (6 * best.params + 12 * s.n_layers * s.d_model * 2048))


@pytest.mark.parametrize("target,vocab", [(1e6, 512), (1e8, 32000), (1.4e9, 52000), (2e10, 52000)])
def test_shapes_hit_their_target(target, vocab):
    s = shape_for(target, vocab)
    assert matmul_params(s) == pytest.approx(target, rel=0.12)


def test_device_table_and_precision():
    assert lookup("Tesla V100-SXM2-32GB").name == "V100-32GB"
    assert lookup("NVIDIA GeForce RTX 3090").name == "RTX 3090"
    assert lookup("cpu") is None
    v100, a100, p1080 = lookup("V100"), lookup("A100-80GB"), lookup("GTX 1080 Ti")
    assert choose_precision([a100]) == "bf16"
    assert choose_precision([a100, v100]) == "fp16"  # one device without bf16 sets it for all
    assert choose_precision([a100, p1080]) == "fp32"  # consumer Pascal's fp16 runs at 1/64 rate
    rate = cluster_rate([("V100", 32, 8), ("A100-80GB", None, 4)], mfu=0.5)
    assert rate.precision == "fp16"
    assert rate.flops_per_s == pytest.approx(0.5 * (8 * 125e12 + 4 * 312e12))
    assert rate.power_w == 8 * 300 + 4 * 400


@pytest.mark.slow
def test_fit_recovers_known_constants():
    true = LossLaw(2.0, 400.0, 1500.0, 0.34, 0.28)
    grid = [(n, d) for n in np.logspace(7, 9, 5) for d in np.logspace(8, 10.5, 5)]
    exact = fit_law([n for n, _ in grid], [d for _, d in grid], [true.loss(n, d) for n, d in grid])
    for k in ("E", "A", "B", "alpha", "beta"):
        assert getattr(exact.law, k) == pytest.approx(getattr(true, k), rel=1e-4), k
    rng = np.random.default_rng(0)
    noisy = [true.loss(n, d) * math.exp(rng.normal(0, 0.005)) for n, d in grid]
    fit = fit_law([n for n, _ in grid], [d for _, d in grid], noisy, bootstrap=60)
    assert fit.law.E == pytest.approx(2.0, rel=0.05)
    assert fit.law.beta == pytest.approx(0.28, abs=0.02)
    assert fit.law.alpha == pytest.approx(0.34, abs=0.06)
    for k in ("E", "alpha", "beta"):  # the intervals are honest about the noise
        lo, hi = fit.interval(k)
        assert lo <= getattr(true, k) <= hi, (k, lo, hi)
    with pytest.raises(ValueError, match="at least 5 runs"):
        fit_law([1e6] * 3, [1e8] * 3, [3.0] * 3)


def test_flops_per_token_matches_counted_matmuls():
    """PyTorch's FLOP counter over one training step of the real model (with its own SDPA formulas
    for the CPU attention kernel, which it does not map by default) equals 6N + 12 L d s, plus the
    2 L d s of the attention scores that a flash backward recomputes (hardware, not model, FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig

    def fwd(q, k, v, *args, out_shape=None, **kw):
        return sdpa_flop_count(q, k, v)

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kw):
        return sdpa_backward_flop_count(grad_out, q, k, v)

    cfg = GPTNeoXConfig(n_layers=3, d_model=64, n_heads=4, d_ff=256, vocab_size=128)
    model, (b, s) = GPTNeoX(cfg), (2, 32)
    idx = torch.randint(0, 128, (b, s + 1))
    ops = torch.ops.aten
    mapping = {ops._scaled_dot_product_flash_attention_for_cpu: fwd,
               ops._scaled_dot_product_flash_attention_for_cpu_backward: bwd}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    linear = (counts["aten.mm"] + counts["aten.addmm"]) / (b * s)
    assert linear == 6 * matmul_params(cfg)  # every weight: 2 forward + 4 backward FLOPs
    assert counter.get_total_flops() / (b * s) == flops_per_token(cfg, s) + 2 * 3 * 64 * s
    assert matmul_params(cfg) == 3 * (4 * 64 * 64 + 2 * 64 * 256) + 128 * 64


def test_size_command(tmp_path, capsys):
    assert main(["size", "--compute", "1e20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = next(o for o in out["options"] if o["optimal"])
    assert 20 <= best["tokens"] / best["params"] <= 26 and out["preset"] == "forge-s"
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": [{"devices": [{"type": "V100", "count": 8, "memory_gb": 32}]}]}))
    assert main(["size", "--gpu-hours", "800", "--cluster", str(cluster), "--mfu", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compute"] == pytest.approx(800 * 3600 * 125e12 * 0.5)
    best = next(o for o in out["options"] if o["optimal"])
    assert best["wall_s"] == pytest.approx(best["flops"] / (8 * 125e12 * 0.5))
    assert best["energy_j"] == pytest.approx(best["wall_s"] * 8 * 300)
    assert main(["size", "--tokens", "30e9"]) == 0
    assert "30.00B tokens" in capsys.readouterr().out
    assert main(["size", "--gpu-hours", "10"]) == 2
    assert "needs --cluster" in capsys.readouterr().err
    assert main(["size", "--compute", "1e20", "--device", "V100", "--precision", "bf16"]) == 2
    assert "no bf16" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_fit_and_report(make_cfg, tmp_path, capsys):
    """A grid of 3 sizes x 3 token budgets on the CPU, fitted; a held-out run is predicted within
    5%; each run reports its FLOPs, tokens, utilisation, time and (declared) energy."""
    cfg = make_cfg("sweep", micro_batch_size=8, seq_len=64, final_eval_batches=16, log_interval=20)
    raw = cfg.model_dump(mode="json")
    raw["cluster"] = {"nodes": [{"devices": [{"type": "cpu", "power_w": 65.0}]}]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs"
    args = ["scale", "sweep", str(path), "--out", str(out)]
    assert main(args + ["--sizes", "1x32,2x64,3x96", "--tokens", "32k,96k,192k", "--eval-tasks", "sci_mc,arc_easy",
                        "--eval-limit", "16"]) == 0
    assert main(args + ["--sizes", "2x64", "--tokens", "64k"]) == 0
    capsys.readouterr()
    assert main(["scale", "fit", str(out), "--holdout", "L2-d64-T64k", "--bootstrap", "20"]) == 0
    text = capsys.readouterr().out
    assert "held out L2-d64-T64k" in text
    saved = json.loads((out / "scaling_law.json").read_text())
    assert len(saved["data"]) == 9
    held = saved["holdout"][0]
    assert abs(held["error"]) < 0.05
    assert (out / "scaling_law.png").stat().st_size > 10000
    # downstream accuracy against compute, beside the fit, for the runs that scored tasks
    scored = [r for r in saved["data"] if "tasks" in r]
    assert len(scored) == 9 and all(set(r["tasks"]) == {"sci_mc", "arc_easy"} for r in scored)
    assert all(r["tasks"]["arc_easy"]["n"] == 16 and r["tasks"]["arc_easy"]["chance"] == 0.25 for r in scored)
    assert "downstream accuracy" in text and (out / "downstream.png").stat().st_size > 10000
    assert main(["size", "--compute", "1e12", "--law", str(out / "scaling_law.json"), "--vocab", "512",
                 "--seq", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["law"]["E"] == pytest.approx(saved["law"]["E"])
    # the report of one run
    assert main(["report", str(out / "L2-d64-T96k"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    shape = GPTNeoXConfig(n_layers=2, d_model=64, n_heads=2, d_ff=256, vocab_size=512)
    assert rep["tokens"] == 96256 and rep["matmul_params"] == matmul_params(shape)
    assert rep["model_flops"] == pytest.approx(rep["tokens"] * flops_per_token(shape, 64))
    assert rep["tokens_per_param"] == pytest.approx(96256 / rep["matmul_params"])
    assert 0 < rep["mfu"] <= 1 and rep["wall_s"] > 0
    assert rep["energy_j"] == pytest.approx(65.0 * rep["wall_s"])
    assert (out / "L2-d64-T96k" / "report.json").exists()
    assert main(["scale", "fit", str(out), "--holdout", "nope"]) == 2
    assert main(["report", str(tmp_path)]) == 2
