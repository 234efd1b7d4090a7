"""Sharded data parallelism on this machine: how much larger a model trains under a fixed per-rank
memory budget, speed against DeepSpeed's ZeRO-3, and heterogeneous balance under FSDP.

1. Under a declared per-rank budget (`memory_gb` of each CPU device; hetforge's probe refuses a
   run whose weights, gradients, optimizer state and gathered units plus activations exceed it),
   the deepest model of a fixed width (d=512, sequences of 32 tokens, micro-batch 1: a layer's
   training state, 50 MB, outweighs its activations, as it does for a billion-parameter model at
   seq 2048) that trains: DDP on 2 ranks against FSDP on 2 and 4. The depth is first estimated from
   the accounting, then settled by hetforge itself: a depth is trained for one step, and one layer
   deeper must be refused by its memory check (the optimizer is never moved to the host, so DDP
   gets no help FSDP lacks); each rank's measured bytes of weights, gradients and optimizer state
   (the `state_bytes` event, measured on its tensors) are checked to be within the budget.
   Goal: params(FSDP, W) / params(DDP) >= 0.8 W.
2. tokens/s of hetforge FSDP against DeepSpeed ZeRO-3 (its CPU accelerator, gloo; ZeRO-2 if stage 3
   does not run; the key `deepspeed_stage` says which), the same model (tiny preset, vocab 4096),
   global batch and 2 ranks, equal split, medians over 5 interleaved rounds. Goal >= 1.0. Needs the
   bench extra (pip install -e '.[bench]').
3. One rank made 2x slower (`slowdown: 2`): FSDP's balanced split against the equal split, step
   time ratio (medians over 5 interleaved rounds), global batch 96 x 256 tokens (see HETERO_BATCH).
   Both take `parallel.accumulation: auto`: unequal micro-batch counts accumulating unsharded, or
   equal counts resharding every micro-batch, whichever the balance prices faster (the key
   `hetero_accumulation` says which each run took; `hetero_k2_predicted` is the balance's own
   ratio; `hetero_runs` has each run's measured and predicted step and its micro-batches, (count,
   size) per rank). Goal <= 0.70; the ideal (no fixed cost) is 0.6875.
4. ZeRO-1 on two ranks of 512 and 256 MiB: the deepest model that trains with the optimizer state
   in proportion to memory (`parallel.state_shares: memory`) against equal parts, settled the same
   way as part 1 (key `zero1_memory_ratio`). Weights and gradients stay whole on every rank under
   ZeRO-1, so the gain is bounded by the state's part: 12 bytes a parameter on the small rank with
   equal parts, 8 + 8/3 by memory: at most 1.125x in parameters, though whole layers can round
   either way.

    .venv/bin/python bench/sharded_scale.py          # ~25 minutes on 2 cores
    .venv/bin/python bench/sharded_scale.py --quick
    .venv/bin/python bench/sharded_scale.py --only zero1-memory   # part 4 only (~3 minutes)

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
from record import record  # noqa: E402  (bench/record.py)

from hetforge.cluster.probe import WORKSPACE_MARGIN  # noqa: E402
from hetforge.config import build_config  # noqa: E402
from hetforge.core.metrics import read_metrics  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402
from hetforge.model.accounting import count_parameters, sharded_static_bytes  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoXConfig  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
DATA = ROOT / "data_cache" / "aclsum-4k"
WIDTH, HEADS, SEQ, VOCAB = 128, 4, 128, 4096  # the speed and balance runs
BIG_WIDTH, BIG_HEADS, BIG_SEQ = 512, 8, 32  # the largest-model runs
BUDGET_MB = 512
# The balance runs: FSDP's collectives cost the same whatever a rank's share, so a step is a fixed
# part plus the slowest rank's compute, and balancing acts on the second only. On this CPU the
# fixed part is ~0.15 s a step for the tiny model; 96 samples of 256 tokens make the compute the
# larger part, as it is for a real model on a GPU (one micro-batch a rank, equal or balanced).
HETERO_BATCH, HETERO_SEQ = 96, 256


def config(work: Path, name: str, nproc: int, strategy: str, steps: int, global_batch: int, *, layers=None,
           memory_gb=None, slowdown=1.0, balance="equal", micro=8, seq=None, state_shares="memory") -> Path:
    """`memory_gb`: every rank's, or a list of each rank's."""
    model = {"preset": "tiny"} if layers is None else {"preset": None, "n_layers": layers, "d_model": BIG_WIDTH,
                                                        "n_heads": BIG_HEADS}
    seq = seq or (SEQ if layers is None else BIG_SEQ)
    devices = [{"type": "cpu"} for _ in range(nproc)]
    memories = memory_gb if isinstance(memory_gb, list) else [memory_gb] * nproc
    for d, m in zip(devices, memories):
        if m:
            d["memory_gb"] = m
    if slowdown > 1:
        devices[-1].update(slowdown=slowdown)
    cfg = {
        "name": name, "run_dir": str(work / name),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(DATA), "tokenizer": {"vocab_size": VOCAB}},
        "model": model,
        "train": {"steps": steps, "seq_len": seq, "micro_batch_size": micro, "global_batch_tokens": global_batch * seq,
                  "warmup_steps": 2, "log_interval": 2 if steps > 2 else 1, "eval_interval": 10**9,
                  "checkpoint_interval": 10**9, "final_eval_batches": 1, "tensorboard": False, "progress": False,
                  "peak_tflops": 1.0, "save_checkpoints": False},
        "cluster": {"balance": balance, "rebalance": False, "nodes": [{"host": "localhost", "devices": devices}]},
        "parallel": {"strategy": strategy, "state_shares": state_shares},
        "memory": {"optimizer_offload": "off"},
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
    """The most layers whose static bytes plus one sample's activations fit `budget`: a first
    guess, which the launches below settle."""
    layers = 1
    while True:
        shape = GPTNeoXConfig(layers + 1, BIG_WIDTH, BIG_HEADS, 4 * BIG_WIDTH, VOCAB)
        need = sum(sharded_static_bytes(shape, "adamw", strategy, world, gather_bytes=4).values()) + \
            WORKSPACE_MARGIN * act * (layers + 1)
        if need > budget:
            return layers
        layers += 1


def largest_model(work: Path, strategy: str, world: int, budgets_mb: list[float] | None = None,
                  state_shares: str = "memory") -> dict:
    budgets_mb = budgets_mb or [BUDGET_MB] * world
    tag = "" if len(set(budgets_mb)) == 1 else f"-{state_shares}"

    def trains(layers: int) -> subprocess.CompletedProcess:
        name = f"max-{strategy}{tag}-w{world}-{layers}"
        return launch(config(work, name, world, strategy, 1, world, layers=layers,
                             memory_gb=[b / 1024 for b in budgets_mb], micro=1, state_shares=state_shares), world)

    layers = deepest(strategy, world, min(budgets_mb) * 2**20, _act_per_layer(work))
    runs = {layers: trains(layers)}
    while runs[layers].returncode != 0 and layers > 1:  # the guess was too deep
        layers -= 1
        runs[layers] = trains(layers)
    if runs[layers].returncode != 0:
        raise SystemExit(f"{strategy} W={world}: not even one layer trains:\n{runs[layers].stderr[-3000:]}")
    while True:  # deeper until hetforge refuses
        runs[layers + 1] = trains(layers + 1)
        if runs[layers + 1].returncode != 0:
            break
        layers += 1
    lines = runs[layers + 1].stderr.strip().splitlines()
    refused = next((line for line in lines if line.startswith("error:")), " ".join(lines[-1:]))
    ev = next(e for e in read_metrics(work / f"max-{strategy}{tag}-w{world}-{layers}" / "metrics.jsonl")["event"]
              if e["event"] == "state_bytes")
    held = [sum(v for k, v in r.items() if k not in ("rank", "predicted")) for r in ev["ranks"]]
    shape = GPTNeoXConfig(layers, BIG_WIDTH, BIG_HEADS, 4 * BIG_WIDTH, VOCAB)
    return {"layers": layers, "params": count_parameters(shape)["total"], "held_bytes": max(held),
            "held_bytes_per_rank": held, "within_budget": all(h <= b * 2**20 for h, b in zip(held, budgets_mb)),
            "deeper_refused": True, "refusal": refused}


_ACT: list[float] = []


def _act_per_layer(work: Path) -> float:
    """One sample's saved activations per layer (with the head's share spread over the layers),
    measured on this machine with saved-tensor hooks at the bench's width."""
    if not _ACT:
        import torch

        from hetforge.cluster.probe import saved_bytes_per_sample
        from hetforge.model.gpt_neox import GPTNeoX

        four = GPTNeoX.build(GPTNeoXConfig(4, BIG_WIDTH, BIG_HEADS, 4 * BIG_WIDTH, VOCAB), "cpu", 0)
        _ACT.append(saved_bytes_per_sample(four, BIG_SEQ, VOCAB, torch.device("cpu"), contextlib.nullcontext) / 4)
    return _ACT[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("largest", "speed", "hetero", "zero1-memory"), action="append",
                    help="run only these parts (repeatable); default: all")
    args = ap.parse_args()
    parts = set(args.only or ("largest", "speed", "hetero", "zero1-memory"))
    steps, B = (6, 8) if args.quick else (12, 16)
    # two 2-rank processes on 2 shared cores: one run's tokens/s moves by 20-30%; five rounds
    speed_rounds = 1 if args.quick else 5
    hetero_steps = 6 if args.quick else 8
    # a run's steps agree within a few percent, but the machine's speed moves ~10% from one run to
    # the next (probe and steps alike): five interleaved rounds for the hetero medians
    hetero_rounds = 1 if args.quick else 5
    prepare(build_config({"data": {"sources": [{"type": "aclsum"}], "out_dir": str(DATA),
                                   "tokenizer": {"vocab_size": VOCAB}}}).data, progress=False, verbose=False)
    work = Path(tempfile.mkdtemp(prefix="hetforge-sharded-"))
    figures: dict = {}

    # 4. ZeRO-1 on ranks of unequal memory: the optimizer state in proportion to memory against equal parts
    if not args.quick and "zero1-memory" in parts:
        budgets = [BUDGET_MB, BUDGET_MB / 2]
        runs = {how: largest_model(work, "zero1", 2, budgets, how) for how in ("equal", "memory")}
        figures["zero1_memory_ratio"] = runs["memory"]["params"] / runs["equal"]["params"]
        figures["zero1_by_memory"], figures["zero1_equal"] = runs["memory"], runs["equal"]
        print(f"ZeRO-1 on ranks of {budgets[0]:g} and {budgets[1]:g} MiB: equal parts {runs['equal']['layers']} layers "
              f"({runs['equal']['params'] / 1e6:.1f}M), parts by memory {runs['memory']['layers']} layers "
              f"({runs['memory']['params'] / 1e6:.1f}M): {figures['zero1_memory_ratio']:.2f}x; held per rank "
              f"{[round(h / 2**20) for h in runs['memory']['held_bytes_per_rank']]} MiB", flush=True)
    ddp = largest_model(work, "ddp", 2) if "largest" in parts else None
    for world in (2, 4) if ddp else ():
        fsdp = largest_model(work, "fsdp", world)
        figures[f"params_ratio_w{world}"] = fsdp["params"] / ddp["params"]
        figures[f"fsdp_w{world}"] = fsdp
        print(f"budget {BUDGET_MB} MiB per rank, d={BIG_WIDTH}: DDP {ddp['layers']} layers ({ddp['params'] / 1e6:.1f}M) | "
              f"FSDP W={world} {fsdp['layers']} layers ({fsdp['params'] / 1e6:.1f}M): "
              f"{figures[f'params_ratio_w{world}']:.2f}x (goal >= {0.8 * world:.1f}); held {fsdp['held_bytes'] / 2**20:.1f} MiB, "
              f"one layer more refused: {fsdp['refusal']}", flush=True)
    if ddp:
        figures["ddp"] = ddp

    # speed against DeepSpeed: runs interleaved (hetforge, peer, hetforge, peer...), medians
    figures["vs_deepspeed"], figures["deepspeed_stage"] = None, (
        "not run: DeepSpeed not installed (pip install -e '.[bench]')" if "speed" in parts else "not run (--only)")
    try:
        import deepspeed  # noqa: F401

        have_ds = True
    except ImportError:
        have_ds = False
    ours, peers, stage_used = [], [], None
    for rnd in range(speed_rounds if "speed" in parts else 0):
        name = f"speed-fsdp-{rnd}"
        res = launch(config(work, name, 2, "fsdp", steps, B), 2)
        if res.returncode != 0:
            raise SystemExit(f"{name} failed:\n{res.stderr[-3000:]}")
        ours.append(steady(work, name)["tokens_per_s"])
        for stage in ((stage_used,) if stage_used else (3, 2)) if have_ds else ():
            out = work / f"ds-{stage}-{rnd}.json"
            ds = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 str(ROOT / "bench" / "deepspeed_peer.py"), str(out), "1", str(steps), str(B), str(stage)],
                                cwd=ROOT, env={**ENV, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
            if ds.returncode == 0:
                peers.append(json.loads(out.read_text())["tokens_per_s"])
                stage_used = stage
                break
            print(f"DeepSpeed ZeRO-{stage} did not run on its CPU accelerator: {ds.stderr.strip().splitlines()[-1:]}",
                  flush=True)
    if ours:
        figures["hetforge_fsdp_tokens_per_s"] = statistics.median(ours)
    if peers:
        figures["deepspeed_tokens_per_s"] = statistics.median(peers)
        figures["vs_deepspeed"] = figures["hetforge_fsdp_tokens_per_s"] / figures["deepspeed_tokens_per_s"]
        figures["deepspeed_stage"] = f"zero{stage_used}"
    if ours:
        print(f"tokens/s over {speed_rounds} interleaved rounds: hetforge FSDP {ours} | DeepSpeed {figures['deepspeed_stage']} "
              f"{peers} | ratio of medians {figures['vs_deepspeed']}", flush=True)

    # one rank 2x slower: equal split against hetforge's balance, interleaved
    eq_s, bal_s, predicted, runs = [], [], {"equal": [], "auto": []}, []
    for rnd in range(hetero_rounds if "hetero" in parts else 0):
        for name, balance, out in ((f"hetero-equal-{rnd}", "equal", eq_s), (f"hetero-balanced-{rnd}", "auto", bal_s)):
            r = launch(config(work, name, 2, "fsdp", hetero_steps, HETERO_BATCH, slowdown=2.0, balance=balance,
                              micro=HETERO_BATCH, seq=HETERO_SEQ), 2)
            if r.returncode != 0:
                raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
            out.append(steady(work, name)["step_s"])
            predicted[balance].append(json.loads((work / name / "balance.json").read_text()))
            shares = predicted[balance][-1]["shares"]
            runs.append({"run": name, "measured_s": out[-1], "predicted_s": predicted[balance][-1]["predicted_step_s"],
                         "micro_batches": [[len(s["micro_batches"]), max(s["micro_batches"], default=0)]
                                           for s in shares]})
            print(f"  {name}: {out[-1] * 1e3:.0f} ms, predicted {runs[-1]['predicted_s'] * 1e3:.0f} ms, "
                  f"micro-batches (count, size) {runs[-1]['micro_batches']}", flush=True)
    if bal_s:
        plan = predicted["auto"][0]
        figures["hetero_k2_ratio"] = statistics.median(bal_s) / statistics.median(eq_s)
        figures["hetero_k2_predicted"] = statistics.median(p["predicted_step_s"] for p in predicted["auto"]) / \
            statistics.median(p["predicted_step_s"] for p in predicted["equal"])
        figures["hetero_split"] = [s["micro_batches"] for s in plan["shares"]]
        figures["hetero_accumulation"] = [p.get("accumulation") for p in predicted["equal"] + predicted["auto"]]
        figures["hetero_runs"] = runs
        print(f"one rank 2x slower under FSDP: equal {[round(t * 1e3) for t in eq_s]} ms | balanced "
              f"{[round(t * 1e3) for t in bal_s]} ms (first split {[len(m) for m in figures['hetero_split']]} "
              f"micro-batches of {[max(m) for m in figures['hetero_split']]}; accumulation "
              f"{sorted(set(figures['hetero_accumulation']))}) | ratio {figures['hetero_k2_ratio']:.3f} "
              f"(goal <= 0.70), predicted {figures['hetero_k2_predicted']:.3f}", flush=True)

    def r4(v):
        return round(v, 4) if isinstance(v, float) else v

    record({"bench": "sharded_scale", **{k: r4(v) for k, v in figures.items()}}, save=not args.quick)


if __name__ == "__main__":
    main()
