"""Multiple choice, scored as lm-evaluation-harness scores it.

Each choice is a continuation of its context after one space; its score is the summed
log-probability of its tokens. `acc` takes the best score, `acc_norm` the best score divided by the
choice's length in characters (lm-eval's normalisation, which keeps long answers from losing for
their length alone). Standard errors are lm-eval's: the sample standard deviation over sqrt(n), and
for a group the pooled one, its mean weighted by task size.

Task files are JSONL in one of three forms, detected per line: hetforge's own {question, choices,
answer} (answer an index or a letter), SciQ's {question, distractor1..3, correct_answer, support},
and ARC's {question: {stem, choices: [{text, label}]}, answerKey}; they are prompted
"Question: <question>\nAnswer:" (SciQ's support passage first, as lm-eval's SciQ does). `sci_mc`
names the smoke-test set shipped with hetforge: 60 questions written for it, not a benchmark.
The benchmarks the field reports are in `benchmarks`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hetforge.core.errors import HetforgeError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
BUILTIN = {"sci_mc": TASKS_DIR / "sci_mc.jsonl", "sci-mc": TASKS_DIR / "sci_mc.jsonl"}


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
        return Item(str(rec.get("id", where)), rec["question"],
                    [rec["distractor1"], rec["distractor2"], rec["distractor3"], rec["correct_answer"]], 3,
                    f"{(rec.get('support') or '').lstrip()}\n")
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
    name = str(name_or_path).replace("-", "_") if str(name_or_path) in BUILTIN else path.stem
    if not path.is_file():
        raise TaskError(f"task {name_or_path!r}: no such file")
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
        rows, positions, targets, counts = [], [], [], []
        for row, (i, s) in enumerate(zip(chunk, seqs)):
            n = min(len(pairs[i][1]), len(s) - 1)  # a continuation longer than the window: its last part
            rows += [row] * n
            positions += range(len(s) - 1 - n, len(s) - 1)
            targets += s[-n:]
            counts.append(n)
        logits = model(x.to(device))
        # only the continuation's positions: the softmax over the vocabulary is most of the work
        picked = logits[torch.tensor(rows, device=logits.device), torch.tensor(positions, device=logits.device)]
        logp = F.log_softmax(picked.float(), dim=-1).cpu()
        target = torch.tensor(targets)
        token_lp = logp.gather(-1, target[:, None])[:, 0]
        greedy = logp.argmax(-1) == target
        at = 0
        for i, n in zip(chunk, counts):
            out[i] = (float(token_lp[at:at + n].sum()), bool(greedy[at:at + n].all()))
            at += n
    return out


@dataclass(frozen=True)
class Prompted:
    """One question as the model sees it: the whole context (any description and shots included),
    the choices (each scored as " " + choice), and the gold index."""

    context: str
    choices: list[str]
    gold: int


@dataclass
class TaskScore:
    """A task's scores as lm-eval reports them; acc_norm is None where the task does not report it
    (MMLU)."""

    task: str
    n: int
    acc: float
    acc_stderr: float | None
    acc_norm: float | None
    acc_norm_stderr: float | None
    chance: float
    shots: int = 0
    split: str = ""
    members: tuple[str, ...] = ()  # a group's tasks

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()
                if not (k == "members" and not v)}


def mean_stderr(hits: list[float]) -> float | None:
    """lm-eval's standard error of a mean: the sample standard deviation over sqrt(n)."""
    n = len(hits)
    if n < 2:
        return None
    mu = sum(hits) / n
    return math.sqrt(sum((x - mu) ** 2 for x in hits) / (n - 1)) / math.sqrt(n)


def pooled_stderr(stderrs: list[float | None], sizes: list[int]) -> float | None:
    """lm-eval's standard error of a group's size-weighted mean (pooled sample variance)."""
    if any(s is None for s in stderrs) or sum(sizes) <= len(sizes):
        return None
    var = sum((n - 1) * se ** 2 * n for n, se in zip(sizes, stderrs)) / (sum(sizes) - len(sizes))
    return math.sqrt(var / sum(sizes))


def encode_prompted(tok, prompted: list[Prompted]) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Every (context, " " + choice) pair's token ids, and the question each belongs to."""
    pairs, owners = [], []
    for k, p in enumerate(prompted):
        for c in p.choices:
            pairs.append(encode_pair(tok, p.context, " " + c))
            owners.append(k)
    return pairs, owners


def score_prompted(model, tok, name: str, prompted: list[Prompted], max_len: int, device: torch.device,
                   batch_size: int = 32, metrics: tuple[str, ...] = ("acc", "acc_norm"), shots: int = 0,
                   split: str = "") -> tuple[TaskScore, list[list[float]]]:
    """acc (and acc_norm) with standard errors over the questions, and every choice's log-likelihood."""
    pairs, owners = encode_prompted(tok, prompted)
    lls = loglikelihoods(model, pairs, max_len, device, batch_size)
    per_item: list[list[float]] = [[] for _ in prompted]
    for k, (ll, _) in zip(owners, lls):
        per_item[k].append(ll)
    hits = [float(max(range(len(s)), key=s.__getitem__) == p.gold) for s, p in zip(per_item, prompted)]
    norm = [float(max(range(len(s)), key=lambda j: s[j] / len(p.choices[j])) == p.gold)
            for s, p in zip(per_item, prompted)]
    n = len(prompted)
    with_norm = "acc_norm" in metrics
    chance = sum(1 / len(p.choices) for p in prompted) / n
    return TaskScore(name, n, sum(hits) / n, mean_stderr(hits), sum(norm) / n if with_norm else None,
                     mean_stderr(norm) if with_norm else None, chance, shots, split), per_item


def group_score(name: str, scores: list[TaskScore]) -> TaskScore:
    """A group as lm-eval aggregates one: each metric's mean weighted by task size, pooled stderr."""
    sizes = [s.n for s in scores]
    total = sum(sizes)

    def mean(vals):
        return None if any(v is None for v in vals) else sum(v * n for v, n in zip(vals, sizes)) / total

    return TaskScore(name, total, mean([s.acc for s in scores]), pooled_stderr([s.acc_stderr for s in scores], sizes),
                     mean([s.acc_norm for s in scores]), pooled_stderr([s.acc_norm_stderr for s in scores], sizes)
                     if all(s.acc_norm is not None for s in scores) else None,
                     sum(s.chance * n for s, n in zip(scores, sizes)) / total, scores[0].shots,
                     scores[0].split if len({s.split for s in scores}) == 1 else "", tuple(s.task for s in scores))


def score_task(model, tok, name: str, items: list[Item], max_len: int, device: torch.device,
               batch_size: int = 32) -> tuple[TaskScore, list[list[float]]]:
    """A task file's items, zero-shot."""
    return score_prompted(model, tok, name, [Prompted(it.prompt, it.choices, it.answer) for it in items], max_len,
                          device, batch_size)
