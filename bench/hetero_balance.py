"""Heterogeneous balance: equal split (HetSeq's manual default) against hetforge's balanced split.

Two ranks on this machine (torchrun, gloo, one thread each); rank 1 is made k times slower with the
documented simulation knob `cluster.nodes[].devices[].slowdown` (it sleeps (k-1) x 3 x its forward
time after every forward, before the gradient sync, as a slower device would take longer). For
k in {1, 2, 4} both splits train the same model on the same global batch in this one run; the
figure is the median steady-state step time (first log interval dropped). The ideal balanced step is
B / sum_i r_i with r_i each rank's measured samples/s. Also: scaling efficiency of 2 ranks over 1 at
k = 1 (tokens/s of 2 ranks / (2 x tokens/s of 1)), and the peer a user would otherwise pick: the
same model and global batch under DeepSpeed ZeRO-1 (bench/deepspeed_peer.py, CPU accelerator, gloo,
equal split only) at k = 1 and 2, when the `bench` extra is installed.

    .venv/bin/python bench/hetero_balance.py          # ~8 minutes on 2 cores with DeepSpeed
    .venv/bin/python bench/hetero_balance.py --quick  # smoke run

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.config import build_config  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402
from hetforge.core.metrics import read_metrics  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(work: Path, name: str, nproc: int, k: float, balance: str, steps: int, global_batch: int) -> dict:
    cfg = {
        "name": name, "run_dir": str(work / name),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(ROOT / "data_cache" / "aclsum-4k"),
                 "tokenizer": {"vocab_size": 4096}},
        "model": {"preset": "tiny"},
        "train": {"steps": steps, "seq_len": 128, "micro_batch_size": 8, "global_batch_tokens": global_batch * 128,
                  "warmup_steps": 2, "log_interval": 4, "eval_interval": 10**9, "checkpoint_interval": 10**9,
                  "final_eval_batches": 1, "tensorboard": False, "progress": False, "peak_tflops": 1.0},
        "cluster": {"balance": balance, "rebalance": False, "nodes": [{"host": "localhost", "devices": [
            {"type": "cpu"}, {"type": f"cpu-{k:g}x-slower", "slowdown": k}][:nproc]}]},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "hetforge", "train", str(path)]
    if nproc == 1:
        cmd = [sys.executable, "-m", "hetforge", "train", str(path)]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    recs = read_metrics(work / name / "metrics.jsonl")["train"][1:]
    out = {"step_s": statistics.median(r["step_time_s"] for r in recs),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs)}
    plan_path = work / name / "balance.json"
    if plan_path.exists():
        plan = json.loads(plan_path.read_text())
        rates = [s["samples_per_s"] for s in plan["shares"]]
        out.update(samples=[s["samples"] for s in plan["shares"]], predicted_s=plan["predicted_step_s"],
                   ideal_s=plan["global_batch"] / sum(rates))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps, B = (6, 8) if args.quick else (14, 32)
    prepare(build_config({"data": {"sources": [{"type": "aclsum"}], "out_dir": str(ROOT / "data_cache" / "aclsum-4k"),
                                   "tokenizer": {"vocab_size": 4096}}}).data, progress=False, verbose=False)
    work = Path(tempfile.mkdtemp(prefix="hetforge-balance-"))
    figures: dict[str, float] = {}
    for k in (1, 2, 4):
        eq = run(work, f"equal-k{k}", 2, k, "equal", steps, B)
        bal = run(work, f"balanced-k{k}", 2, k, "auto", steps, B)
        ratio = bal["step_s"] / eq["step_s"]
        vs_ideal = bal["step_s"] / bal["ideal_s"]
        figures.update({f"k{k}_equal_step_s": eq["step_s"], f"k{k}_balanced_step_s": bal["step_s"],
                        f"k{k}_ratio": ratio, f"k{k}_balanced_vs_ideal": vs_ideal})
        print(f"k={k}: equal {eq['step_s'] * 1e3:.0f} ms (split {eq['samples']}) | balanced "
              f"{bal['step_s'] * 1e3:.0f} ms (split {bal['samples']}, predicted {bal['predicted_s'] * 1e3:.0f} ms) "
              f"| balanced/equal {ratio:.3f} | balanced/ideal {vs_ideal:.3f}", flush=True)
    try:
        import deepspeed  # noqa: F401  (the bench extra)

        for k in (1, 2):
            out = work / f"ds-k{k}.json"
            res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                  str(ROOT / "bench" / "deepspeed_peer.py"), str(out), str(k), str(steps), str(B)],
                                 cwd=ROOT, env={**ENV, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"deepspeed peer failed:\n{res.stderr[-3000:]}")
            ds = json.loads(out.read_text())
            het_tps = B * 128 / figures[f"k{k}_balanced_step_s"]
            figures[f"k{k}_deepspeed_step_s"] = ds["step_s"]
            figures[f"k{k}_hetforge_vs_deepspeed"] = het_tps / ds["tokens_per_s"]
            print(f"k={k}: DeepSpeed ZeRO-1 (equal split) {ds['step_s'] * 1e3:.0f} ms | hetforge balanced / "
                  f"DeepSpeed tokens/s {figures[f'k{k}_hetforge_vs_deepspeed']:.3f}", flush=True)
    except ImportError:
        print("DeepSpeed not installed (pip install -e '.[bench]'): peer comparison skipped", flush=True)
    one = run(work, "single", 1, 1, "auto", steps, B)
    two_tps = B * 128 / figures["k1_equal_step_s"]
    figures["scaling_efficiency_2_ranks"] = two_tps / (2 * one["tokens_per_s"])
    print(f"1 rank {one['tokens_per_s']:,.0f} tok/s, 2 ranks {two_tps:,.0f} tok/s: scaling efficiency "
          f"{figures['scaling_efficiency_2_ranks']:.1%}", flush=True)
    record({"bench": "hetero_balance", "ratio": round(figures["k2_ratio"], 4),
            **{key: round(v, 4) for key, v in figures.items()}}, save=not args.quick)


if __name__ == "__main__":
    main()
