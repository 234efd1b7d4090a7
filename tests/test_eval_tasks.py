"""Zero-shot multiple choice: the planted answer, the file forms, bad files, and lm-eval agreeing."""

import json
import re

import pytest
import torch

from hetforge.cli import main
from hetforge.config import build_config
from hetforge.data.tokenizer import load_tokenizer
from hetforge.evaluate.multiple_choice import TaskError, load_task, score_task
from hetforge.model.load import load_for_inference
from hetforge.train.loop import train

PLANTED = [
    ("Which gas do green plants release?", ["nitrogen", "oxygen", "argon", "helium"], 1),
    ("What is the unit of force?", ["the newton", "the joule", "the watt", "the pascal"], 0),
    ("Which particle carries negative charge?", ["proton", "neutron", "electron", "photon"], 2),
    ("Which planet is largest?", ["Mars", "Venus", "Mercury", "Jupiter"], 3),
    ("What does DNA store?", ["heat", "genetic information", "light", "charge"], 1),
    ("Which metal is liquid at room temperature?", ["iron", "copper", "mercury", "zinc"], 2),
]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny model trained on nothing but these questions with their right answers."""
    root = tmp_path_factory.mktemp("planted")
    corpus = root / "corpus"
    corpus.mkdir()
    pairs = [f"Question: {q}\nAnswer: {choices[a]}" for q, choices, a in PLANTED]
    for i in range(6):  # every document holds every pair (the split keeps one document for validation)
        (corpus / f"doc{i}.txt").write_text("\n\n".join(pairs[i:] + pairs[:i]) * 3)
    task = root / "planted.jsonl"
    task.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in PLANTED))
    cfg = build_config({
        "run_dir": str(root / "run"),
        "data": {"sources": [{"type": "path", "path": str(corpus)}], "out_dir": str(root / "data"),
                 "tokenizer": {"vocab_size": 300}, "min_chars": 10, "val_fraction": 0.2,
                 "dedup": {"near": {"enabled": False}}},  # the documents are rotations of one another on purpose
        "model": {"preset": None, "n_layers": 2, "d_model": 64, "n_heads": 4},
        "train": {"steps": 150, "seq_len": 64, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 10,
                  "log_interval": 50, "eval_interval": 150, "checkpoint_interval": 150, "final_eval_batches": 2,
                  "tensorboard": False, "progress": False, "peak_tflops": 1.0, "num_threads": 2},
    })
    train(cfg)
    return root / "run", task


@pytest.mark.slow
def test_the_planted_answers_score_100_percent(planted):
    run, task = planted
    model, state = load_for_inference(run)
    tok = load_tokenizer(state["tokenizer"])
    name, items = load_task(task)
    res, lls = score_task(model, tok, name, items, state["seq_len"], torch.device("cpu"))
    assert res.acc == 1.0 and res.acc_norm == 1.0 and res.n == len(PLANTED)
    assert res.chance == 0.25
    # and a wrong key scores zero: the scorer follows the model, not the file
    for it in items:
        it.answer = (it.answer + 1) % 4
    wrong, _ = score_task(model, tok, name, items, state["seq_len"], torch.device("cpu"))
    assert wrong.acc == 0.0


@pytest.mark.slow
def test_lm_eval_adapter_agrees(planted, capsys):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")
    run, task = planted
    got = {}
    for via in ("hetforge", "lm-eval"):
        assert main(["eval", str(run), "--task", str(task), "--task", "sci-mc", "--via", via, "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        got[via] = {r["task"]: (r["acc"], r["acc_norm"], r["acc_stderr"]) for r in out["tasks"]}
    assert got["hetforge"] == got["lm-eval"]
    assert got["lm-eval"]["planted"][:2] == (1.0, 1.0) and set(got["lm-eval"]) == {"planted", "sci_mc"}


def test_sciq_and_arc_forms(tmp_path):
    sciq = tmp_path / "sciq.jsonl"
    sciq.write_text(json.dumps({"question": "What falls?", "distractor1": "a", "distractor2": "b",
                                "distractor3": "c", "correct_answer": "rain", "support": "Rain falls."}) + "\n")
    _, items = load_task(sciq)
    assert items[0].choices[items[0].answer] == "rain" and items[0].prompt.startswith("Rain falls.\nQuestion:")
    arc = tmp_path / "arc.jsonl"
    arc.write_text(json.dumps({"id": "x1", "question": {"stem": "Pick B", "choices": [
        {"text": "one", "label": "A"}, {"text": "two", "label": "B"}]}, "answerKey": "B"}) + "\n")
    _, items = load_task(arc)
    assert items[0].answer == 1 and items[0].id == "x1"
    _, builtin = load_task("sci-mc")
    assert len(builtin) == 60 and all(len(it.choices) == 4 for it in builtin)


@pytest.mark.parametrize("line,message", [
    ({"question": "q", "choices": ["a", "b"]}, "missing field(s) answer"),
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, "out of range for 2 choices"),
    ({"question": "q", "choices": ["a"], "answer": 0}, "at least two"),
    ({"question": {"stem": "q", "choices": [{"text": "a", "label": "A"}]}, "answerKey": "C"}, "not one of the labels"),
])
def test_bad_task_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "ok", "choices": ["a", "b"], "answer": 0})
    path.write_text(good + "\n" + json.dumps(line) + "\n")
    with pytest.raises(TaskError, match=re.escape(message)) as e:
        load_task(path)
    assert f"{path}:2" in str(e.value)


def test_bad_task_from_the_cli_exits_2(planted, tmp_path, capsys):
    run, _ = planted
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    assert main(["eval", str(run), "--task", str(path)]) == 2
    assert f"{path}:1: not valid JSON" in capsys.readouterr().err
    assert main(["eval", str(run), "--tasks", "no-such-task"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown task 'no-such-task'; known: sciq, " in err and "mmlu_sci" in err
