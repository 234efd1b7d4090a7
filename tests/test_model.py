import pytest
import torch

from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from dataclasses import replace

from hetforge.model.accounting import count_parameters
from hetforge.model.presets import PRESETS


def _cfg(**kw) -> GPTNeoXConfig:
    base = dict(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=97)
    return GPTNeoXConfig(**{**base, **kw})


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_formula_on_meta(name, tied):
    cfg = replace(PRESETS[name], tie_embeddings=tied)
    with torch.device("meta"):  # no allocation: forge-l has 22B parameters
        model = GPTNeoX(cfg)
    counts = count_parameters(cfg)
    assert model.num_parameters() == counts["total"]
    assert model.num_parameters(non_embedding=True) == counts["non_embedding"]


def test_forge_sizes_are_the_published_ones():
    def total(name):
        return count_parameters(PRESETS[name])["total"]

    assert total("forge-s") == pytest.approx(1.44e9, rel=0.01)
    assert total("forge-m") == pytest.approx(13e9, rel=0.02)
    assert total("forge-l") == pytest.approx(22.4e9, rel=0.01)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("rotary_pct", [0.0, 0.25, 1.0])
def test_forward_shape_and_causality(parallel, rotary_pct):
    torch.manual_seed(0)
    model = GPTNeoX(_cfg(parallel_residual=parallel, rotary_pct=rotary_pct)).eval()
    x = torch.randint(0, 97, (3, 20))
    logits = model(x)
    assert logits.shape == (3, 20, 97)
    x2 = x.clone()
    x2[:, 15:] = (x2[:, 15:] + 1) % 97  # change the future only
    logits2 = model(x2)
    torch.testing.assert_close(logits[:, :15], logits2[:, :15])
    assert not torch.allclose(logits[:, 15:], logits2[:, 15:])


def test_rotary_makes_attention_order_aware():
    torch.manual_seed(0)
    x = torch.tensor([[3, 7, 11, 13, 17]])
    swapped = torch.tensor([[7, 3, 11, 13, 17]])  # same prefix set, different order
    no_rope = GPTNeoX(_cfg(n_layers=1, rotary_pct=0.0)).eval()
    # one layer without positions sees the prefix as a set: the last output cannot change
    torch.testing.assert_close(no_rope(x)[0, -1], no_rope(swapped)[0, -1])
    rope = GPTNeoX(_cfg(n_layers=1, rotary_pct=1.0)).eval()
    assert not torch.allclose(rope(x)[0, -1], rope(swapped)[0, -1], atol=1e-5)


def test_tied_embeddings_share_storage():
    model = GPTNeoX(_cfg(tie_embeddings=True))
    assert model.embed_out.weight is model.embed_in.weight


def test_odd_rotary_dims_are_rounded_down_to_even():
    assert GPTNeoXConfig(1, 2064, 24, 8256, 100).rotary_dims == 20  # FORGE-s: head_dim 86
