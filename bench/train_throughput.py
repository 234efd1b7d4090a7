"""Training throughput: hetforge's loop against a minimal plain-PyTorch loop, side by side.

Both loops train the same GPT-NeoX model (hetforge.model) on the same shards, with AdamW, the same
batch and sequence length; only the loop differs. Each runs eager and under torch.compile
(hetforge: per block, `train.compile: on`; the plain loop: the whole model, as nanoGPT does). Rounds alternate (hetforge, plain, hetforge,
plain...) so that drift in a shared machine's speed hits both alike, and each loop's figure is the
median over its timed intervals (first interval of each round dropped as warm-up). MFU is against
the dense-matmul peak measured in this same run, for the same dtype.

    .venv/bin/python bench/train_throughput.py            # ~10 minutes on 2 cores (eager and compiled rows)
    .venv/bin/python bench/train_throughput.py --quick    # smoke run

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.config import build_config  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402
from hetforge.data.shards import TokenShard  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig  # noqa: E402
from hetforge.model.accounting import flops_per_token  # noqa: E402
from hetforge.scaling.flops import measure_matmul_peak  # noqa: E402
from hetforge.train.loop import train  # noqa: E402
from hetforge.core.metrics import read_metrics  # noqa: E402


def plain_loop(model_cfg: GPTNeoXConfig, data_dir: Path, steps: int, batch: int, seq: int,
               interval: int, dtype: str, seed: int, compiled: bool = False) -> list[float]:
    """nanoGPT-style: random windows from the memmap, forward, backward, clip, step (with
    `compiled`, nanoGPT's `torch.compile(model)` of the whole model). Returns the tokens/s of each
    interval of `interval` steps."""
    torch.manual_seed(seed)
    data = TokenShard(data_dir, "train").tokens
    model = GPTNeoX(model_cfg)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=True)
    if compiled:
        model = torch.compile(model)
    rng = np.random.default_rng(seed)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)
    rates, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        ix = rng.integers(0, len(data) - seq - 1, batch)
        chunk = torch.from_numpy(np.stack([np.asarray(data[i:i + seq + 1], dtype=np.int64) for i in ix]))
        x, y = chunk[:, :-1], chunk[:, 1:]
        with ctx:
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % interval == 0:
            loss.item()
            now = time.perf_counter()
            rates.append(interval * batch * seq / (now - t0))
            t0 = now
    return rates


def hetforge_loop(raw: dict, steps: int, interval: int, dtype: str, run_dir: Path, compiled: bool = False) -> list[float]:
    raw = {**raw, "run_dir": str(run_dir),
           "train": {**raw["train"], "steps": steps, "log_interval": interval, "precision": dtype,
                     "compile": "on" if compiled else "off"}}
    train(build_config(raw), resume="never")
    return [r["tokens_per_s"] for r in read_metrics(run_dir / "metrics.jsonl")["train"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile rows")
    args = ap.parse_args()
    compiled_rows = not args.no_compiled
    steps, rounds, interval = (6, 1, 3) if args.quick else (args.steps, args.rounds, 5)
    batch, seq = 8, 256
    work = Path(tempfile.mkdtemp(prefix="hetforge-bench-"))
    raw = {
        "name": "bench", "run_dir": str(work / "run"),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(ROOT / "data_cache" / "aclsum-8k"),
                 "tokenizer": {"vocab_size": 8192}},
        "model": {"preset": "small"},  # 6 layers, d=256, 8 heads
        "train": {"seq_len": seq, "micro_batch_size": batch, "lr": 1e-3, "warmup_steps": 2,
                  "eval_interval": 10**9, "checkpoint_interval": 10**9, "tensorboard": False,
                  "progress": False, "peak_tflops": 1.0, "final_eval_batches": 1},
    }
    cfg = build_config(raw)
    data = prepare(cfg.data, progress=False)
    model_cfg = GPTNeoXConfig.from_model_config(cfg.model, data.meta["vocab_size"])
    fpt = flops_per_token(model_cfg, seq)

    results: dict[str, float] = {}
    for dtype in ("fp32", "bf16"):
        # The peak is re-measured every round and the best kept: a busy moment on a shared machine
        # can only make one measurement low, never high.
        peak, het, plain, het_c, plain_c = 0.0, [], [], [], []
        for r in range(rounds):  # the first interval of each run is dropped: warm-up, and the compile
            peak = max(peak, measure_matmul_peak("cpu", torch.float32 if dtype == "fp32" else torch.bfloat16))
            het += hetforge_loop(raw, steps, interval, dtype, work / f"{dtype}-{r}")[1:]
            plain += plain_loop(model_cfg, data.out_dir, steps, batch, seq, interval, dtype, seed=r)[1:]
            if compiled_rows:
                het_c += hetforge_loop(raw, steps, interval, dtype, work / f"{dtype}-c{r}", compiled=True)[1:]
                plain_c += plain_loop(model_cfg, data.out_dir, steps, batch, seq, interval, dtype, seed=r,
                                      compiled=True)[1:]
        h, p = statistics.median(het), statistics.median(plain)
        if compiled_rows:
            hc, pc = statistics.median(het_c), statistics.median(plain_c)
            results.update({f"{dtype}_hetforge_compiled_tokens_per_s": hc, f"{dtype}_plain_compiled_tokens_per_s": pc,
                            f"{dtype}_compiled_vs_plain_compiled": hc / pc, f"{dtype}_compiled_vs_eager": hc / h})
            print(f"{dtype} compiled: hetforge {hc:,.0f} tok/s | plain {pc:,.0f} tok/s | ratio {hc / pc:.3f} | "
                  f"hetforge compiled / eager {hc / h:.3f}", flush=True)
        results.update({
            f"{dtype}_peak_tflops": peak / 1e12,
            f"{dtype}_hetforge_tokens_per_s": h,
            f"{dtype}_plain_tokens_per_s": p,
            f"{dtype}_ratio": h / p,
            f"{dtype}_hetforge_mfu": fpt * h / peak,
            f"{dtype}_plain_mfu": fpt * p / peak,
        })
        print(f"{dtype}: hetforge {h:,.0f} tok/s (MFU {fpt * h / peak:.1%}) | plain {p:,.0f} tok/s "
              f"(MFU {fpt * p / peak:.1%}) | ratio {h / p:.3f} | matmul peak {peak / 1e12:.3f} TFLOP/s",
              flush=True)
    out = {"bench": "train_throughput", "model": "small (6 layers, d=256, seq 256, batch 8)",
           "flops_per_token": fpt, "ratio": results["fp32_ratio"],
           **{k: round(v, 4) for k, v in results.items()}}
    record(out, save=not args.quick)


if __name__ == "__main__":
    main()
