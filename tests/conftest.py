"""Shared fixtures: one small prepared dataset per session, and tiny run configs around it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
if "HETFORGE_CACHE" not in os.environ:  # measured profiles: never into the repository or the user's cache
    import tempfile

    os.environ["HETFORGE_CACHE"] = tempfile.mkdtemp(prefix="hetforge-test-cache-")

from hetforge.config import build_config  # noqa: E402
from hetforge.data.prepare import prepare  # noqa: E402


def tiny_raw(run_dir: Path, data_dir: Path, **train) -> dict:
    return {
        "name": "test",
        "run_dir": str(run_dir),
        "data": {"sources": [{"type": "aclsum"}], "out_dir": str(data_dir), "tokenizer": {"vocab_size": 512}},
        "model": {"preset": None, "n_layers": 2, "d_model": 64, "n_heads": 4},
        "train": {
            "steps": 12, "seq_len": 32, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 2,
            "log_interval": 1, "eval_interval": 6, "eval_batches": 2, "checkpoint_interval": 4,
            "peak_tflops": 1.0, "tensorboard": False, "progress": False, "num_threads": 1, **train,
        },
    }


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data") / "aclsum-512"
    cfg = build_config(tiny_raw(Path("unused"), d))
    prepare(cfg.data, progress=False)
    return d


@pytest.fixture
def make_cfg(tmp_path, data_dir):
    def make(run_name: str = "run", **train):
        return build_config(tiny_raw(tmp_path / run_name, data_dir, **train))

    return make
