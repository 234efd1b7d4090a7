"""Scoring a model on a list of tasks and groups: benchmarks, the sci_mc smoke test, task files.

One entry point for `hetforge eval --tasks`, the in-training evaluation and the scaling sweep, so
all three print and save the same numbers. Results are saved beside the run they judge.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.evaluate.benchmarks import BENCHMARKS, expand, prompts
from hetforge.evaluate.multiple_choice import TaskScore, group_score, load_task, score_prompted, score_task


def score_tasks(model, tok, names: list[str], max_len: int, device: torch.device, shots: int = 0,
                limit: int | None = None, batch_size: int = 32, on_task=None) -> list[TaskScore]:
    """Every named task's score, then each group's (after its members). `limit` takes the first n
    questions of each task, as lm-eval's --limit does. `on_task(name)` is told before each task."""
    entries = expand(names, shots)
    done: dict[str, TaskScore] = {}
    for task in dict.fromkeys(t for _, members in entries for t in members):
        if on_task:
            on_task(task)
        done[task] = score_one(model, tok, task, max_len, device, shots, limit, batch_size)
    return arrange(entries, done)


def arrange(entries: list[tuple[str, list[str]]], done: dict[str, TaskScore]) -> list[TaskScore]:
    """Scored tasks in the order asked, each once, and each group's aggregate after its members."""
    out: list[TaskScore] = []
    for entry, members in entries:
        out += [done[t] for t in members if done[t] not in out]
        if len(members) > 1 or entry != members[0]:
            out.append(group_score(entry, [done[t] for t in members]))
    return out


def score_one(model, tok, task: str, max_len: int, device: torch.device, shots: int = 0, limit: int | None = None,
              batch_size: int = 32) -> TaskScore:
    """One task: a benchmark (with its shots) or a task file / the smoke test (zero-shot only)."""
    if task in BENCHMARKS:
        b = BENCHMARKS[task]
        return score_prompted(model, tok, task, prompts(b, shots, limit), max_len, device, batch_size, b.metrics,
                              shots, b.split)[0]
    name, items = load_task(task)
    return score_task(model, tok, name, items[:limit] if limit else items, max_len, device, batch_size)[0]


def result_path(checkpoint: str | Path, step: int, shots: int) -> Path:
    """Where a checkpoint's task scores go: RUN/eval/step_XXXXXXXX-Nshot.json for a checkpoint of
    a run, else beside the checkpoint."""
    ckpt = Path(checkpoint)
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    return run / "eval" / f"step_{step:08d}-{shots}shot.json"


def save_scores(path: Path, checkpoint: str, step: int, shots: int, scores: list[TaskScore], via: str,
                limit: int | None) -> Path:
    """Write (or extend: tasks scored before and not now are kept) a checkpoint's task scores."""
    old = {}
    if path.is_file():
        try:
            old = {t["task"]: t for t in json.loads(path.read_text())["tasks"]}
        except (ValueError, KeyError, TypeError):
            old = {}
    for s in scores:
        old[s.task] = {**s.to_dict(), "via": via, "limit": limit}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"checkpoint": checkpoint, "step": step, "shots": shots,
                                        "tasks": list(old.values())}, indent=1) + "\n")
    return path
