import pytest

from attune.spec.model import load_model

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'attune[megatron]'")


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Llama-3.1-70B", "gpt2", "tiny-llama"])
def test_param_counts_match_megatron_core(name):
    from attune.spec.crosscheck import megatron_param_count

    m = load_model(name)
    assert megatron_param_count(m) == m.total_params


def test_hybrid_refused_with_reason():
    from attune.spec.crosscheck import CrossCheckError, megatron_param_count

    with pytest.raises(CrossCheckError, match="Transformer Engine"):
        megatron_param_count(load_model("tiny-qwen3.5"))
