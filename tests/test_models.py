import json

import pytest

from attune.errors import ModelError
from attune.spec.model import FULL, LINEAR, bundled_names, from_geometry, from_hf_config, load_model


def test_qwen36_active_params_exact(qwen):
    assert qwen.active_params == 25_623_920_640
    assert qwen.total_params == 26_895_998_464  # slime-and-qwen.md 3.1
    assert qwen.count_types(0, 64) == (16, 48)
    assert [i for i in range(64) if qwen.layer_type(i) == FULL] == list(range(3, 64, 4))


def test_per_layer_counts_match_reference(qwen):
    assert qwen.full_layer().total == 372_255_232
    assert qwen.gdn_layer().total == 383_273_184
    assert qwen.full_layer().matrix == 372_244_480
    assert qwen.gdn_layer().matrix == 383_262_720


@pytest.mark.parametrize("name,total", [
    ("Llama-3.1-8B", 8_030_261_248), ("Llama-3.1-70B", 70_553_706_496), ("gpt2", 124_439_808)])
def test_known_totals(name, total):
    assert load_model(name).total_params == total


def test_bundled_includes_required():
    names = set(bundled_names())
    assert {"Qwen3.6-27B", "Qwen3.5-27B", "Qwen3.5-4B", "Qwen3.5-0.8B", "Llama-3.1-8B", "Llama-3.1-70B",
            "tiny-qwen3.5", "tiny-llama"} <= names


def test_stage_params_sum_to_total(qwen):
    from attune.spec.layout import Layout
    from attune.spec.placement import stage_params

    lay = Layout(pp=3, first=16, last=14)
    parts = sum(stage_params(qwen, lay, r) for r in range(3))
    assert parts == qwen.total_params


def test_config_path_and_case_insensitive(tmp_path):
    from importlib import resources
    cfg = json.loads(resources.files("attune.spec").joinpath("model_configs", "Llama-3.1-8B.json").read_text())
    p = tmp_path / "mymodel"
    p.mkdir()
    (p / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(p)).active_params == load_model("llama-3.1-8b").active_params


def test_unsupported_family_and_missing_field():
    with pytest.raises(ModelError, match="model_type 'bert'"):
        from_hf_config({"model_type": "bert"})
    with pytest.raises(ModelError, match="'hidden_size'"):
        from_hf_config({"model_type": "llama", "num_attention_heads": 8, "num_hidden_layers": 2})
    with pytest.raises(ModelError, match="mixture-of-experts"):
        from_hf_config({"model_type": "olmoe", "num_experts": 64})  # an MoE family attune does not model
    with pytest.raises(ModelError, match="unknown model"):
        load_model("Qwen9-1T")


def test_layer_types_list_honoured():
    cfg = {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
           "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"]}
    m = from_hf_config(cfg)
    assert [m.layer_type(i) for i in range(4)] == [FULL, LINEAR, LINEAR, FULL]


@pytest.mark.parametrize("name,non_embedding,embedding,tol", [
    # Nemotron-4 15B (arXiv 2402.16819 section 2): 12.5B non-embedding + 3.2B embedding parameters
    ("Nemotron-4-15B", 12.5e9, 3.2e9, 0.02),
    # Nemotron-4 340B (arXiv 2406.11704 section 2.1): 331.6B non-embedding + 9.4B embedding parameters
    ("Nemotron-4-340B", 331.6e9, 9.4e9, 0.005),
])
def test_nemotron_published_counts(name, non_embedding, embedding, tol):
    m = load_model(name)
    emb = m.embedding_params + (0 if m.tied_embeddings else m.output_params)
    assert m.family == "nemotron" and m.mlp == "squared_relu" and m.norm == "layernorm1p"
    assert m.total_params - emb == pytest.approx(non_embedding, rel=tol)
    assert emb == pytest.approx(embedding, rel=0.02)


def test_gpt3_175b_published_count():
    # Brown et al. 2020 (arXiv 2005.14165) Table 2.1: 175.0B parameters
    m = load_model("GPT-3-175B")
    assert m.total_params == pytest.approx(175.0e9, rel=0.005)
    assert m.mlp == "gelu" and m.positions == "learned"


def test_from_geometry_matches_the_configs():
    """The corpus's bare geometry rebuilds the bundled configs' parameter counts exactly."""
    nemo = from_geometry(name="n", layers=32, hidden=6144, ffn=24576, heads=48, kv_heads=8, vocab=256000,
                         mlp="squared_relu")
    assert nemo.total_params == load_model("Nemotron-4-15B").total_params
    gpt = from_geometry(name="g", layers=96, hidden=12288, ffn=49152, heads=96, vocab=50257, mlp="gelu (GPT)",
                        seq_length=2048)
    assert gpt.total_params == load_model("GPT-3-175B").total_params
    layers_only = from_geometry(name="l", layers=2, hidden=64, ffn=256, heads=4, vocab=0, mlp="gelu")
    assert layers_only.embedding_params == 0 and layers_only.output_params == 0
    with pytest.raises(ModelError, match="allowed: swiglu, gelu, squared_relu"):
        from_geometry(name="x", layers=2, hidden=64, ffn=256, heads=4, vocab=10, mlp="geglu")


def test_nemotron_hf_config():
    cfg = {"model_type": "nemotron", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "hidden_act": "relu2"}
    m = from_hf_config(cfg)
    # per layer: q, o 64x64 each, k, v 64x32 each; up and down 64x256; two LayerNorm1p norms of 2 x 64
    assert m.full_layer().total == 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256 + 4 * 64
    with pytest.raises(ModelError, match="relu2"):
        from_hf_config(dict(cfg, hidden_act="silu"))
