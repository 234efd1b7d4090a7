"""Benchmark scoring speed: hetforge's scorer against lm-evaluation-harness (`lm_eval --model hf` on
the exported model, with the harness's own task definitions pointed at the same data), side by
side on SciQ and ARC-Easy.

A small model is trained for a few steps on the demo corpus (its scores are near chance; what is
measured is the scoring), saved, and exported to Hugging Face format. Each round times both
paths end to end from the files on disk: hetforge loads the checkpoint and scores
(`hetforge eval --tasks`); the harness loads the exported model and runs `simple_evaluate`. Rounds
alternate after a warm-up of each; the figure is the median of questions per second. Scores must
be identical to the fourth decimal (acc, acc_norm and their standard errors), as lm-eval prints them.

    .venv/bin/python bench/eval_speed.py            # about 10 minutes on 2 cores

Last line: one JSON object with bench, ratio, same_scores, tasks and the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from record import record  # noqa: E402  (bench/record.py)

import hetforge.evaluate.lm_eval_adapter  # noqa: E402,F401  (the datasets cache out of $HOME)
from hetforge.config import build_config  # noqa: E402
from hetforge.data.tokenizer import load_tokenizer  # noqa: E402
from hetforge.evaluate.benchmarks import harness_task_dir  # noqa: E402
from hetforge.evaluate.suite import score_tasks  # noqa: E402
from hetforge.export.hf import export_hf  # noqa: E402
from hetforge.model.load import load_for_inference  # noqa: E402
from hetforge.train.loop import train  # noqa: E402

TASKS = ["sciq", "arc_easy"]
KEYS = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")


def trained_model(work: Path, layers: int, width: int, seq: int) -> Path:
    cfg = build_config({
        "run_dir": str(work / "run"),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(ROOT / "data_cache" / "aclsum-8k"),
                 "tokenizer": {"vocab_size": 8192}},
        "model": {"preset": None, "n_layers": layers, "d_model": width, "n_heads": max(2, width // 64)},
        "train": {"steps": 30, "seq_len": seq, "micro_batch_size": 8, "warmup_steps": 5, "log_interval": 10,
                  "eval_interval": 30, "checkpoint_interval": 30, "final_eval_batches": 2, "tensorboard": False,
                  "progress": False, "peak_tflops": 1.0},
    })
    return train(cfg).checkpoint


def hetforge_round(ckpt: Path, limit: int | None, batch: int) -> dict[str, dict]:
    model, state = load_for_inference(ckpt)
    tok = load_tokenizer(state["tokenizer"])
    scores = score_tasks(model, tok, TASKS, state["seq_len"], torch.device("cpu"), 0, limit, batch)
    return {s.task: {k: getattr(s, k) for k in KEYS} | {"n": s.n} for s in scores}


def harness_round(hf: Path, tasks_dir: Path, local: dict[str, str], limit: int | None, batch: int) -> dict[str, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", tasks=list(local.values()),
                                  num_fewshot=0, limit=limit, batch_size=batch, device="cpu",
                                  task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    return {t: {k: res["results"][name][f"{k},none"] for k in KEYS} | {"n": res["n-samples"][name]["effective"]}
            for t, name in local.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, help="the first N questions of each task (default: all)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="hetforge-eval-speed-"))
    ckpt = trained_model(work, args.layers, args.width, args.seq)
    hf = export_hf(ckpt, work / "hf")
    tasks_dir = work / "tasks"
    local = harness_task_dir(TASKS, tasks_dir)
    hetforge_round(ckpt, 5, args.batch)  # warm-up: imports, the wheel's files read once
    harness_round(hf, tasks_dir, local, 5, args.batch)  # warm-up: the harness converts the data once

    het, harness = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        mine = hetforge_round(ckpt, args.limit, args.batch)
        het.append(sum(v["n"] for v in mine.values()) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        theirs = harness_round(hf, tasks_dir, local, args.limit, args.batch)
        harness.append(sum(v["n"] for v in theirs.values()) / (time.perf_counter() - t0))
    same = all(f"{mine[t][k]:.4f}" == f"{theirs[t][k]:.4f}" for t in TASKS for k in KEYS) and \
        all(mine[t]["n"] == theirs[t]["n"] for t in TASKS)
    h, lm = statistics.median(het), statistics.median(harness)
    questions = sum(v["n"] for v in mine.values())
    print(f"hetforge {h:,.1f} questions/s | lm_eval --model hf {lm:,.1f} questions/s | ratio {h / lm:.2f} "
          f"({questions} questions of {', '.join(TASKS)}; {args.layers} layers, d={args.width}, window {args.seq})")
    for t in TASKS:
        print(f"  {t}: hetforge " + " ".join(f"{k} {mine[t][k]:.4f}" for k in KEYS))
        print(f"  {t}: lm_eval  " + " ".join(f"{k} {theirs[t][k]:.4f}" for k in KEYS))
    record({"bench": "eval_speed", "ratio": round(h / lm, 3), "same_scores": same, "tasks": TASKS,
            "hetforge_questions_per_s": round(h, 2), "lm_eval_questions_per_s": round(lm, 2), "questions": questions,
            "scores": {t: {k: round(mine[t][k], 4) for k in KEYS} for t in TASKS}})


if __name__ == "__main__":
    main()
