"""Bad input, as users type it: every case exits 2 with one line naming the culprit, and leaves an
existing run directory (its config, metrics and checkpoints) exactly as it was.

Each case builds its input (a config pointed at the existing run, a cluster file, a corpus, a task
file, a damaged checkpoint, command-line arguments) and runs the CLI in this process."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from hetforge.cli import main
from hetforge.train import checkpoint as ckpt
from hetforge.train.loop import train
from tests.conftest import tiny_raw

DELETE = object()


@pytest.fixture(scope="module")
def existing(tmp_path_factory, data_dir):
    """A finished little run with two checkpoints: what a mistaken command must not touch."""
    root = tmp_path_factory.mktemp("existing")
    raw = tiny_raw(root / "run", data_dir, steps=4, checkpoint_interval=2)
    from hetforge.config import build_config

    train(build_config(raw))
    return {"root": root, "raw": raw, "run": root / "run", "ckpt": ckpt.resolve(root / "run")}


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


class Case:
    """`argv(ctx)` -> the command line; `culprit`: what the one line must name."""

    def __init__(self, argv, culprit: str):
        self.argv, self.culprit = argv, culprit


def cfg_with(ctx, changes: dict | None = None, text: str | None = None, name: str = "cfg.yaml") -> str:
    """A config file: the existing run's, with dotted-key changes (DELETE removes a key), or raw text."""
    path = ctx["tmp"] / name
    if text is not None:
        path.write_text(text)
        return str(path)
    raw = copy.deepcopy(ctx["raw"])
    for key, value in (changes or {}).items():
        node, parts = raw, key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def write(ctx, name: str, text: str | bytes) -> str:
    path = ctx["tmp"] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def damaged_checkpoint(ctx, how: str) -> str:
    dst = ctx["tmp"] / f"ckpt-{how}"
    shutil.copytree(ctx["ckpt"], dst)
    if how == "flipped":
        weights = next((dst / "dcp").glob("*.distcp"))
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif how == "reshaped":  # state.json claims another shape; manifest rewritten so that it verifies
        state = json.loads((dst / "state.json").read_text())
        state["model_config"]["d_model"] = 96
        (dst / "state.json").write_text(json.dumps(state))
        ckpt.write_manifest(dst, int(state["step"]))
    elif how == "no-state":
        (dst / "state.json").unlink()
        ckpt.write_manifest(dst, 4)
    return str(dst)


def cluster(ctx, text: str) -> str:
    return write(ctx, "cluster.yaml", text)


CPU2 = "nodes:\n  - host: localhost\n    devices:\n      - {type: cpu, count: 2, memory_gb: 4}\n"

CASES = {
    # ---- run config fields
    "unknown top-level key": Case(lambda c: ["train", cfg_with(c, {"trian": {"steps": 3}})], "trian"),
    "unknown nested key": Case(lambda c: ["train", cfg_with(c, {"train.stesp": 3})], "train.stesp"),
    "wrong type": Case(lambda c: ["train", cfg_with(c, {"train.steps": "ten"})], "train.steps"),
    "zero steps": Case(lambda c: ["train", cfg_with(c, {"train.steps": 0})], "train.steps"),
    "heads do not divide width": Case(lambda c: ["train", cfg_with(c, {"model.n_heads": 5})], "n_heads"),
    "unknown preset": Case(lambda c: ["train", cfg_with(c, {"model.preset": "gpt5"})], "preset"),
    "unknown precision": Case(lambda c: ["train", cfg_with(c, {"train.precision": "fp8"})], "train.precision"),
    "batch not a multiple of seq_len": Case(
        lambda c: ["train", cfg_with(c, {"train.global_batch_tokens": 100})], "global_batch_tokens"),
    "warmup as long as the run": Case(lambda c: ["train", cfg_with(c, {"train.warmup_steps": 4})], "warmup_steps"),
    "keep_checkpoints 1": Case(lambda c: ["train", cfg_with(c, {"train.keep_checkpoints": 1})], "keep_checkpoints"),
    "unreadable budget": Case(lambda c: ["train", cfg_with(c, {"memory.budget": "lots"})], "memory.budget"),
    "infinite budget": Case(lambda c: ["train", cfg_with(c, {"memory.budget": "1e400"})], "memory.budget"),
    "zero budget": Case(lambda c: ["train", cfg_with(c, {"memory.budget": 0})], "memory.budget"),
    "blank budget": Case(lambda c: ["train", cfg_with(c, text=yaml.safe_dump(c["raw"]) + "memory:\n  budget:\n")],
                         "memory.budget"),
    "unknown memory strategy": Case(lambda c: ["train", cfg_with(c, {"memory.strategy": "magic"})], "memory.strategy"),
    "not YAML": Case(lambda c: ["train", cfg_with(c, text="train: {steps: 3\nmodel: [")], "line"),
    "top level a list": Case(lambda c: ["train", cfg_with(c, text="- train\n- model\n")], "top level"),
    "config file missing": Case(lambda c: ["train", str(c["tmp"] / "nope.yaml")], "nope.yaml"),
    "config not UTF-8": Case(lambda c: ["train", write(c, "latin.yaml", "name: caf\xe9\n".encode("latin-1"))],
                             "latin.yaml"),
    "--set without =": Case(lambda c: ["train", cfg_with(c), "--set", "train.steps"], "--set"),
    "--set bad index": Case(lambda c: ["train", cfg_with(c), "--set", "data.sources.5.path=x"], "data.sources"),
    "--set blank value": Case(lambda c: ["train", cfg_with(c), "--set", "memory.budget="], "memory.budget"),
    "--set unknown key": Case(lambda c: ["train", cfg_with(c), "--set", "train.lr_max=1"], "train.lr_max"),
    "fixed balance without assignments": Case(
        lambda c: ["train", cfg_with(c, {"cluster.balance": "fixed"})], "cluster.assignments"),
    "assignments not summing to the batch": Case(
        lambda c: ["train", cfg_with(c, {"cluster.balance": "fixed", "cluster.assignments": [
            {"samples": 1, "micro_batch_size": 1}, {"samples": 1, "micro_batch_size": 1}]})], "cluster.assignments"),
    "cluster file and nodes both": Case(
        lambda c: ["train", cfg_with(c, {"cluster.file": cluster(c, CPU2), "cluster.nodes": [{"host": "a"}]})],
        "cluster.nodes or cluster.file"),
    "vocab smaller than the tokenizer's": Case(
        lambda c: ["train", cfg_with(c, {"model.vocab_size": 300})], "model.vocab_size"),
    "cuda without CUDA": Case(lambda c: ["train", cfg_with(c, {"train.device": "cuda"})], "train.device"),
    "another model on an existing run": Case(lambda c: ["train", cfg_with(c, {"model.n_layers": 3})],
                                            "different model config"),
    "--resume with nothing to resume": Case(
        lambda c: ["train", cfg_with(c, {"run_dir": str(c["tmp"] / "fresh")}), "--resume"], "--resume"),
    "seq_len longer than the data": Case(
        lambda c: ["train", cfg_with(c, {"train.seq_len": 10_000_000})], "seq_len"),
    # ---- corpus
    "corpus path missing": Case(
        lambda c: ["prepare", cfg_with(c, {"data.sources": [{"path": str(c["tmp"] / "gone")}],
                                           "data.out_dir": str(c["tmp"] / "d")})], "gone"),
    "path source without path": Case(lambda c: ["prepare", cfg_with(c, {"data.sources": [{"type": "path"}]})],
                                     "path"),
    "corpus with nothing readable": Case(
        lambda c: ["prepare", cfg_with(c, {"data.sources": [{"path": write(c, "junk/a.bin.txt", b"\x00" * 100)}],
                                           "data.out_dir": str(c["tmp"] / "d2")})], "a.bin.txt"),
    "tokenizer file missing": Case(
        lambda c: ["prepare", cfg_with(c, {"data.tokenizer.path": str(c["tmp"] / "tok.json"),
                                           "data.out_dir": str(c["tmp"] / "d3")})], "tok.json"),
    # ---- cluster files
    "cluster file missing": Case(lambda c: ["train", cfg_with(c, {"cluster.file": str(c["tmp"] / "c.yaml")})],
                                 "c.yaml"),
    "cluster file empty": Case(lambda c: ["size", "--gpu-hours", "10", "--cluster", cluster(c, "")], "empty"),
    "cluster file without nodes": Case(
        lambda c: ["size", "--gpu-hours", "10", "--cluster", cluster(c, "devices: [{type: V100}]\n")], "nodes"),
    "cluster file misspelt nodes": Case(
        lambda c: ["plan", cfg_with(c), "--cluster", cluster(c, CPU2.replace("nodes", "node"))], "nodes"),
    "cluster file empty nodes": Case(lambda c: ["size", "--gpu-hours", "1", "--cluster", cluster(c, "nodes: []\n")],
                                     "nodes"),
    "unknown device type": Case(
        lambda c: ["train", cfg_with(c, {"cluster.file": cluster(c, CPU2.replace("cpu", "V1OO"))})], "V1OO"),
    "negative memory": Case(lambda c: ["size", "--gpu-hours", "1", "--cluster", cluster(
        c, "nodes:\n  - devices:\n      - {type: V100, memory_gb: -16}\n")], "memory_gb"),
    "zero count": Case(lambda c: ["size", "--gpu-hours", "1", "--cluster", cluster(
        c, "nodes:\n  - devices:\n      - {type: V100, count: 0}\n")], "count"),
    "blank memory_gb": Case(lambda c: ["size", "--gpu-hours", "1", "--cluster", cluster(
        c, "nodes:\n  - devices:\n      - type: V100\n        memory_gb:\n")], "memory_gb"),
    "node without devices": Case(lambda c: ["size", "--gpu-hours", "1", "--cluster", cluster(
        c, "nodes:\n  - host: a\n    devices: []\n")], "devices"),
    "extra key in a cluster file": Case(lambda c: ["size", "--gpu-hours", "1", "--cluster", cluster(
        c, CPU2 + "balance: auto\n")], "balance"),
    # ---- planner and other CLI arguments
    "plan --budget infinite": Case(lambda c: ["plan", cfg_with(c), "--budget", "1e400"], "memory.budget"),
    "plan --budget unit": Case(lambda c: ["plan", cfg_with(c), "--budget", "12XB"], "memory.budget"),
    "plan --budget below the weights": Case(lambda c: ["plan", cfg_with(c), "--budget", "1KiB"], "budget"),
    "plan --card unknown": Case(lambda c: ["plan", cfg_with(c), "--card", "Z80"], "Z80"),
    "plan --micro-batch not a number": Case(lambda c: ["plan", cfg_with(c), "--micro-batch", "abc"], "--micro-batch"),
    "unknown command": Case(lambda c: ["trian", "x.yaml"], "trian"),
    "size --mfu out of range": Case(lambda c: ["size", "--compute", "1e20", "--mfu", "2"], "--mfu"),
    "size --gpu-hours without hardware": Case(lambda c: ["size", "--gpu-hours", "10"], "--gpu-hours"),
    "size --device unknown": Case(lambda c: ["size", "--gpu-hours", "10", "--device", "Z80"], "Z80"),
    # ---- checkpoints
    "eval of a missing directory": Case(lambda c: ["eval", str(c["tmp"] / "none")], "none"),
    "eval of a corrupt checkpoint": Case(lambda c: ["eval", damaged_checkpoint(c, "flipped")], "corrupt"),
    "generate from weights of another shape": Case(
        lambda c: ["generate", damaged_checkpoint(c, "reshaped"), "--prompt", "x"], "do not fit"),
    "checkpoint without state": Case(lambda c: ["eval", damaged_checkpoint(c, "no-state")], "state.json"),
    "export of a missing directory": Case(lambda c: ["export", str(c["tmp"] / "none"), "--to", "hf",
                                                     str(c["tmp"] / "hf")], "none"),
    "init_from a missing checkpoint": Case(
        lambda c: ["train", cfg_with(c, {"model.init_from": str(c["tmp"] / "base")})], "base"),
    # ---- task files
    "task file missing": Case(lambda c: ["eval", str(c["ckpt"]), "--task", str(c["tmp"] / "t.jsonl")], "t.jsonl"),
    "task file not JSON": Case(lambda c: ["eval", str(c["ckpt"]), "--task", write(c, "bad.jsonl", "{oops\n")],
                               "bad.jsonl"),
    "task item without choices": Case(lambda c: ["eval", str(c["ckpt"]), "--task", write(
        c, "q.jsonl", json.dumps({"question": "why?", "answer": 0}) + "\n")], "q.jsonl"),
    "task answer out of range": Case(lambda c: ["eval", str(c["ckpt"]), "--task", write(
        c, "r.jsonl", json.dumps({"question": "q", "choices": ["a", "b"], "answer": 5}) + "\n")], "answer"),
    # ---- reports and sweeps
    "report of a directory without metrics": Case(lambda c: ["report", str(c["tmp"])], "metrics"),
    "scale fit of a directory without runs": Case(lambda c: ["scale", "fit", str(c["tmp"])], str("runs")),
    "scale sweep with a bad size": Case(lambda c: ["scale", "sweep", cfg_with(c), "--sizes", "2xq",
                                                   "--tokens", "1k", "--print-commands"], "2xq"),
    "scale sweep --out onto a file": Case(lambda c: ["scale", "sweep", cfg_with(c), "--sizes", "2x64", "--tokens",
                                                     "1k", "--out", write(c, "f.txt", "x")], "is a file"),
    "scale fit --out onto a directory": Case(lambda c: ["scale", "fit", str(c["run"].parent), "--out", str(c["tmp"])],
                                             "is a directory"),
    # ---- numbers and paths given on the command line
    "empty config file": Case(lambda c: ["train", write(c, "empty.yaml", "")], "empty.yaml"),
    "generate --max-new-tokens -1": Case(lambda c: ["generate", str(c["ckpt"]), "--prompt", "x",
                                                    "--max-new-tokens", "-1"], "--max-new-tokens"),
    "generate --temperature -1": Case(lambda c: ["generate", str(c["ckpt"]), "--prompt", "x", "--temperature", "-1"],
                                      "--temperature"),
    "generate --top-k 0": Case(lambda c: ["generate", str(c["ckpt"]), "--prompt", "x", "--top-k", "0"], "--top-k"),
    "eval --batch-size 0": Case(lambda c: ["eval", str(c["ckpt"]), "--batch-size", "0"], "--batch-size"),
    "eval --max-batches nan": Case(lambda c: ["eval", str(c["ckpt"]), "--max-batches", "nan"], "--max-batches"),
    "train --stop-after 0": Case(lambda c: ["train", cfg_with(c), "--stop-after", "0"], "--stop-after"),
    "prepare --workers 0": Case(lambda c: ["prepare", cfg_with(c), "--workers", "0"], "--workers"),
    "plan --micro-batch -2": Case(lambda c: ["plan", cfg_with(c), "--micro-batch", "-2"], "--micro-batch"),
    "size --compute negative": Case(lambda c: ["size", "--compute", "-1e20"], "--compute"),
    "size --seq 0": Case(lambda c: ["size", "--compute", "1e20", "--seq", "0"], "--seq"),
    "scale fit --bootstrap -1": Case(lambda c: ["scale", "fit", str(c["tmp"]), "--bootstrap", "-1"], "--bootstrap"),
    "export onto a file": Case(lambda c: ["export", str(c["ckpt"]), "--to", "hf", write(c, "model.txt", "x")],
                               "is a file"),
    "plan --out onto a file": Case(lambda c: ["plan", cfg_with(c), "--out", write(c, "p.txt", "x")], "is a file"),
    "eval of an imported model without --data": Case(lambda c: ["eval", imported(c)], "--data"),
    "eval --data that is not prepared": Case(lambda c: ["eval", str(c["ckpt"]), "--data", str(c["tmp"])], "--data"),
}


def imported(ctx) -> str:
    """A checkpoint as `export --from hf` writes it: weights, shape and tokenizer, no data split."""
    dst = ctx["tmp"] / "imported"
    shutil.copytree(ctx["ckpt"], dst)
    state = json.loads((dst / "state.json").read_text())
    for key in ("data_dir", "data_fingerprint"):
        state.pop(key, None)
    (dst / "state.json").write_text(json.dumps(state))
    ckpt.write_manifest(dst, int(state["step"]))
    return str(dst)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_changes_nothing(name, existing, tmp_path, capsys, monkeypatch):
    case = CASES[name]
    monkeypatch.chdir(tmp_path)
    before = tree_digest(existing["run"])
    argv = case.argv({**existing, "tmp": tmp_path})
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        rc = exit_.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.culprit in lines[0], lines[0]
    assert "Traceback" not in err
    assert tree_digest(existing["run"]) == before


def test_the_suite_is_as_broad_as_promised():
    assert len(CASES) >= 60
