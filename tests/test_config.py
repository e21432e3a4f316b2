"""The geometry defaults and the config.json loader, including what it refuses."""

import json

import pytest

import foldkv as fk

GEMMA4_31B_TEXT = {
    "attention_k_eq_v": True, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
    "global_head_dim": 512, "num_global_key_value_heads": 4, "num_hidden_layers": 60, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def test_defaults_are_gemma4_31b():
    g = fk.GEMMA4_31B
    assert (g.num_q_heads, g.num_kv_heads, g.head_dim, g.group_size) == (32, 4, 512, 8)
    assert (g.rotary_pairs, g.rotary_width, g.num_global_layers, g.num_layers) == (64, 128, 10, 60)
    assert g.rope_theta == 1e6 and g.rms_norm_eps == 1e-6


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "text_config"])
def test_loader_reads_31b(tmp_path, nested):
    cfg = {"text_config": GEMMA4_31B_TEXT, "model_type": "gemma4"} if nested else GEMMA4_31B_TEXT
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = fk.geometry_from_config(tmp_path)  # a model directory
    assert g == fk.GEMMA4_31B
    assert fk.geometry_from_config(tmp_path / "config.json") == fk.GEMMA4_31B


def test_loader_reads_serialized_per_layer_config():
    cfg = dict(GEMMA4_31B_TEXT, per_layer_config={"5": {"head_dim": 512, "num_key_value_heads": 4}})
    del cfg["global_head_dim"], cfg["num_global_key_value_heads"]
    assert fk.geometry_from_config(cfg) == fk.GEMMA4_31B


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_k_eq_v": False}, "attention_k_eq_v"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "proportional"),
        ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.26,
                                                 "rope_theta": 1e6}}}, "rotary width"),
        ({"num_attention_heads": 30}, "multiple"),
        ({"layer_types": ["sliding_attention"] * 60}, "full_attention"),
        ({"per_layer_config": {"5": {"head_dim": 512, "num_key_value_heads": 4},
                               "11": {"head_dim": 256, "num_key_value_heads": 4}}}, "disagree"),
    ],
    ids=["no-k-eq-v", "rope-default", "odd-rotary", "gqa", "no-global", "mixed-heads"],
)
def test_loader_refuses(change, message):
    with pytest.raises(fk.ConfigError, match=message):
        fk.geometry_from_config(dict(GEMMA4_31B_TEXT, **change))


def test_loader_refuses_missing_file(tmp_path):
    with pytest.raises(fk.ConfigError, match="no config.json"):
        fk.geometry_from_config(tmp_path)


def test_resolve_geometry_presets():
    assert fk.resolve_geometry(None) is fk.GEMMA4_31B
    assert fk.resolve_geometry("gemma-4-31b") is fk.GEMMA4_31B
    assert fk.resolve_geometry(GEMMA4_31B_TEXT) == fk.GEMMA4_31B
