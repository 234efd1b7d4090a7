"""The GPU check, all in one run (`bench/gpu_check.sh`): what a lent GPU must show, written to $OUT.

1. the device: name, compute capability, memory; the dense-matmul peak measured per precision;
2. training throughput of the 125M-class and forge-s (1.44B) presets at seq 2048 in bf16 and fp16,
   and bf16 with `train.compile: on`, a few steps each (the compile's cold start is in the dropped
   first intervals): tokens/s, TFLOP/s, MFU against the measured peak of that precision;
3. memory plans at three budgets (100%, 60% and 35% of keep-all's activation memory) for the 125M
   model: predicted against measured (`torch.cuda.max_memory_allocated`) activation peak and step
   time, from the training loop's own check; and the analytic model of this card (what the legacy
   table is made from) against the profile measured on it;
4. offload plans give keep-all's gradients (fp32, every option and mixed per-tensor decisions);
5. FORGE-s attention (head size 86) padded to 88 against as is: forward + backward time and peak;
6. the loop's per-rank compute timer (CUDA events, read without a sync) against a synchronised
   wall clock;
7. fp16 with loss scaling against bf16: the loss after the same steps;
8. a pipeline on the card: one rank running the model as two chunks (the interleaved schedule's
   machinery, on `torch.distributed.pipelining`), its loss and gradients against one plain
   forward and backward.

`--dry-run` runs the same steps on the CPU with tiny sizes, so the script is known to work before a
GPU is lent. Last line: one JSON object with the figures (also in $OUT/results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.core.hardware import detect  # noqa: E402
from hetforge.config import build_config  # noqa: E402
from hetforge.memory.executor import apply_plan  # noqa: E402
from hetforge.core.hardware import lookup  # noqa: E402
from hetforge.memory.analytic import analytic_profile  # noqa: E402
from hetforge.memory.milp import menu_for, minimum_budget  # noqa: E402
from hetforge.memory.plan import OPTIONS, Plan, simulate  # noqa: E402
from hetforge.memory.profile import profile_model  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig  # noqa: E402
from hetforge.scaling.flops import measure_matmul_peak  # noqa: E402
from hetforge.train.loop import train  # noqa: E402
from hetforge.core.metrics import read_metrics  # noqa: E402

GPU = {
    "throughput": [("125m", 8, 20), ("forge-s", 4, 20)],  # preset, micro-batch, steps
    "seq": 2048, "vocab": 50304, "tokens": 8192, "plan_model": ("125m", 8), "plan_steps": 5,
    "precision_steps": 200, "precision_model": ("125m", 8),
    "padding_shape": (2064, 24, 4, 2048), "padding_repeats": 5,  # FORGE-s: head size 86
    "pipeline_model": ("125m", 2),
}
ANALYTIC: dict = {}

DRY = {  # the CPU has no fast fp16: its steps are few
    "throughput": [("tiny", 4, 6), ("small", 2, 3)],
    "seq": 64, "vocab": None, "tokens": 512, "plan_model": ("tiny", 2), "plan_steps": 5,
    "precision_steps": 8, "precision_model": ("tiny", 2),
    "padding_shape": (60, 4, 2, 64), "padding_repeats": 2,  # head size 15
    "pipeline_model": ("tiny", 2),
}


def raw_config(out: Path, name: str, preset: str, micro: int, steps: int, spec: dict, precision: str,
               device: str) -> dict:
    """A run of `preset` as the spec has it: its sequence, vocabulary and tokenizer (the dry run's
    tokenizer is small: it trains in seconds)."""
    seq, vocab, tokens = spec["seq"], spec["vocab"], spec["tokens"]
    model = {"preset": preset}
    if vocab:
        model["vocab_size"] = vocab
    return {
        "name": name, "run_dir": str(out / "runs" / name),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(out / "data" / f"aclsum-{tokens}"),
                 "tokenizer": {"vocab_size": tokens}},
        "model": model,
        "train": {"steps": steps, "seq_len": seq, "micro_batch_size": micro, "warmup_steps": 1,
                  "log_interval": 1, "eval_interval": 10**6, "final_eval_batches": 1, "precision": precision,
                  "device": device, "tensorboard": False, "progress": False, "save_checkpoints": False},
    }


def throughput(out: Path, spec: dict, device: str, peaks: dict) -> list[dict]:
    rows = []
    for preset, micro, steps in spec["throughput"]:
        for precision, compiled in (("bf16", False), ("fp16", False), ("bf16", True)):
            name = f"{preset}-{precision}{'-compiled' if compiled else ''}"
            raw = raw_config(out, name, preset, micro, steps, spec, precision, device)
            raw["train"]["compile"] = "on" if compiled else "off"
            # a low precision without a fast path (fp16 on a CPU) is held to fp32's peak, not its own
            peak = max(peaks[precision], peaks["fp32"])
            raw["train"]["peak_tflops"] = peak / 1e12
            res = train(build_config(raw), resume="never")
            recs = read_metrics(Path(raw["run_dir"]) / "metrics.jsonl")["train"][2:] or \
                read_metrics(Path(raw["run_dir"]) / "metrics.jsonl")["train"]
            tok_s = statistics.median(r["tokens_per_s"] for r in recs)
            fpt = res.extra["flops_per_token"]
            rows.append({"preset": preset, "precision": precision, "compiled": compiled,
                         "micro_batch": micro, "seq": spec["seq"],
                         "params": res.extra["params"], "tokens_per_s": tok_s, "tflops": fpt * tok_s / 1e12,
                         "mfu": fpt * tok_s / peak, "final_loss": res.losses[max(res.losses)]})
            print(f"throughput {name}: {tok_s:,.0f} tok/s, {fpt * tok_s / 1e12:.2f} TFLOP/s, "
                  f"MFU {fpt * tok_s / peak:.1%}", flush=True)
    return rows


def plans(out: Path, spec: dict, device: str, precision: str) -> list[dict]:
    preset, micro = spec["plan_model"]
    raw = raw_config(out, "plan-keep", preset, micro, spec["plan_steps"], spec, precision,
                     device)
    raw["train"]["peak_tflops"] = 1.0  # MFU is not what this step measures
    cfg = build_config(raw)
    model_cfg = GPTNeoXConfig.from_model_config(cfg.model, cfg.model.vocab_size or 8192)
    prof = profile_model(model_cfg, micro, spec["seq"], precision, device, cache_dir=out / "profiles")
    keep = simulate(prof, Plan(["keep"] * model_cfg.n_layers))
    # the analytic model (what docs/legacy_gpus.md is made from) against this measured profile
    card = lookup(torch.cuda.get_device_name() if device == "cuda" else "H200")
    if card is not None:
        est = analytic_profile(model_cfg, micro, spec["seq"], card)
        est_keep = simulate(est, Plan(["keep"] * model_cfg.n_layers))
        ANALYTIC.update({"card": card.name, "activation_peak_ratio": est_keep.activation_peak / keep.activation_peak,
                         "held_ratio": est_keep.held_bytes / keep.held_bytes})
        print(f"analytic model for {card.name}: keep-all activation peak {ANALYTIC['activation_peak_ratio']:.3f}x the "
              f"measured profile's, held {ANALYTIC['held_ratio']:.3f}x", flush=True)
    lowest = minimum_budget(prof, menu_for("tensor"))
    rows = []
    for frac in (1.0, 0.6, 0.35):  # or the feasible minimum where that is higher (the logits can set it)
        budget = max(prof.base_bytes + frac * (keep.peak_bytes - prof.base_bytes), lowest)
        raw = raw_config(out, f"plan-{frac}", preset, micro, spec["plan_steps"], spec,
                         precision, device)
        raw["memory"] = {"budget": str(int(budget))}
        raw["train"]["peak_tflops"] = 1.0
        train(build_config(raw), resume="never")
        ev = [e for e in read_metrics(Path(raw["run_dir"]) / "metrics.jsonl").get("event", [])
              if e["event"] == "memory_plan_check"]
        row = {"budget_fraction": frac, "budget_bytes": budget, **(ev[0] if ev else {"error": "no check recorded"})}
        rows.append(row)
        if ev:
            print(f"plan at {frac:.0%}: activation peak predicted {ev[0]['predicted_activation_peak_bytes'] / 2**20:,.1f} "
                  f"MiB, measured {ev[0]['measured_activation_peak_bytes'] / 2**20:,.1f} MiB "
                  f"({ev[0]['activation_peak_ratio']:.3f}x); step {ev[0]['predicted_step_s'] * 1e3:.1f} ms predicted, "
                  f"{ev[0]['measured_step_s'] * 1e3:.1f} ms measured", flush=True)
    return rows


def offload_gradients(device: str) -> dict:
    """Keep-all's gradients against every option and some per-tensor decisions, fp32."""
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(n_layers=3, d_model=128, n_heads=4, d_ff=512, vocab_size=512)
    model = GPTNeoX(cfg).to(device)
    idx = torch.randint(0, 512, (2, 129), device=device)

    def grads():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    mixed = ["attn:keep-offload[core,merged] | mlp:recompute-cache[up] | offload[x]",
             "attn:recompute-cache[qkv,sdpa] | mlp:keep-offload[hidden]"]
    worst = 0.0
    for o in list(OPTIONS) + mixed:
        apply_plan(model, Plan([o] * cfg.n_layers))
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(grads(), ref)))
    apply_plan(model, None)
    print(f"offload / recompute plans: max gradient difference to keep-all {worst:.2e}", flush=True)
    return {"max_abs_diff": worst, "plans": len(OPTIONS) + len(mixed)}


def precisions(out: Path, spec: dict, device: str, peaks: dict) -> dict:
    preset, micro = spec["precision_model"]
    final = {}
    for precision in ("bf16", "fp16"):
        raw = raw_config(out, f"loss-{precision}", preset, micro, spec["precision_steps"], spec,
                         precision, device)
        raw["train"]["log_interval"] = max(1, spec["precision_steps"] // 20)
        raw["train"]["peak_tflops"] = max(peaks[precision], peaks["fp32"]) / 1e12
        res = train(build_config(raw), resume="never")
        last = sorted(res.losses)[-5:]
        final[precision] = sum(res.losses[s] for s in last) / len(last)
    rel = abs(final["fp16"] / final["bf16"] - 1)
    print(f"loss after {spec['precision_steps']} steps: bf16 {final['bf16']:.4f}, fp16 {final['fp16']:.4f} "
          f"({rel:.2%} apart)", flush=True)
    return {**final, "relative_difference": rel, "steps": spec["precision_steps"]}


def _timed(fn, device: str, repeats: int) -> tuple[float, float | None]:
    """(median seconds of fn(), peak bytes allocated during one call or None on a CPU)."""
    fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def head_padding(spec: dict, device: str) -> dict:
    """FORGE-s attention (head size 86) forward + backward at its padded size 88 against as is."""
    from hetforge.model.gpt_neox import Attention, RotaryEmbedding

    d, heads, micro, seq = spec["padding_shape"]
    cfg = GPTNeoXConfig(n_layers=1, d_model=d, n_heads=heads, d_ff=4 * d, vocab_size=8)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attn = Attention(cfg).to(device, dtype)
    cos, sin = RotaryEmbedding(cfg.rotary_dims, cfg.rotary_base).cos_sin(seq, torch.device(device))
    x = torch.randn(micro, seq, d, device=device, dtype=dtype, requires_grad=True)
    rows = {}
    for name, padded in (("unpadded", cfg.head_dim), ("padded", -(-cfg.head_dim // 8) * 8)):
        attn.padded_head_dim = padded

        def step():
            attn(x, cos, sin).float().square().mean().backward()

        seconds, peak = _timed(step, device, spec["padding_repeats"])
        rows[name] = {"head_dim": padded, "seconds": seconds, "peak_bytes": peak}
    speedup = rows["unpadded"]["seconds"] / rows["padded"]["seconds"]
    print(f"head padding {cfg.head_dim} -> {rows['padded']['head_dim']} (d={d}, {heads} heads, {micro}x{seq}): "
          f"{speedup:.2f}x faster, peak {rows['padded']['peak_bytes']} vs {rows['unpadded']['peak_bytes']} B", flush=True)
    return {**rows, "speedup": speedup}


def rank_timer(spec: dict, device: str) -> dict:
    """The loop's per-rank timer (CUDA events on a GPU) against a synchronised wall clock."""
    from hetforge.train.parallel import ComputeTimer

    preset, micro = spec["plan_model"]
    from hetforge.model.presets import PRESETS

    shape = PRESETS[preset] if preset in PRESETS else GPTNeoXConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256,
                                                                        vocab_size=512)
    cfg = GPTNeoXConfig(**{**shape.to_dict(), "vocab_size": spec["vocab"] or 8192})
    model = GPTNeoX(cfg).to(device)
    idx = torch.randint(0, cfg.vocab_size, (micro, spec["seq"] + 1), device=device)
    timer = ComputeTimer(torch.device(device))
    ratios = []
    for i in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        timer.start()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.cross_entropy(model(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        timer.stop(synced=False)
        measured = timer.step_seconds(wait=True)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        if i:  # the first step warms up
            ratios.append(measured / wall)
    print(f"per-rank timer / synchronised wall clock: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)
    return {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios)}


def fsdp_memory(spec: dict, device: str) -> dict:
    """FSDP2 on this one device (a world of one: one GPU cannot hold two NCCL ranks): the model is
    built on the meta device, sharded as a run shards it, and one bf16 step runs; its measured
    peak against the planner's static bytes for the layout (`sharded_static_bytes`) plus the
    activations the probe counts. Multi-rank shard sizes are tested on CPU ranks (tests/test_sharded.py)."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hetforge.memory.analytic import activation_bytes_per_sample
    from hetforge.model.accounting import sharded_static_bytes
    from hetforge.model.presets import PRESETS
    from hetforge.train.optim import build_optimizer
    from hetforge.train.parallel import init_sharded, local_state_bytes, shard_model
    from hetforge.config import TrainConfig

    preset, micro = spec["plan_model"]
    shape = PRESETS[preset] if preset in PRESETS else GPTNeoXConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256,
                                                                        vocab_size=512)
    cfg = GPTNeoXConfig(**{**shape.to_dict(), "vocab_size": spec["vocab"] or 8192})
    store = tempfile.mktemp(prefix="hetforge-fsdp-store-")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,), mesh_dim_names=("shard",))
        with torch.device("meta"):
            model = GPTNeoX(cfg)
        dtype = torch.bfloat16
        shard_model(model, mesh, "fsdp", None, "none", dtype if device == "cuda" else None)
        init_sharded(model, torch.device(device), 0)
        opt = build_optimizer(model, TrainConfig(), torch.device(device))
        act = activation_bytes_per_sample(cfg, spec["seq"], "bf16" if device == "cuda" else "fp32") * micro
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        idx = torch.randint(0, cfg.vocab_size, (micro, spec["seq"] + 1), device=device)
        with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
            loss = F.cross_entropy(model(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        held = local_state_bytes(model, opt)
        static = sharded_static_bytes(cfg, "adamw", "fsdp", 1, gather_bytes=2 if device == "cuda" else 4)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        predicted = sum(static.values()) + act
        out = {"model": preset, "micro_batch": micro, "held": held, "predicted_static": static,
               "activation_bytes": act, "measured_peak": peak, "predicted_peak": predicted,
               "peak_ratio": peak / predicted if peak else None,
               "state_ratio": sum(held.values()) / (static["weights"] + static["gradients"] + static["optimizer state"])}
        print(f"FSDP2 (world 1) {preset} micro {micro}: state held / predicted {out['state_ratio']:.3f}, peak "
              f"{(peak or 0) / 2**30:.2f} GiB / predicted {predicted / 2**30:.2f} GiB", flush=True)
        return out
    finally:
        dist.destroy_process_group()


def pipeline_smoke(spec: dict, device: str) -> dict:
    """hetforge's pipeline on this device: a world of one (one GPU holds one NCCL rank) running the
    model as two virtual stages under `ScheduleInterleaved1F1B`, so stage modules, the schedule's
    micro-batch cuts, the loss over global tokens and the backward all run on the card; its loss
    and gradients against one plain forward and backward of the same model (fp32: TF32 off).
    Multi-rank pipelines are tested on CPU ranks (tests/test_pipeline.py)."""
    import copy
    import tempfile

    import torch.distributed as dist

    from hetforge.cluster.pipeline_plan import PipelinePlan
    from hetforge.model.presets import PRESETS
    from hetforge.train.pipeline import build_pipeline, stage_parts
    from hetforge.train.step import TokenLoss

    preset, micro = spec["pipeline_model"]
    cfg = GPTNeoXConfig(n_layers=4, d_model=64, n_heads=4, d_ff=256, vocab_size=512, tie_embeddings=False) \
        if preset == "tiny" else GPTNeoXConfig(**{**PRESETS[preset].to_dict(), "n_layers": 4,
                                                    "vocab_size": spec["vocab"], "tie_embeddings": False})
    store = tempfile.mktemp(prefix="hetforge-pipe-store-")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        dev = torch.device(device)
        model = GPTNeoX.build(cfg, dev, 0)
        reference = copy.deepcopy(model)
        n = 4
        plan = PipelinePlan(1, 1, [cfg.n_layers], micro, [n], ["interleaved"], [1.0], [0.0], "gpu smoke", virtual=2)
        pipe = build_pipeline(plan, 0, stage_parts(plan, 0, model, dev, None), dev, TokenLoss())
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, cfg.vocab_size, (n * micro, spec["seq"] + 1), generator=gen).to(dev)
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = float(pipe.run(x, y, 1.0, y.numel()))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        want = F.cross_entropy(reference(x).float().flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
        want.backward()
        want = want.detach()
        ours = dict(model.named_parameters())
        worst = max(float((ours[k].grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
                    for k, p in reference.named_parameters())
        out = {"model": preset, "layers": cfg.n_layers, "virtual_stages": 2, "micro_batches": n, "loss": loss,
               "reference_loss": float(want), "loss_rel_diff": abs(loss - float(want)) / abs(float(want)),
               "grad_max_rel_diff": worst, "seconds": seconds}
        print(f"pipeline (1 rank, 2 chunks, {n} micro-batches) {preset}: loss {loss:.5f} vs {float(want):.5f}, "
              f"gradients within {worst:.1e} (relative to each tensor's largest)", flush=True)
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny sizes")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device visible: run with --dry-run to check the script on the CPU")
    device = "cpu" if args.dry_run else "cuda"
    spec = DRY if args.dry_run else GPU
    t0 = time.perf_counter()
    cap = detect(torch.device(device))
    results: dict = {"bench": "gpu_check", "dry_run": args.dry_run, "torch": torch.__version__, "device": cap.to_dict()}
    print(f"device: {cap.describe()}, torch {torch.__version__}", flush=True)
    size = 256 if args.dry_run else None  # fp16 matmuls on a CPU crawl: a small one tells as much
    peaks = {p: measure_matmul_peak(device, dt, size=size) for p, dt in
             (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    results["matmul_peak_tflops"] = {k: v / 1e12 for k, v in peaks.items()}
    print("matmul peak TFLOP/s: " + ", ".join(f"{k} {v / 1e12:.1f}" for k, v in peaks.items()), flush=True)
    phases = {}
    for key, run in (("throughput", lambda: throughput(out, spec, device, peaks)),
                     ("plans", lambda: plans(out, spec, device, "bf16")),
                     ("offload_gradients", lambda: offload_gradients(device)),
                     ("head_padding", lambda: head_padding(spec, device)),
                     ("rank_timer", lambda: rank_timer(spec, device)),
                     ("fsdp_memory", lambda: fsdp_memory(spec, device)),
                     ("pipeline_smoke", lambda: pipeline_smoke(spec, device)),
                     ("precision_losses", lambda: precisions(out, spec, device, peaks))):
        t = time.perf_counter()
        results[key] = run()
        phases[key] = time.perf_counter() - t
    results["phase_seconds"] = phases
    results["analytic_vs_measured"] = ANALYTIC
    results["seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1))
    forge = [r for r in results["throughput"] if r["preset"] == "forge-s" and r["precision"] == "bf16"
             and not r["compiled"]]
    forge_c = [r for r in results["throughput"] if r["preset"] == "forge-s" and r["compiled"]]
    record({"bench": "gpu_check", "dry_run": args.dry_run, "seconds": round(results["seconds"], 1),
                      "forge_s_bf16_mfu": round(forge[0]["mfu"], 4) if forge else None,
                      "forge_s_bf16_compiled_mfu": round(forge_c[0]["mfu"], 4) if forge_c else None,
                      "forge_s_compiled_vs_eager": round(forge_c[0]["tokens_per_s"] / forge[0]["tokens_per_s"], 3)
                      if forge and forge_c else None,
                      "plan_peak_ratios": [round(r.get("activation_peak_ratio", float("nan")), 4) for r in results["plans"]],
                      "offload_grad_max_diff": results["offload_gradients"]["max_abs_diff"],
                      "forge_s_padding_speedup": round(results["head_padding"]["speedup"], 3),
                      "rank_timer_vs_wall": round(results["rank_timer"]["median_ratio"], 3),
                      "fsdp_state_vs_plan": round(results["fsdp_memory"]["state_ratio"], 3),
                      "fsdp_peak_vs_plan": round(results["fsdp_memory"]["peak_ratio"], 3)
                      if results["fsdp_memory"]["peak_ratio"] else None,
                      "fp16_vs_bf16": round(results["precision_losses"]["relative_difference"], 4),
                      "pipeline_grad_rel_diff": float(f"{results['pipeline_smoke']['grad_max_rel_diff']:.3g}")},
           save=not args.dry_run)


if __name__ == "__main__":
    main()
