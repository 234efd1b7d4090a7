"""Sharded data parallelism on this machine: how much larger a model trains under a fixed per-rank
memory budget, speed against DeepSpeed's ZeRO-3, and heterogeneous balance under FSDP.

1. Under a declared per-rank budget (`memory_gb` of each CPU device; hetforge's probe refuses a
   run whose weights, gradients, optimizer state and gathered units plus activations exceed it),
   the deepest model of a fixed width (d=128) that trains: DDP on 2 ranks against FSDP on 2 and 4.
   The depth is found from the accounting (what the probe checks), then trained for one step at
   that depth, and a depth one deeper is confirmed to be refused; each rank's measured bytes of
   weights, gradients and optimizer state (the `state_bytes` event, measured on its tensors) are
   checked to be within the budget. Goal: params(FSDP, W) / params(DDP) >= 0.8 W.
2. tokens/s of hetforge FSDP against DeepSpeed ZeRO-3 (its CPU accelerator, gloo; ZeRO-2 if stage 3
   does not run; the key `deepspeed_stage` says which), the same model (tiny preset, vocab 4096),
   global batch and 2 ranks, equal split. Goal >= 1.0. Needs the bench extra (pip install -e '.[bench]').
3. One rank made 2x slower (`slowdown: 2`): FSDP's balanced split (equal micro-batch counts,
   unequal sizes) against the equal split, step time ratio. Goal <= 0.70.

    .venv/bin/python bench/sharded_scale.py          # ~6 minutes on 2 cores
    .venv/bin/python bench/sharded_scale.py --quick

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
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

from hetforge.cluster.probe import WORKSPACE_MARGIN  # noqa: E402
from hetforge.config import build_config  # noqa: E402
from hetforge.core.metrics import read_metrics  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402
from hetforge.model.accounting import count_parameters, sharded_static_bytes  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoXConfig  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
DATA = ROOT / "data_cache" / "aclsum-4k"
WIDTH, HEADS, SEQ, VOCAB = 128, 4, 128, 4096
BUDGET_MB = 64


def config(work: Path, name: str, nproc: int, strategy: str, steps: int, global_batch: int, *, layers=None,
           memory_gb=None, slowdown=1.0, balance="equal", micro=8) -> Path:
    model = {"preset": "tiny"} if layers is None else {"preset": None, "n_layers": layers, "d_model": WIDTH,
                                                        "n_heads": HEADS}
    devices = [{"type": "cpu"} for _ in range(nproc)]
    for d in devices:
        if memory_gb:
            d["memory_gb"] = memory_gb
    if slowdown > 1:
        devices[-1].update(type=f"cpu-{slowdown:g}x-slower", slowdown=slowdown)
    cfg = {
        "name": name, "run_dir": str(work / name),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(DATA), "tokenizer": {"vocab_size": VOCAB}},
        "model": model,
        "train": {"steps": steps, "seq_len": SEQ, "micro_batch_size": micro, "global_batch_tokens": global_batch * SEQ,
                  "warmup_steps": 2, "log_interval": 2 if steps > 2 else 1, "eval_interval": 10**9,
                  "checkpoint_interval": 10**9, "final_eval_batches": 1, "tensorboard": False, "progress": False,
                  "peak_tflops": 1.0, "save_checkpoints": False},
        "cluster": {"balance": balance, "rebalance": False, "nodes": [{"host": "localhost", "devices": devices}]},
        "parallel": {"strategy": strategy},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(path: Path, nproc: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "hetforge", "train", str(path)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)


def steady(work: Path, name: str) -> dict:
    recs = read_metrics(work / name / "metrics.jsonl")["train"]
    recs = recs[1:] or recs
    return {"step_s": statistics.median(r["step_time_s"] for r in recs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs)}


def deepest(strategy: str, world: int, budget: float, act: float) -> int:
    """The most layers whose static bytes plus one sample's activations (what the probe checks)
    fit `budget`."""
    layers = 1
    while True:
        shape = GPTNeoXConfig(layers + 1, WIDTH, HEADS, 4 * WIDTH, VOCAB)
        need = sum(sharded_static_bytes(shape, "adamw", strategy, world).values()) + WORKSPACE_MARGIN * act * (layers + 1)
        if need > budget:
            return layers
        layers += 1


def largest_model(work: Path, strategy: str, world: int) -> dict:
    budget = BUDGET_MB * 2**20
    # activation bytes per sample per layer, from a measured 1-step run's probe (fixed width)
    act_per_layer = _act_per_layer(work)
    layers = deepest(strategy, world, budget, act_per_layer)
    name = f"max-{strategy}-w{world}"
    ok = launch(config(work, name, world, strategy, 1, 2 * world, layers=layers, memory_gb=BUDGET_MB / 1024, micro=1), world)
    if ok.returncode != 0:
        raise SystemExit(f"{name} ({layers} layers) failed:\n{ok.stderr[-3000:]}")
    over = launch(config(work, name + "-over", world, strategy, 1, 2 * world, layers=layers + 1,
                         memory_gb=BUDGET_MB / 1024, micro=1), world)
    ev = next(e for e in read_metrics(work / name / "metrics.jsonl")["event"] if e["event"] == "state_bytes")
    held = max(sum(v for k, v in r.items() if k != "rank") for r in ev["ranks"])
    shape = GPTNeoXConfig(layers, WIDTH, HEADS, 4 * WIDTH, VOCAB)
    return {"layers": layers, "params": count_parameters(shape)["total"], "held_bytes": held,
            "within_budget": held <= budget, "deeper_refused": over.returncode != 0}


_ACT: list[float] = []


def _act_per_layer(work: Path) -> float:
    """One sample's saved activations per layer (with the head's share spread over the layers),
    measured on this machine with saved-tensor hooks at the bench's width."""
    if not _ACT:
        import torch

        from hetforge.cluster.probe import saved_bytes_per_sample
        from hetforge.model.gpt_neox import GPTNeoX

        four = GPTNeoX.build(GPTNeoXConfig(4, WIDTH, HEADS, 4 * WIDTH, VOCAB), "cpu", 0)
        _ACT.append(saved_bytes_per_sample(four, SEQ, VOCAB, torch.device("cpu"), contextlib.nullcontext) / 4)
    return _ACT[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps, B = (6, 8) if args.quick else (12, 16)
    prepare(build_config({"data": {"sources": [{"type": "aclsum"}], "out_dir": str(DATA),
                                   "tokenizer": {"vocab_size": VOCAB}}}).data, progress=False, verbose=False)
    work = Path(tempfile.mkdtemp(prefix="hetforge-sharded-"))
    figures: dict = {}

    ddp = largest_model(work, "ddp", 2)
    for world in (2, 4):
        fsdp = largest_model(work, "fsdp", world)
        figures[f"params_ratio_w{world}"] = fsdp["params"] / ddp["params"]
        figures[f"fsdp_w{world}"] = fsdp
        print(f"budget {BUDGET_MB} MiB per rank, d={WIDTH}: DDP {ddp['layers']} layers ({ddp['params'] / 1e6:.1f}M) | "
              f"FSDP W={world} {fsdp['layers']} layers ({fsdp['params'] / 1e6:.1f}M): "
              f"{figures[f'params_ratio_w{world}']:.2f}x (goal >= {0.8 * world:.1f}); held {fsdp['held_bytes'] / 2**20:.1f} MiB, "
              f"one layer more refused: {fsdp['deeper_refused']}", flush=True)
    figures["ddp"] = ddp

    fsdp_run = config(work, "speed-fsdp", 2, "fsdp", steps, B)
    res = launch(fsdp_run, 2)
    if res.returncode != 0:
        raise SystemExit(f"speed-fsdp failed:\n{res.stderr[-3000:]}")
    mine = steady(work, "speed-fsdp")
    figures["vs_deepspeed"], figures["deepspeed_stage"] = None, "not run: DeepSpeed not installed (pip install -e '.[bench]')"
    try:
        import deepspeed  # noqa: F401

        for stage in (3, 2):
            out = work / f"ds-{stage}.json"
            ds = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 str(ROOT / "bench" / "deepspeed_peer.py"), str(out), "1", str(steps), str(B), str(stage)],
                                cwd=ROOT, env={**ENV, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
            if ds.returncode == 0:
                peer = json.loads(out.read_text())
                figures["vs_deepspeed"] = mine["tokens_per_s"] / peer["tokens_per_s"]
                figures["deepspeed_stage"] = f"zero{stage}"
                figures["deepspeed_tokens_per_s"] = peer["tokens_per_s"]
                break
            print(f"DeepSpeed ZeRO-{stage} did not run on its CPU accelerator: {ds.stderr.strip().splitlines()[-1:]}",
                  flush=True)
    except ImportError:
        pass
    figures["hetforge_fsdp_tokens_per_s"] = mine["tokens_per_s"]
    print(f"tokens/s: hetforge FSDP {mine['tokens_per_s']:,.0f} | DeepSpeed {figures['deepspeed_stage']} "
          f"{figures.get('deepspeed_tokens_per_s', float('nan')):,.0f} | ratio {figures['vs_deepspeed']}", flush=True)

    eq = launch(config(work, "hetero-equal", 2, "fsdp", steps, B, slowdown=2.0, balance="equal"), 2)
    bal = launch(config(work, "hetero-balanced", 2, "fsdp", steps, B, slowdown=2.0, balance="auto"), 2)
    for name, r in (("hetero-equal", eq), ("hetero-balanced", bal)):
        if r.returncode != 0:
            raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    e, b = steady(work, "hetero-equal"), steady(work, "hetero-balanced")
    plan = json.loads((work / "hetero-balanced" / "balance.json").read_text())
    figures["hetero_k2_ratio"] = b["step_s"] / e["step_s"]
    figures["hetero_split"] = [s["micro_batches"] for s in plan["shares"]]
    print(f"one rank 2x slower under FSDP: equal {e['step_s'] * 1e3:.0f} ms | balanced {b['step_s'] * 1e3:.0f} ms "
          f"(micro-batches {figures['hetero_split']}) | ratio {figures['hetero_k2_ratio']:.3f} (goal <= 0.70)", flush=True)

    def r4(v):
        return round(v, 4) if isinstance(v, float) else v

    print(json.dumps({"bench": "sharded_scale", **{k: r4(v) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
