"""Fine-tuned heads: the head learns what is learnable, the baselines are what they claim, the
benchmark's test papers stay out of pre-training."""

import json

import numpy as np
import pytest
import torch

from hetforge.cli import main
from hetforge.config import build_config
from hetforge.data.prepare import prepare
from hetforge.evaluate.heads import LABELS, aspect_sentences, held_out, paper_year, train_head
from hetforge.train.loop import train


def test_paper_years():
    assert paper_year("2020.acl-main.33") == 2020
    assert paper_year("E09-1056") == 2009
    assert paper_year("P98-1012") == 1998
    assert paper_year("nonsense") is None


def test_heads_learn_what_is_learnable():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 3
    y = torch.randint(0, 4, (400,), generator=g)
    x = centres[y] + torch.randn(400, 16, generator=g)
    head = train_head(x[:300], y[:300].numpy(), x[300:350], y[300:350].numpy(), "classify", 4)
    from sklearn.metrics import f1_score

    assert f1_score(y[350:].numpy(), head(x[350:]).argmax(1).numpy(), average="macro") > 0.9
    w = torch.randn(16, generator=g)
    t = x @ w + 0.1 * torch.randn(400, generator=g) + 2000.0
    reg = train_head(x[:300], t[:300].numpy(), x[300:350], t[300:350].numpy(), "regress")
    pred = reg(x[350:])[:, 0] * reg.y_std + reg.y_mean
    mae = (pred - t[350:]).abs().mean().item()
    assert mae < 0.2 * (t[350:] - t[:300].mean()).abs().mean().item()


def test_aspect_sentences_cover_every_label():
    texts, sections, labels = aspect_sentences("val")
    assert len(texts) == len(sections) == len(labels) > 500
    assert set(labels) == set(range(len(LABELS)))
    assert set(sections) == {0, 1, 2}


@pytest.mark.slow
def test_test_papers_are_held_out_of_pretraining(tmp_path, data_dir):
    assert held_out({"data_dir": str(data_dir)}) == {"test_papers": 100, "in_pretraining": 0}
    # the control: the same corpus with nothing excluded contains them
    cfg = build_config({"data": {"sources": [{"type": "aclsum", "exclude_splits": []}],
                                 "out_dir": str(tmp_path / "all"), "tokenizer": {"vocab_size": 300}}})
    prepare(cfg.data, progress=False, verbose=False)
    assert held_out({"data_dir": str(tmp_path / "all")})["in_pretraining"] == 100


@pytest.mark.slow
def test_heads_command(make_cfg, capsys):
    res = train(make_cfg("heads", steps=20))
    assert main(["heads", str(res.run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["held_out"] == {"test_papers": 100, "in_pretraining": 0}
    aspects, year = out["tasks"]
    assert aspects["task"] == "aclsum-aspects" and 0 <= aspects["score"] <= 1
    # the majority baseline's macro-F1: one class right, the other three zero
    maj = aspects["baseline_name"].split("(")[1].rstrip(")")
    p = aspects["per_class_f1"]
    assert set(p) == set(LABELS) and maj == "none"
    _, _, labels = aspect_sentences("test")
    share = np.mean(np.array(labels) == 0)
    assert aspects["baseline"] == pytest.approx(2 * share / (1 + share) / 4)
    assert year["task"] == "aclsum-year" and year["score"] > 0 and year["baseline"] > 0
    assert year["n_test"] == 100
