"""Model families as plug-ins (issue 19): the rest of attune asks the family and never compares its name, and a
family defined in one module (here: in the test) is read, counted, checked, launched, built and estimated with no
other file touched."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from attune.errors import ModelError
from attune.estimator import estimate
from attune.runners.slime.launch import LaunchError, model_args
from attune.spec import family_registry
from attune.spec.engine import get_engine
from attune.spec.family_registry import Family, moe_family_names, names, register
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec, bundled_names, from_hf_config, load_model
from attune.spec.rules import check, layout_string_refusal

ROOT = Path(__file__).resolve().parents[1]
FAMILY_DIR = ROOT / "attune" / "spec" / "families"


def _family_words() -> set[str]:
    return set(names()) | set(moe_family_names())


def _strings(node: ast.AST) -> list[str]:
    """The string literals of a comparison operand: a str constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _names_family(node: ast.AST) -> bool:
    leaf = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "family" in leaf.lower()


def family_comparisons(source: str, words: set[str]) -> list[int]:
    """Lines comparing a model family by its name: ``x.family == "..."`` / ``in (...)`` against string literals,
    or any comparison with a literal that is a registered family name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = [s for o in operands for s in _strings(o)]
        if (literals and any(_names_family(o) for o in operands)) or set(literals) & words:
            out.append(node.lineno)
    return out


def test_the_scanner_finds_family_comparisons():
    words = {"qwen3_5", "gpt2"}
    assert family_comparisons('if model.family == "qwen3_5":\n    pass\n', words) == [1]
    assert family_comparisons('x = m.moe.family in ("a", "b")\n', words) == [1]
    assert family_comparisons('x = kind != "gpt2"\n', words) == [1]
    assert family_comparisons('x = m.traits.linear_biases\ny = mt == "qwen2"\n', words) == []


def test_no_family_name_comparisons_outside_the_family_modules():
    words = _family_words()
    offenders = []
    for path in sorted((ROOT / "attune").rglob("*.py")):
        if FAMILY_DIR in path.parents:
            continue
        for line in family_comparisons(path.read_text(), words):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, "compare the family's traits, not its name: " + ", ".join(offenders)


def test_every_bundled_model_has_a_family_module_and_every_family_a_bundled_model():
    families = {load_model(n).family for n in bundled_names()}
    assert families == set(names())
    modules = {p.stem for p in FAMILY_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert modules == set(names())  # one module per family, named as the family, found without a list to edit


def test_traits_replace_the_old_name_checks():
    q, g, llama = load_model("tiny-qwen3.5"), load_model("tiny-gpt2"), load_model("tiny-llama")
    assert q.traits.zero_centred_norm and not g.traits.zero_centred_norm and not llama.traits.zero_centred_norm
    assert g.traits.linear_biases and not q.traits.linear_biases
    assert q.traits.crosscheck_refusal and not llama.traits.crosscheck_refusal
    assert layout_string_refusal(q, get_engine("slime")) and layout_string_refusal(q, get_engine("megatron")) is None
    assert layout_string_refusal(llama, get_engine("slime")) is None
    with pytest.raises(LaunchError, match="gpt_oss is not written.*; allowed families: .*glm4_moe.*qwen3_5$"):
        model_args(load_model("GPT-OSS-20B"))  # the families with a launch, from the registry


def test_an_unregistered_family_is_one_line():
    q = load_model("tiny-llama")
    fields = {f: getattr(q, f) for f in q.__dataclass_fields__}
    with pytest.raises(ModelError, match="model family 'bert' is not registered; allowed: .*llama"):
        ModelSpec(**{**fields, "family": "bert"})
    with pytest.raises(ModelError, match="mixture-of-experts model_type 'olmoe'.*glm4_moe.*qwen3_moe"):
        from_hf_config({"model_type": "olmoe", "num_experts": 64})
    with pytest.raises(ModelError, match="mixture-of-experts model_type 'llama'"):
        from_hf_config({"model_type": "llama", "num_experts": 8})


# ---------------------------------------------------------------------- a family added in one module
TOY_CFG = {"model_type": "toy_biased", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def _toy_read(cfg: dict, where: str) -> dict:
    heads = cfg["num_attention_heads"]
    return dict(num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], ffn=cfg["intermediate_size"],
                heads=heads, kv_heads=cfg["num_key_value_heads"], head_dim=cfg["hidden_size"] // heads,
                vocab=cfg["vocab_size"], tied_embeddings=False, mlp="gelu", attn_bias=True)


def _toy_rules(layout, model, engine) -> list[str]:
    return [f"toy: TP {layout.tp} must be 1"] if layout.tp > 1 else []


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setattr(family_registry, "_REGISTRY", dict(family_registry._REGISTRY))
    return register(Family(name="toy_biased", hf_types=("toy_biased",), read=_toy_read,
                           model_args=lambda m: ["--num-layers", str(m.num_layers), "--toy"], source="this test",
                           linear_biases=True, zero_centred_norm=True, layout_rules=_toy_rules,
                           layout_string_refusal=lambda engine: "toy: no layout strings"))


def test_a_family_defined_in_one_module_works_everywhere(toy_family):
    pytest.importorskip("torch")
    from attune.torchmodels.modules import RMSNorm, build_model  # noqa: PLC0415 - torch is optional

    m = from_hf_config(dict(TOY_CFG), name="toy")
    assert m.family == "toy_biased" and m.traits is toy_family
    # every linear has a bias (the trait), so the count includes the attention output and both MLP biases
    h, f, q, kv = 64, 128, 64, 32
    per_layer = (h * q + 2 * h * kv + q * h) + (q + 2 * kv + h) + 2 * h * f + (f + h) + 2 * h
    assert m.total_params == 4 * per_layer + 2 * 256 * h + h
    built = build_model(m, device="meta", seed=None)
    assert sum(p.numel() for p in built.parameters()) == m.total_params
    norms = [x for x in built.modules() if isinstance(x, RMSNorm)]
    assert len(norms) == 2 * 4 + 1 and all(x.zero_centered for x in norms)  # the zero-centred trait
    assert built.layers[0].mixer.o_proj.bias is not None and built.layers[0].mlp.up_proj.bias is not None
    assert model_args(m) == ["--num-layers", "4", "--toy"]
    cl, wl = parse_cluster("2xH100"), Workload(seq_length=1024, global_batch=8)
    tp2 = Layout(tp=2, pp=1, dp=1, sp=True)
    assert "toy: TP 2 must be 1" in check(tp2, m, 2, wl, get_engine("megatron"))
    assert layout_string_refusal(m, get_engine("megatron")) == "toy: no layout strings"
    est = estimate(m, cl, Layout(tp=1, pp=1, dp=2), wl, get_engine("megatron"))
    assert est.fits and est.perf.tokens_per_s_per_gpu > 0
