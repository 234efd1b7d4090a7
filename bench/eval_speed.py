"""Zero-shot scoring throughput: hetforge's scorer against the same model through lm-evaluation-
harness (hetforge.evaluate.lm_eval_adapter), side by side.

The model is the `small` preset (6 layers, d=256) with the demo corpus's 8k tokenizer, the task the
built-in sci-mc set repeated to 240 questions (960 choices). Both paths produce the same scores (the
tests check it); what differs is what surrounds the forward passes. Rounds alternate, and each
figure is the median over rounds of choices scored per second, whole evaluation included.

    .venv/bin/python bench/eval_speed.py          # ~2 minutes on 2 cores; needs the 'eval' extra

Last line: one JSON object with the figures.
"""

from __future__ import annotations

from dataclasses import replace
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from record import record  # noqa: E402  (bench/record.py)

from hetforge.config import build_config  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402
from hetforge.data.tokenizer import load_tokenizer  # noqa: E402
from hetforge.evaluate.lm_eval_adapter import HetforgeLM, evaluate  # noqa: E402
from hetforge.evaluate.multiple_choice import load_task, score_task  # noqa: E402
from hetforge.model.gpt_neox import GPTNeoX  # noqa: E402
from hetforge.model.presets import PRESETS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=4, help="times the 60-question set is repeated")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = build_config({"data": {"sources": [{"type": "aclsum"}], "out_dir": str(ROOT / "data_cache" / "aclsum-8k"),
                                 "tokenizer": {"vocab_size": 8192}}})
    data = prepare(cfg.data, progress=False, verbose=False)
    tok = load_tokenizer(data.out_dir / "tokenizer.json")
    model = GPTNeoX(replace(PRESETS["small"], vocab_size=data.meta["vocab_size"])).eval()
    _, items = load_task("sci-mc")
    task = Path(tempfile.mkdtemp(prefix="hetforge-eval-bench-")) / "sci_mc_x.jsonl"
    task.write_text("".join(json.dumps({"question": it.question, "choices": it.choices, "answer": it.answer}) + "\n"
                            for _ in range(args.copies) for it in items))
    _, bench_items = load_task(task)
    n_choices = sum(len(it.choices) for it in bench_items)
    device, seq, batch = torch.device("cpu"), 256, 32
    lm = HetforgeLM(model=model, tokenizer=tok, device="cpu", max_length=seq, batch_size=batch)
    evaluate(lm, [str(task)])  # warm-up: lm_eval builds and caches its dataset once

    het, harness, scores = [], [], {}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        res, _ = score_task(model, tok, "sci_mc_x", bench_items, seq, device, batch)
        het.append(n_choices / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        got = evaluate(lm, [str(task)])["sci_mc_x"]
        harness.append(n_choices / (time.perf_counter() - t0))
        scores = {"hetforge": (res.acc, res.acc_norm), "lm_eval": (got["acc"], got["acc_norm"])}
    h, l_ = statistics.median(het), statistics.median(harness)
    print(f"hetforge scorer {h:,.0f} choices/s | lm_eval adapter {l_:,.0f} choices/s | ratio {h / l_:.2f} "
          f"({n_choices} choices, small preset, batch {batch})")
    print(f"same scores: {scores['hetforge'] == scores['lm_eval']} {scores}")
    record({"bench": "eval_speed", "ratio": round(h / l_, 4), "hetforge_choices_per_s": round(h, 1),
                      "lm_eval_choices_per_s": round(l_, 1), "choices": n_choices,
                      "same_scores": scores["hetforge"] == scores["lm_eval"]})


if __name__ == "__main__":
    main()
