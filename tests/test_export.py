"""Hugging Face export and import: transformers loads the export offline and computes the same
logits; the import is bitwise the original; a run continues pre-training from it."""

import os
from pathlib import Path

import pytest
import torch

from hetforge.cli import main
from hetforge.export.hf import export_hf, import_hf, rotary_fraction
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.model.load import load_for_inference
from hetforge.train.checkpoint import write_weights_checkpoint
from hetforge.train.loop import train

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
os.environ["HF_HUB_OFFLINE"] = "1"


def _checkpoint(tmp_path, data_dir, name: str, **cfg) -> Path:
    torch.manual_seed(0)
    model = GPTNeoX(GPTNeoXConfig(**{"n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 256, "vocab_size": 512,
                                     **cfg}))
    with torch.no_grad():  # LayerNorms and biases away from their initial 1 / 0, so all of them count
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return write_weights_checkpoint(tmp_path / name, model, {"step": 0, "model_config": model.cfg.to_dict(), "seq_len": 64},
                                    tokenizer=data_dir / "tokenizer.json")


@pytest.mark.parametrize("variant", [
    {},  # parallel residual, untied, rotary 25%
    {"parallel_residual": False, "tie_embeddings": True},
    {"d_model": 344, "n_heads": 4, "d_ff": 1376},  # head 86: 21.5 rotary channels, hetforge rotates 20
])
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, data_dir, variant):
    ckpt = _checkpoint(tmp_path, data_dir, "ckpt", **variant)
    out = export_hf(ckpt, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "GPTNeoXForCausalLM" and tok.eos_token == "<|endoftext|>"
    ours, _ = load_for_inference(ckpt)
    ids = torch.tensor([tok("We propose a model for parsing scientific text.").input_ids] * 2)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4
    # and back: bitwise the original weights
    back, _ = load_for_inference(import_hf(out, tmp_path / "back"))
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_rotary_fraction_gives_the_even_count():
    for head, rot in [(86, 20), (44, 30), (64, 16), (128, 32), (96, 24)]:
        assert int(head * rotary_fraction(head, rot, rot / head)) == rot


def test_continued_pretraining_from_an_import(make_cfg, tmp_path, capsys):
    first = train(make_cfg("first", steps=30, eval_interval=30, checkpoint_interval=30))
    hf_dir, ck_dir = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(first.run_dir), "--to", "hf", str(hf_dir)]) == 0
    assert main(["export", str(hf_dir), "--from", "hf", str(ck_dir)]) == 0
    assert "model.init_from" in capsys.readouterr().out
    fresh = train(make_cfg("fresh", steps=3))
    cont = make_cfg("continued", steps=3)
    cont.model.init_from = str(ck_dir)
    res = train(cont)
    # it starts where the first run ended, not from scratch
    assert res.losses[1] < fresh.losses[1] - 0.5
    assert res.losses[1] == pytest.approx(first.losses[30], abs=0.3)


def test_bad_directories_are_clear_errors(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--from", "hf", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), "--to", "hf", str(tmp_path / "y")]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
