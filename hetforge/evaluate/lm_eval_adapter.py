"""lm-evaluation-harness on hetforge checkpoints (`pip install -e '.[eval]'`).

Importing this module registers the model type "hetforge" with lm_eval, so a checkpoint is scored
by the harness's own task machinery; its log-likelihoods come from the same function hetforge's
scorer uses (`multiple_choice.loglikelihoods`). Local JSONL task files become lm_eval tasks through
`task_dir`, which writes one YAML per file. Everything runs offline.

    python -m hetforge.evaluate.lm_eval_adapter --model hetforge \\
        --model_args checkpoint=runs/demo --tasks sci_mc --include_path DIR     # lm_eval's own CLI
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `datasets` reads its cache location when imported: keep its copies of local files out of $HOME
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tempfile.gettempdir()) / "hetforge-hf-datasets"))

import lm_eval  # noqa: E402
import lm_eval.models  # noqa: E402,F401  (the built-in models, before this registration)
import torch  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from hetforge.data.tokenizer import EOT, load_tokenizer  # noqa: E402
from hetforge.evaluate.multiple_choice import TaskScore, encode_pair, load_task, loglikelihoods  # noqa: E402


@register_model("hetforge")
class HetforgeLM(LM):
    """A hetforge checkpoint (or run directory) as an lm_eval model."""

    def __init__(self, checkpoint: str | None = None, device: str = "cpu", batch_size: int | str = 32,
                 model=None, tokenizer=None, max_length: int | None = None, **_):
        super().__init__()
        from hetforge.model.load import load_for_inference

        if model is None:
            if checkpoint is None:
                raise ValueError("model_args needs checkpoint=PATH (a checkpoint or run directory)")
            model, state = load_for_inference(checkpoint, device)
            tokenizer = load_tokenizer(state["tokenizer"])
            max_length = max_length or state["seq_len"]
        self.model, self.tok = model, tokenizer
        self._device = torch.device(device)
        self.max_length = int(max_length or 2048)
        self.batch = int(batch_size) if str(batch_size).isdigit() else 32
        self.eot = tokenizer.token_to_id(EOT)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for r in requests:
            context, continuation = r.args
            if context == "":
                pairs.append(([self.eot], self.tok.encode(continuation, add_special_tokens=False).ids))
            else:
                pairs.append(encode_pair(self.tok, context, continuation))
        return loglikelihoods(self.model, pairs, self.max_length, self._device, self.batch)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-document log-likelihood in windows of the model's length, each token scored once."""
        out = []
        for r in requests:
            ids = self.tok.encode(r.args[0], add_special_tokens=False).ids
            pairs, prev = [], [self.eot]
            for start in range(0, len(ids), self.max_length):
                window = ids[start:start + self.max_length]
                pairs.append((prev[-self.max_length:], window))
                prev = prev + window
            out.append(sum(ll for ll, _ in loglikelihoods(self.model, pairs, self.max_length, self._device, self.batch)))
        return out

    def generate_until(self, requests) -> list[str]:
        from hetforge.evaluate.generate import generate

        out = []
        for r in requests:
            context, kw = r.args
            until = kw.get("until") or []
            ids = self.tok.encode(context, add_special_tokens=False).ids
            new = generate(self.model, ids, int(kw.get("max_gen_toks", 64)), self.max_length, 0.0, None, self.eot, 0)
            text = self.tok.decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
        return out


YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def task_dir(tasks: list[str], root: str | Path | None = None) -> tuple[Path, list[str]]:
    """One lm_eval task per task file (or the sci_mc smoke test), normalised to {prompt, choices,
    answer} with the prompt hetforge's scorer uses."""
    root = Path(root or tempfile.mkdtemp(prefix="hetforge-lm-eval-"))
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for t in tasks:
        name, items = load_task(t)
        name = name.replace("-", "_")
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"prompt": it.prompt, "choices": it.choices, "answer": it.answer}) + "\n"
                                for it in items))
        (root / f"{name}.yaml").write_text(YAML.format(name=name, path=json.dumps(str(data.resolve()))))
        names.append(name)
    return root, names


def harness_scores(results: dict, local: str, task: str, shots: int, split: str) -> TaskScore:
    """One task of `simple_evaluate`'s results as a TaskScore."""
    r = results["results"][local]
    n = results["n-samples"][local]["effective"]

    def num(key):
        v = r.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    chance = 0.0  # the harness does not report it; filled by the caller from hetforge's reading
    return TaskScore(task, n, r["acc,none"], num("acc_stderr,none"), num("acc_norm,none"), num("acc_norm_stderr,none"),
                     chance, shots, split)


def evaluate(lm: HetforgeLM, names: list[str], shots: int = 0, limit: int | None = None) -> list[TaskScore]:
    """Tasks and groups scored by lm_eval.simple_evaluate on the same data hetforge reads (benchmarks
    through the harness's own task definitions, `benchmarks.harness_task_dir`); groups aggregated
    as the harness aggregates them."""
    from lm_eval.tasks import TaskManager

    from hetforge.evaluate.benchmarks import BENCHMARKS, expand, harness_task_dir, prompts
    from hetforge.evaluate.suite import arrange

    root = Path(tempfile.mkdtemp(prefix="hetforge-lm-eval-"))
    entries = expand(names, shots)
    tasks = list(dict.fromkeys(t for _, members in entries for t in members))
    local = harness_task_dir([t for t in tasks if t in BENCHMARKS], root)
    files = [t for t in tasks if t not in BENCHMARKS]
    local.update(zip(files, task_dir(files, root)[1]))
    res = lm_eval.simple_evaluate(model=lm, tasks=[local[t] for t in tasks], num_fewshot=shots, limit=limit,
                                  task_manager=TaskManager(include_path=str(root), include_defaults=False),
                                  random_seed=0)
    done = {}
    for t in tasks:
        b = BENCHMARKS.get(t)
        score = harness_scores(res, local[t], t if b else local[t], shots if b else 0, b.split if b else "")
        got = prompts(b, 0, limit) if b else None
        score.chance = (sum(1 / len(p.choices) for p in got) / len(got)) if got else _file_chance(t, limit)
        done[t] = score
    return arrange(entries, done)


def _file_chance(task: str, limit: int | None) -> float:
    items = load_task(task)[1]
    items = items[:limit] if limit else items
    return sum(1 / len(it.choices) for it in items) / len(items)


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
