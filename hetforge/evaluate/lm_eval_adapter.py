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
from hetforge.evaluate.multiple_choice import encode_pair, load_task, loglikelihoods  # noqa: E402


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
    """One lm_eval task per hetforge task (built-in name or JSONL file, any of its three forms),
    normalised to {prompt, choices, answer} with the prompt hetforge's scorer uses."""
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


def evaluate(lm: HetforgeLM, tasks: list[str]) -> dict[str, dict]:
    """acc / acc_norm per task, through lm_eval.simple_evaluate."""
    from lm_eval.tasks import TaskManager

    root, names = task_dir(tasks)
    res = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=str(root),
                                  include_defaults=False), num_fewshot=0, bootstrap_iters=0, random_seed=0)
    return {k: {"acc": v["acc,none"], "acc_norm": v["acc_norm,none"]} for k, v in res["results"].items()}


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
