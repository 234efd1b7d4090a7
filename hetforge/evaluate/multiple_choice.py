"""Zero-shot multiple choice, scored as lm-evaluation-harness scores it.

Each choice is a continuation of the context "Question: <question>\\nAnswer:" after one space; its
score is the summed log-probability of its tokens. `acc` takes the best score, `acc_norm` the best
score divided by the choice's length in characters (lm-eval's normalisation, which keeps long
answers from losing for their length alone).

Task files are JSONL in one of three forms, detected per line: hetforge's own {question, choices,
answer} (answer an index or a letter), SciQ's {question, distractor1..3, correct_answer, support},
and ARC's {question: {stem, choices: [{text, label}]}, answerKey}. `sci-mc` names the set shipped
with hetforge: 60 physics, chemistry, biology, earth-science and NLP questions written for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hetforge.core.errors import HetforgeError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
BUILTIN = {"sci-mc": TASKS_DIR / "sci_mc.jsonl"}


class TaskError(HetforgeError, ValueError):
    """A task file that cannot be read; names the file and line."""


@dataclass
class Item:
    id: str
    question: str
    choices: list[str]
    answer: int
    context: str = ""  # text before the question (SciQ's support passage)

    @property
    def prompt(self) -> str:
        return f"{self.context}Question: {self.question}\nAnswer:"


def _item(rec: dict, where: str) -> Item:
    if not isinstance(rec, dict):
        raise TaskError(f"{where}: expected a JSON object")
    if "correct_answer" in rec:  # SciQ
        missing = [k for k in ("question", "distractor1", "distractor2", "distractor3") if k not in rec]
        if missing:
            raise TaskError(f"{where}: SciQ item without {', '.join(missing)}")
        support = rec.get("support") or ""
        return Item(str(rec.get("id", where)), rec["question"],
                    [rec["distractor1"], rec["distractor2"], rec["distractor3"], rec["correct_answer"]], 3,
                    f"{support.strip()}\n" if support.strip() else "")
    if isinstance(rec.get("question"), dict):  # ARC
        q = rec["question"]
        if "stem" not in q or "choices" not in q or "answerKey" not in rec:
            raise TaskError(f"{where}: ARC item needs question.stem, question.choices and answerKey")
        labels = [str(c.get("label")) for c in q["choices"]]
        if str(rec["answerKey"]) not in labels:
            raise TaskError(f"{where}: answerKey {rec['answerKey']!r} is not one of the labels {labels}")
        return Item(str(rec.get("id", where)), q["stem"], [c["text"] for c in q["choices"]],
                    labels.index(str(rec["answerKey"])))
    missing = [k for k in ("question", "choices", "answer") if k not in rec]
    if missing:
        raise TaskError(f"{where}: missing field(s) {', '.join(missing)} (need question, choices, answer)")
    choices = rec["choices"]
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise TaskError(f"{where}: choices must be a list of at least two non-empty strings")
    answer = rec["answer"]
    if isinstance(answer, str) and len(answer) == 1 and answer.isalpha():
        answer = ord(answer.upper()) - ord("A")
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise TaskError(f"{where}: answer {rec['answer']!r} is out of range for {len(choices)} choices "
                        f"(an index 0..{len(choices) - 1} or a letter)")
    return Item(str(rec.get("id", where)), str(rec["question"]), list(choices), answer)


def load_task(name_or_path: str | Path) -> tuple[str, list[Item]]:
    """(task name, items) from a built-in name or a JSONL file."""
    path = BUILTIN.get(str(name_or_path), Path(name_or_path))
    name = str(name_or_path) if str(name_or_path) in BUILTIN else path.stem
    if not path.is_file():
        raise TaskError(f"task {name_or_path!r}: no such file (built-in tasks: {', '.join(BUILTIN)})")
    items = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskError(f"{where}: not valid JSON ({err.msg})") from None
            items.append(_item(rec, where))
    if not items:
        raise TaskError(f"{path}: no items")
    return name, items


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as lm-eval splits them: the continuation's tokens are those of
    the whole text past the context's, and trailing spaces of the context go to the continuation."""
    n_sp = len(context) - len(context.rstrip())
    if n_sp:
        context, continuation = context[:-n_sp], context[-n_sp:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]], max_len: int, device: torch.device,
                   batch_size: int = 32) -> list[tuple[float, bool]]:
    """Summed log-probability of each continuation given its context, and whether greedy decoding
    would produce it; left-truncated to `max_len` tokens. Pairs are batched longest first."""
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        seqs = []
        for i in chunk:
            ctx, cont = pairs[i]
            seqs.append((ctx + cont)[-(max_len + 1):])
        width = max(len(s) for s in seqs) - 1
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            x[row, :len(s) - 1] = torch.tensor(s[:-1])
        logp = F.log_softmax(model(x.to(device)).float(), dim=-1).cpu()
        for row, (i, s) in enumerate(zip(chunk, seqs)):
            n = len(pairs[i][1])
            pos = torch.arange(len(s) - 1 - n, len(s) - 1)
            target = torch.tensor(s[-n:])
            lp = logp[row, pos]
            out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
    return out


@dataclass
class TaskResult:
    task: str
    n: int
    acc: float
    acc_norm: float
    chance: float

    def to_dict(self) -> dict:
        return {"task": self.task, "n": self.n, "acc": self.acc, "acc_norm": self.acc_norm, "chance": self.chance}


def score_task(model, tok, name: str, items: list[Item], max_len: int, device: torch.device,
               batch_size: int = 32) -> tuple[TaskResult, list[list[float]]]:
    """acc / acc_norm over the items, and every choice's log-likelihood."""
    pairs, owners = [], []
    for k, it in enumerate(items):
        for c in it.choices:
            pairs.append(encode_pair(tok, it.prompt, " " + c))
            owners.append(k)
    lls = loglikelihoods(model, pairs, max_len, device, batch_size)
    per_item: list[list[float]] = [[] for _ in items]
    for k, (ll, _) in zip(owners, lls):
        per_item[k].append(ll)
    acc = sum(max(range(len(s)), key=s.__getitem__) == it.answer for s, it in zip(per_item, items)) / len(items)
    norm = sum(max(range(len(s)), key=lambda j: s[j] / len(it.choices[j])) == it.answer
               for s, it in zip(per_item, items)) / len(items)
    chance = sum(1 / len(it.choices) for it in items) / len(items)
    return TaskResult(name, len(items), acc, norm, chance), per_item
