import pytest

from hetforge.config import ConfigError, apply_overrides, build_config, load_config


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"train\.stpes: unknown key"):
        build_config({"train": {"stpes": 10}})


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError, match=r"train\.steps: .*integer.*'many'"):
        build_config({"train": {"steps": "many"}})


def test_heads_must_divide_width():
    with pytest.raises(ConfigError, match=r"model\.n_heads must divide model\.d_model \(got n_heads=3 and d_model=100\)"):
        build_config({"model": {"preset": None, "n_layers": 2, "d_model": 100, "n_heads": 3}})


def test_unknown_preset_lists_allowed():
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'.*forge-s"):
        build_config({"model": {"preset": "huge"}})


def test_literal_field_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"train\.precision: .*'fp32'.*'bf16'.*'fp16'.*'auto'"):
        build_config({"train": {"precision": "fp8"}})


def test_overrides_are_typed_like_yaml():
    raw = apply_overrides({"train": {"steps": 1}}, ["train.steps=50", "train.lr=1e-3", "model.tie_embeddings=true",
                                                     "name=my-run"])
    cfg = build_config(raw)
    assert cfg.train.steps == 50 and cfg.train.lr == pytest.approx(1e-3)
    assert cfg.model.tie_embeddings is True and cfg.name == "my-run"


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["train.steps"])


def test_preset_fills_fields_and_explicit_fields_win():
    cfg = build_config({"model": {"preset": "forge-s", "n_layers": 2}})
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads) == (2, 2064, 24)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_validate():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)


def test_override_list_item_and_bad_paths():
    raw = {"data": {"sources": [{"type": "path", "path": "a"}]}}
    assert apply_overrides(raw, ["data.sources.0.path=b"])["data"]["sources"][0]["path"] == "b"
    with pytest.raises(ConfigError, match="not an index"):
        apply_overrides(raw, ["data.sources.3.path=b"])
    with pytest.raises(ConfigError, match="'steps' is not a section"):
        apply_overrides({"train": {"steps": 1}}, ["train.steps.x=1"])


@pytest.mark.parametrize("parallel,message", [
    ({"strategy": "zero1", "accumulation": "unsharded"}, "applies to zero2 and fsdp, not zero1"),
    ({"strategy": "fsdp", "accumulation": "unsharded", "offload": "params"}, "one or the other"),
    ({"strategy": "fsdp", "accumulation": "unsharded", "reshard_after_forward": True}, "gather them again"),
])
def test_accumulation_unsharded_is_refused_where_it_cannot_hold(parallel, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"parallel": parallel})
    assert build_config({"parallel": {"strategy": "fsdp", "accumulation": "unsharded"}}).parallel.may_accumulate_unsharded()
    assert not build_config({"parallel": {"strategy": "fsdp", "offload": "params"}}).parallel.may_accumulate_unsharded()
