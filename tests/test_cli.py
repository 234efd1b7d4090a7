import json
from pathlib import Path

import yaml

from hetforge.cli import main


def _write(tmp_path, cfg) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def test_prepare_train_eval_generate(make_cfg, tmp_path, capsys):
    cfg = make_cfg(steps=6)
    path = _write(tmp_path, cfg)
    assert main(["prepare", str(path)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(["train", str(path), "--set", "train.steps=8"]) == 0
    out = capsys.readouterr().out
    assert "final train loss" in out and "MFU" in out
    assert main(["eval", cfg.run_dir, "--json", "--max-batches", "2"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["checkpoint"].endswith("step_00000008")
    assert res["perplexity"] > 1 and res["bits_per_byte"] > 0 and res["tokens"] == 2 * 16 * 32
    assert main(["generate", cfg.run_dir, "--prompt", "We propose", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("We propose")
    # a finished run is not trained again
    assert main(["train", str(path), "--set", "train.steps=8"]) == 0
    assert "already complete" in capsys.readouterr().out


def test_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 10\n  learning_rate: 0.1\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.learning_rate: unknown key" in err and "Traceback" not in err


def test_missing_corpus_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"sources": [{"path": str(tmp_path / "gone")}],
                                             "out_dir": str(tmp_path / "d")}}))
    assert main(["prepare", str(path)]) == 2
    assert str(tmp_path / "gone") in capsys.readouterr().err


def test_resume_flag_without_checkpoint_is_an_error(make_cfg, tmp_path, capsys):
    path = _write(tmp_path, make_cfg("fresh"))
    assert main(["train", str(path), "--resume"]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
