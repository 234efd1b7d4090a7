"""Padding the head size (model.pad_head_dim) is exact, and is chosen only where it buys a kernel."""

import pytest
import torch

from hetforge.core.hardware import DEVICES, Capability, lookup, padded_head_dim, sdpa_backend
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig, set_head_padding


@pytest.mark.parametrize("padded", [16, 24])
def test_padded_attention_gives_the_same_logits_and_gradients(padded):
    """Head size 15 (d_model 60, 4 heads, rotary on 2 of its channels) run at 16 and at 24."""
    cfg = GPTNeoXConfig(n_layers=2, d_model=60, n_heads=4, d_ff=120, vocab_size=97, rotary_pct=0.25)
    torch.manual_seed(0)
    plain = GPTNeoX(cfg)
    padded_model = GPTNeoX(cfg)
    padded_model.load_state_dict(plain.state_dict())
    set_head_padding(padded_model, padded)
    x = torch.randint(0, cfg.vocab_size, (3, 21))
    outs = []
    for m in (plain, padded_model):
        logits = m(x)
        logits.float().square().mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-7, msg=n)
    assert set(padded_model.state_dict()) == set(plain.state_dict())  # checkpoints do not know of it


def test_auto_pads_only_where_a_fused_kernel_then_applies():
    cpu = Capability("cpu", "cpu", None, None, bf16=False, fast_fp16=False)
    a100, v100, p100, k80 = (lookup(n) for n in ("A100-40GB", "V100", "P100", "K80"))
    assert padded_head_dim(a100, "bf16", 86) == 88 and sdpa_backend(a100, "bf16", 88) == "flash"
    assert padded_head_dim(v100, "fp16", 86) == 88 and sdpa_backend(v100, "fp16", 88) == "mem-efficient"
    assert padded_head_dim(p100, "fp16", 86) == 88
    assert padded_head_dim(k80, "fp32", 86) == 86  # compute capability 3.7: no fused kernel at any size
    assert padded_head_dim(a100, "fp32", 86) == 88  # fp32 needs a multiple of 4 for mem-efficient
    assert padded_head_dim(a100, "bf16", 64) == 64  # aligned already
    assert padded_head_dim(cpu, "fp32", 86) == 86
    assert padded_head_dim(a100, "bf16", 86, "off") == 86 and padded_head_dim(cpu, "fp32", 86, 96) == 96
    with pytest.raises(ValueError, match="smaller than the head size"):
        padded_head_dim(a100, "bf16", 86, 80)
    for card in DEVICES:  # padding never makes a kernel worse
        for prec in ("fp32", "fp16", "bf16"):
            p = padded_head_dim(card, prec, 86)
            assert p in (86, 88) and (p == 86 or sdpa_backend(card, prec, p) != "math")


def test_the_analytic_profile_counts_the_attention_matrix_only_without_padding():
    from hetforge.memory.analytic import analytic_profile
    from hetforge.model.presets import PRESETS

    odd = GPTNeoXConfig(n_layers=2, d_model=15 * 66, n_heads=15, d_ff=4 * 15 * 66, vocab_size=512)
    assert odd.head_dim == 66 and PRESETS["forge-s"].head_dim == 86  # 66: not aligned
    a100 = lookup("A100-40GB")
    auto = analytic_profile(odd, 1, 2048, a100)
    off = analytic_profile(odd, 1, 2048, a100, pad_head_dim="off")
    assert (auto.meta["head_dim"], auto.meta["attention"]) == (72, "flash")
    assert (off.meta["head_dim"], off.meta["attention"]) == (66, "math")
    probs = 1 * 15 * 2048 * 2048 * 2
    sdpa = {u.name: u.bytes for u in off.blocks[0].units}["attn.sdpa"] - \
        {u.name: u.bytes for u in auto.blocks[0].units}["attn.sdpa"]
    # the padded run's own output is wider by its zero channels: a fraction of the matrix
    assert sdpa == pytest.approx(probs, rel=0.01) and sdpa < probs
