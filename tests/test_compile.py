"""Regional torch.compile: the same training within float rounding; decided from the device and
whether a memory plan is active."""

import pytest
import torch

from hetforge.config import ConfigError
from hetforge.core.metrics import read_metrics
from hetforge.train.loop import train
from hetforge.train.parallel import compile_decision


def test_compiled_blocks_train_like_eager_and_the_cold_start_is_logged(make_cfg):
    eager = train(make_cfg("eager", steps=4, compile="off", eval_interval=100))
    compiled = train(make_cfg("compiled", steps=4, compile="on", eval_interval=100))
    for s in eager.losses:
        assert compiled.losses[s] == pytest.approx(eager.losses[s], rel=1e-4)
    events = read_metrics(compiled.run_dir / "metrics.jsonl")["event"]
    assert [e["first_step_s"] > 0 for e in events if e["event"] == "compile"] == [True]


def test_compile_decision():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert compile_decision("auto", gpu, False)[0] and not compile_decision("auto", cpu, False)[0]
    assert not compile_decision("auto", gpu, True)[0]  # a plan is active: off, and said why
    assert compile_decision("on", cpu, False)[0] and not compile_decision("off", gpu, False)[0]
    with pytest.raises(ConfigError, match="train.compile=on"):
        compile_decision("on", gpu, True)
