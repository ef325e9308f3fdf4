"""Model families as plug-ins (attune.spec.family_registry, attune.spec.families) and the models slime ships
(issue 21): parameter counts against megatron-core's meta-device count or the published figure, and the launch's
model arguments against slime's MODEL_ARGS flag by flag.

The expected argument lists are slime 624b824a scripts/models/*.sh MODEL_ARGS with the shell variables
substituted, less the layout flags attune's layout writes (--moe-token-dispatcher-type, --moe-grouped-gemm,
--moe-permute-fusion; the baselines set them) and less --attention-softmax-in-fp32 (every attune launch passes it
in its runtime flags). Written out here because the slime checkout is not available to the tests.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from importlib import resources

import pytest

from attune.cli import main
from attune.errors import ModelError
from attune.runners.slime.launch import model_args, slime_command
from attune.spec.baselines import baseline_layout
from attune.spec.engine import get_engine
from attune.spec.family_registry import by_hf_type, by_name, names
from attune.spec.flags import known_flag, to_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import bundled_names, from_hf_config, load_model
from attune.spec.placement import chunk_ranges, stage_params
from attune.spec.rules import check

LAYOUT_FLAGS = ("--moe-token-dispatcher-type", "--moe-grouped-gemm", "--moe-permute-fusion")

# slime 624b824a scripts/models/<file>: MODEL_ARGS, variables substituted (see the module doc)
SLIME_MODEL_ARGS = {
    "GLM-4.5-Air": ("glm4.5-106B-A12B.sh", """
        --disable-bias-linear --group-query-attention --num-attention-heads 96 --num-query-groups 8 --kv-channels 128
        --num-layers 46 --hidden-size 4096 --ffn-hidden-size 10944 --add-qkv-bias --normalization RMSNorm
        --position-embedding-type rope --rotary-percent 0.5 --swiglu --untie-embeddings-and-output-weights
        --vocab-size 151552 --rotary-base 1000000 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 1408
        --moe-router-pre-softmax --moe-router-score-function sigmoid --moe-router-enable-expert-bias
        --moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
        --moe-router-topk 8 --moe-layer-freq [0]*1+[1]*45 --num-experts 128 --moe-grouped-gemm --moe-router-dtype fp32
        --moe-permute-fusion --moe-aux-loss-coeff 0"""),
    "GLM-4.5-355B-A32B": ("glm4.5-355B-A32B.sh", """
        --disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 96 --num-query-groups 8
        --kv-channels 128 --num-layers 92 --hidden-size 5120 --ffn-hidden-size 12288 --add-qkv-bias
        --normalization RMSNorm --position-embedding-type rope --rotary-percent 0.5 --swiglu
        --untie-embeddings-and-output-weights --vocab-size 151552 --rotary-base 1000000 --moe-ffn-hidden-size 1536
        --moe-shared-expert-intermediate-size 1536 --moe-router-pre-softmax --moe-router-score-function sigmoid
        --moe-router-enable-expert-bias --moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss
        --moe-token-dispatcher-type alltoall --moe-router-topk 8 --moe-router-topk-scaling-factor 2.5
        --moe-layer-freq [0]*3+[1]*89 --num-experts 160 --moe-grouped-gemm --moe-router-dtype fp32 --moe-permute-fusion
        --moe-aux-loss-coeff 0"""),
    "GLM-4.7-30B-A3B": ("glm4.7-30B-A3B.sh", """
        --moe-layer-freq [0]*1+[1]*46 --num-experts 64 --moe-shared-expert-intermediate-size 1536 --moe-router-topk 4
        --moe-grouped-gemm --moe-permute-fusion --moe-ffn-hidden-size 1536 --moe-router-score-function sigmoid
        --moe-router-pre-softmax --moe-router-enable-expert-bias --moe-router-bias-update-rate 0
        --moe-router-load-balancing-type seq_aux_loss --moe-router-topk-scaling-factor 1.8 --moe-aux-loss-coeff 0
        --moe-router-dtype fp32 --make-vocab-size-divisible-by 64 --num-layers 47 --hidden-size 2048
        --ffn-hidden-size 10240 --num-attention-heads 20 --disable-bias-linear --add-qkv-bias --swiglu
        --untie-embeddings-and-output-weights --position-embedding-type rope --no-position-embedding
        --normalization RMSNorm --qk-layernorm --multi-latent-attention --q-lora-rank 768 --kv-lora-rank 512
        --qk-head-dim 192 --v-head-dim 256 --kv-channels 192 --qk-pos-emb-head-dim 64 --vocab-size 154880
        --rotary-base 1000000 --no-rope-fusion"""),
    "GLM-5-744B-A40B": ("glm5-744B-A40B.sh", """
        --spec slime_plugins.models.glm5.glm5 get_glm5_spec --moe-layer-freq [0]*3+[1]*75 --num-experts 256
        --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-grouped-gemm --moe-permute-fusion
        --moe-ffn-hidden-size 2048 --moe-router-score-function sigmoid --moe-router-pre-softmax
        --moe-router-enable-expert-bias --moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss
        --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0 --moe-router-dtype fp32
        --make-vocab-size-divisible-by 16 --num-layers 78 --hidden-size 6144 --ffn-hidden-size 12288
        --num-attention-heads 64 --disable-bias-linear --swiglu --untie-embeddings-and-output-weights
        --position-embedding-type rope --no-position-embedding --normalization RMSNorm --qk-layernorm
        --multi-latent-attention --q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256
        --kv-channels 192 --qk-pos-emb-head-dim 64 --vocab-size 154880 --rotary-base 1000000 --enable-experimental
        --allgather-cp"""),
    # GLM-5's MODEL_ARGS but --rotary-base 8000000; the index-sharing schedule is read from the HF config
    "GLM-5.2-744B-A40B": ("glm5.2-744B-A40B.sh", """
        --spec slime_plugins.models.glm5.glm5 get_glm5_spec --moe-layer-freq [0]*3+[1]*75 --num-experts 256
        --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-grouped-gemm --moe-permute-fusion
        --moe-ffn-hidden-size 2048 --moe-router-score-function sigmoid --moe-router-pre-softmax
        --moe-router-enable-expert-bias --moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss
        --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0 --moe-router-dtype fp32
        --make-vocab-size-divisible-by 16 --num-layers 78 --hidden-size 6144 --ffn-hidden-size 12288
        --num-attention-heads 64 --disable-bias-linear --swiglu --untie-embeddings-and-output-weights
        --position-embedding-type rope --no-position-embedding --normalization RMSNorm --qk-layernorm
        --multi-latent-attention --q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256
        --kv-channels 192 --qk-pos-emb-head-dim 64 --vocab-size 154880 --rotary-base 8000000 --enable-experimental
        --allgather-cp"""),
    "MiniMax-M2": ("minimax-m2.sh", """
        --spec slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec --disable-bias-linear --num-layers 62
        --hidden-size 3072 --ffn-hidden-size 1536 --num-attention-heads 48 --kv-channels 128 --num-query-groups 8
        --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu
        --untie-embeddings-and-output-weights --vocab-size 200064 --group-query-attention --rotary-percent 0.5
        --rotary-base 5000000 --qk-layernorm --no-rope-fusion --attention-softmax-in-fp32 --num-experts 256
        --moe-ffn-hidden-size 1536 --moe-router-topk 8 --moe-layer-freq [1]*62 --moe-router-pre-softmax
        --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type none
        --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-aux-loss-coeff 0 --moe-grouped-gemm
        --moe-permute-fusion"""),
}
SLIME_MODEL_ARGS.update({
    "GLM-4-9B": ("glm4-9B.sh", """
        --spec slime_plugins.models.glm4 get_glm_spec --swiglu --num-layers 40 --hidden-size 4096 --ffn-hidden-size 13696
        --num-attention-heads 32 --group-query-attention --num-query-groups 2 --use-rotary-position-embeddings
        --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-5 --rotary-base 10000
        --vocab-size 151552 --post-self-attn-layernorm --post-mlp-layernorm --rotary-interleaved --rotary-percent 0.5
        --no-rope-fusion --untie-embeddings-and-output-weights"""),
    # --mtp-num-layers 1 of the script is a layout flag in attune (Layout.mtp_layers; MiMo's baseline sets it)
    "MiMo-7B": ("mimo-7B-rl.sh", """
        --swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
        --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-05 --rotary-base 640000 --vocab-size 151680
        --untie-embeddings-and-output-weights --max-position-embeddings 32768"""),
})
RUNTIME_FLAGS = ("--attention-softmax-in-fp32",)


def _expected(text: str) -> list[str]:
    words, out, skip = shlex.split(text), [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in LAYOUT_FLAGS + RUNTIME_FLAGS:
            skip = w == "--moe-token-dispatcher-type"
            continue
        out.append(w)
    return out


def _numbers(words: list[str]) -> list:
    """Numeric values as numbers (slime writes 1e-05 and 1e-5 alike), everything else as written, in order."""
    def as_num(w: str):
        try:
            return float(w)
        except ValueError:
            return w
    return [as_num(w) for w in words]


def test_new_families_are_registered_plug_ins():
    assert {"glm4_moe", "glm4_moe_lite", "minimax_m2"} <= set(names())
    assert by_hf_type("glm4_moe").name == "glm4_moe" and by_name("minimax_m2").hf_types == ("minimax_m2",)
    assert load_model("GLM-4.5-Air").family == "glm4_moe"
    with pytest.raises(ModelError, match="missing the field 'n_routed_experts'"):
        from_hf_config({"model_type": "glm4_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                        "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                        "vocab_size": 100})


@pytest.mark.parametrize("name", sorted(SLIME_MODEL_ARGS))
def test_model_args_equal_slimes_flag_by_flag(name):
    m = load_model(name)
    got = model_args(m)
    assert _numbers(got) == _numbers(_expected(SLIME_MODEL_ARGS[name][1])), SLIME_MODEL_ARGS[name][0]
    assert all(known_flag(w) is not None for w in got if w.startswith("--"))
    if m.moe is None:
        return
    # the layout flags the script also sets come from the baseline layout, once
    lay = baseline_layout(m, parse_cluster("8x8xH200"), Workload(), get_engine("slime"))[0]
    flags = to_flags(lay)
    assert flags[flags.index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert "--moe-grouped-gemm" in flags and "--moe-permute-fusion" in flags


# megatron-core's meta-device count equals attune's without the multi-token-prediction modules (megatron-core
# builds them only with --mtp-num-layers); MiniMax-M2's QK norms span the projection (transformers q_norm of
# heads x head_dim), megatron-core's local spec norms per head: the difference is exactly that, per layer.
@pytest.mark.parametrize("name", ["GLM-4.5-Air", "GLM-4.5-355B-A32B", "MiniMax-M2", "Qwen3-30B-A3B"])
def test_moe_param_counts_match_megatron_core(name):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'attune[megatron]'")
    from attune.spec.crosscheck import megatron_param_count  # noqa: PLC0415 - optional extra

    m = load_model(name)
    norm_gap = m.num_layers * (m.q_dim + m.kv_dim - 2 * m.head_dim) if m.qk_norm_full else 0
    assert megatron_param_count(m) + norm_gap == m.total_params - m.mtp_params


def _transformers_counts(name: str) -> dict:
    """The bundled config.json built by the installed transformers on the meta device (the text model only:
    ``text_config`` where the config nests one), counted by part: input embedding, output layer, final norm and
    each decoder layer (its parameters plus its persistent buffers, i.e. what the checkpoint stores), with the
    persistent buffers also by name."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install transformers")
    cfg = {k: v for k, v in json.loads(resources.files("attune.spec").joinpath(
        "model_configs", f"{name}.json").read_text()).items() if not k.startswith("_")}
    if "text_config" in cfg:
        text = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg["text_config"]}
        model_type = text.pop("model_type", cfg["model_type"] + "_text")
    else:
        text = dict(cfg)
        model_type = text.pop("model_type")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **text))
    persistent = set(model.state_dict())
    tensors = dict(model.named_parameters())  # shared (tied) weights once
    buffers = {k: b.numel() for k, b in model.named_buffers() if k in persistent}
    sizes = {k: p.numel() for k, p in tensors.items()} | buffers
    layers = [sum(v for k, v in sizes.items() if k.startswith(f"model.layers.{i}.")) for i in range(len(model.model.layers))]
    return {"embedding": model.model.embed_tokens.weight.numel(),
            "output": 0 if model.lm_head.weight is model.model.embed_tokens.weight else model.lm_head.weight.numel(),
            "final_norm": sum(p.numel() for p in model.model.norm.parameters()), "layers": layers,
            "buffers": buffers, "indexer": sum(v for k, v in sizes.items() if ".indexer." in k),
            "parameters": sum(p.numel() for p in tensors.values()), "class": type(model).__name__}


# transformers builds GLM-5 / GLM-5.2 and Qwen3.5's text models on the meta device from the bundled config.json: every
# part equals attune's (the MTP modules aside: transformers does not build them). The only persistent buffers are the
# MoE routers' e_score_correction_bias (transformers GlmMoeDsaTopkRouter: nn.Buffer; megatron-core 1dcf0daf
# moe/router.py lines 163-184 register_buffer 'expert_bias' too): checkpoint tensors, not trained, which attune
# counts in its totals (MoESpec.router_vectors) as the published checkpoint figures do.
@pytest.mark.parametrize("name", ["GLM-5-744B-A40B", "GLM-5.2-744B-A40B", "Qwen3.5-0.8B", "Qwen3.5-4B", "Qwen3.5-9B"])
def test_param_counts_match_transformers_meta_device(name):
    m = load_model(name)
    hf = _transformers_counts(name)
    assert hf["embedding"] == m.embedding_params
    assert hf["output"] == (0 if m.tied_embeddings else m.output_params)
    assert hf["final_norm"] == m.final_norm_params
    assert hf["layers"] == [m.layer(i).total for i in range(m.num_layers)]
    experts = m.moe.experts if m.moe is not None else 0
    assert hf["buffers"] == {f"model.layers.{i}.mlp.gate.e_score_correction_bias": experts
                             for i in range(m.num_layers) if m.is_moe_layer(i) and m.moe.router_bias}
    assert hf["parameters"] + sum(hf["buffers"].values()) == m.total_params - m.mtp_params
    if m.mla is not None and m.mla.index_heads:
        computing = [i for i in range(m.num_layers) if m.mla.computes_index(i)]
        assert hf["indexer"] == len(computing) * (m.mla.indexer(m.hidden) + 2 * m.mla.index_head_dim)
        # GLM-5: every layer; GLM-5.2 (index_topk_freq 4, offset 3): Megatron layers 1, 2, 3, 7, 11, ..., 75
        assert [i + 1 for i in computing] == (list(range(1, 79)) if name.startswith("GLM-5-") else
                                              [1, 2, 3, *range(7, 76, 4)])


# Published totals and activated counts, billions: Z.ai GLM-4.5 model card (GLM-4.5 355B / 32B active,
# GLM-4.5-Air 106B / 12B active); GLM-4.7-Flash model card (30B-A3B); MiniMax-M2 model card (230B / 10B activated);
# GLM-5 model card (744B-A40B). Published figures leave the MTP modules out; totals are rounded or truncated (within
# 1%), and the active counts are non-embedding (no input embedding, no output layer), rounded to the billion.
PUBLISHED = {"GLM-4.5-Air": (106, 12), "GLM-4.5-355B-A32B": (355, 32), "GLM-4.7-30B-A3B": (30, 3),
             "MiniMax-M2": (230, 10), "GLM-5-744B-A40B": (744, 40)}


def _without_mtp(m) -> tuple[float, float]:
    """(total, non-embedding activated) without the MTP modules, billions."""
    last = m.layer(m.num_layers - 1)
    mtp_active = m.mtp_params - m.mtp_layers * (last.expert_matrix - last.active_expert_matrix)
    active = m.activated_params - mtp_active - m.embedding_params - (0 if m.tied_embeddings else m.output_params)
    return (m.total_params - m.mtp_params) / 1e9, active / 1e9


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_near_the_published_figures(name):
    total, active = _without_mtp(load_model(name))
    pub_total, pub_active = PUBLISHED[name]
    assert abs(total - pub_total) / pub_total < 0.01
    assert abs(active - pub_active) <= 0.5


def test_attune_models_lists_every_new_model(capsys):
    assert main(["models", "--json"]) == 0
    out = capsys.readouterr().out
    for name in ("GLM-4.5-Air", "GLM-4.5-355B-A32B", "GLM-4.7-30B-A3B", "MiniMax-M2", "GLM-5-744B-A40B", "GLM-4-9B",
                 "MiMo-7B", "Kimi-K2-Thinking", "Qwen2.5-0.5B", "Qwen3-32B", "Llama-3.2-3B"):
        assert name in out


@pytest.mark.parametrize("name,gpus", [("GLM-4.5-Air", "2x8xH200"), ("MiniMax-M2", "8x8xH200"),
                                       ("GLM-4.7-30B-A3B", "8xH200"), ("GLM-4.5-355B-A32B", "8x8xH200")])
def test_new_moe_models_have_a_slime_launch(name, gpus):
    m, cl = load_model(name), parse_cluster(gpus)
    lay, note = baseline_layout(m, cl, Workload(), get_engine("slime"))
    cmd = slime_command(m, cl, lay, Workload())
    assert cmd.flags.count("--num-layers") == 1 and "--moe-layer-freq" in cmd.flags


# Dense models of the llama family (Qwen2.5, Qwen3, Llama 3.x): attune writes Megatron's canonical spellings, so
# these compare as flag -> value maps with two equivalences of Megatron-LM 1dcf0daf: --use-rotary-position-embeddings
# is --position-embedding-type rope (arguments.py line 1678), and --kv-channels defaults to hidden / heads
# (validate_args), so an explicit value equal to that default is the same model.
SLIME_DENSE_ARGS = {
    "Qwen2.5-0.5B": "--swiglu --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14 "
                    "--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm "
                    "--norm-epsilon 1e-6 --rotary-base 1000000 --group-query-attention --num-query-groups 2 "
                    "--vocab-size 151936",
    "Qwen2.5-1.5B": "--swiglu --num-layers 28 --hidden-size 1536 --ffn-hidden-size 8960 --num-attention-heads 12 "
                    "--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm "
                    "--norm-epsilon 1e-6 --rotary-base 10000 --group-query-attention --num-query-groups 2 "
                    "--vocab-size 151936",
    "Qwen2.5-3B": "--swiglu --num-layers 36 --hidden-size 2048 --ffn-hidden-size 11008 --num-attention-heads 16 "
                  "--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm "
                  "--norm-epsilon 1e-6 --rotary-base 1000000 --group-query-attention --num-query-groups 2 "
                  "--vocab-size 151936",
    "Qwen2.5-7B": "--swiglu --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 "
                  "--group-query-attention --num-query-groups 4 --use-rotary-position-embeddings --disable-bias-linear "
                  "--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-06 --rotary-base 1000000 --vocab-size 152064 "
                  "--untie-embeddings-and-output-weights",
    "Qwen2.5-32B": "--swiglu --num-layers 64 --hidden-size 5120 --ffn-hidden-size 27648 --num-attention-heads 40 "
                   "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                   "--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-5 --rotary-base 1000000 --vocab-size 152064 "
                   "--untie-embeddings-and-output-weights",
    "Qwen3-0.6B": "--swiglu --num-layers 28 --hidden-size 1024 --ffn-hidden-size 3072 --num-attention-heads 16 "
                  "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                  "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
                  "--kv-channels 128 --qk-layernorm",
    "Qwen3-1.7B": "--swiglu --num-layers 28 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 16 "
                  "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                  "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
                  "--kv-channels 128 --qk-layernorm",
    "Qwen3-4B": "--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
                "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
                "--kv-channels 128 --qk-layernorm",
    "Qwen3-4B-Instruct-2507": "--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 "
                              "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
                              "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm "
                              "--norm-epsilon 1e-6 --rotary-base 5000000 --vocab-size 151936 --kv-channels 128 "
                              "--qk-layernorm",
    "Qwen3-8B": "--swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 32 "
                "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
                "--kv-channels 128 --qk-layernorm --untie-embeddings-and-output-weights",
    "Qwen3-14B": "--swiglu --num-layers 40 --hidden-size 5120 --ffn-hidden-size 17408 --num-attention-heads 40 "
                 "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                 "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
                 "--kv-channels 128 --qk-layernorm --untie-embeddings-and-output-weights",
    "Qwen3-32B": "--swiglu --num-layers 64 --hidden-size 5120 --ffn-hidden-size 25600 --num-attention-heads 64 "
                 "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
                 "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 "
                 "--kv-channels 128 --qk-layernorm --untie-embeddings-and-output-weights",
    "Llama-3.2-3B": "--swiglu --num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 "
                    "--group-query-attention --num-query-groups 8 --max-position-embeddings 131072 "
                    "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-5 "
                    "--rotary-base 500000 --vocab-size 128256 --kv-channels 128 --use-rope-scaling "
                    "--rotary-scaling-factor 32.0",
    "Llama-3.1-8B": "--swiglu --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                    "--group-query-attention --num-query-groups 8 --max-position-embeddings 131072 "
                    "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-5 "
                    "--rotary-base 500000 --vocab-size 128256 --kv-channels 128 --use-rope-scaling "
                    "--rotary-scaling-factor 8.0 --untie-embeddings-and-output-weights",
}


def _flag_groups(words: list[str]) -> dict:
    """Flag -> its values, in order."""
    out, key = {}, None
    for w in words:
        if w.startswith("--"):
            key = w
            out[key] = ()
        else:
            out[key] += (w,)
    return out


def _as_map(words: list[str], m) -> dict:
    out = _flag_groups(words)
    if out.pop("--use-rotary-position-embeddings", None) is not None:
        out["--position-embedding-type"] = ("rope",)
    if out.get("--kv-channels") == (str(m.hidden // m.heads),):
        del out["--kv-channels"]
    return {k: tuple(float(v) if v.replace(".", "", 1).replace("e-", "", 1).isdigit() else v for v in vals)
            for k, vals in out.items()}


@pytest.mark.parametrize("name", sorted(SLIME_DENSE_ARGS))
def test_dense_model_args_equal_slimes(name):
    m = load_model(name)
    assert _as_map(model_args(m), m) == _as_map(shlex.split(SLIME_DENSE_ARGS[name]), m)


@pytest.mark.parametrize("name", sorted(SLIME_DENSE_ARGS))  # every dense llama-family model of slime's scripts/models
def test_dense_param_counts_match_megatron_core(name):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'attune[megatron]'")
    from attune.spec.crosscheck import megatron_param_count  # noqa: PLC0415 - optional extra

    m = load_model(name)
    assert megatron_param_count(m) == m.total_params


def test_glm4_32b_args_equal_slimes_but_the_workload_flags():
    # slime glm4-32B.sh: glm4-9B.sh's flags in another order, no --add-qkv-bias, plus --seq-length 32768 (the
    # workload's, written by the layout codec) and --max-position-embeddings 32768 (no effect with rotary positions)
    m = load_model("GLM-4-32B")
    want = ("--spec slime_plugins.models.glm4 get_glm_spec --swiglu --num-layers 64 --hidden-size 6144 "
            "--ffn-hidden-size 23040 --num-attention-heads 48 --use-rotary-position-embeddings --disable-bias-linear "
            "--normalization RMSNorm --norm-epsilon 1e-5 --rotary-base 10000 --group-query-attention "
            "--num-query-groups 8 --vocab-size 151552 --post-self-attn-layernorm --post-mlp-layernorm "
            "--rotary-interleaved --rotary-percent 0.5 --no-rope-fusion --untie-embeddings-and-output-weights")
    assert _as_map(model_args(m), m) == _as_map(shlex.split(want), m)


def test_mimo_trains_its_mtp_layer():
    m = load_model("MiMo-7B")
    assert m.mtp_layers == 1 and m.mtp_params > 0
    lay = baseline_layout(m, parse_cluster("8xH200"), Workload(), get_engine("slime"))[0]
    assert lay.mtp_layers == 1
    flags = slime_command(m, parse_cluster("8xH200"), lay, Workload()).flags
    assert flags.count("--mtp-num-layers") == 1 and flags[flags.index("--mtp-num-layers") + 1] == "1"


# GLM-4's sandwich norms (two more RMSNorms per layer) are not in megatron-core's local spec: that much apart
@pytest.mark.parametrize("name", ["GLM-4-9B", "GLM-4-32B", "MiMo-7B"])
def test_glm4_and_mimo_counts_match_megatron_core(name):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'attune[megatron]'")
    from attune.spec.crosscheck import megatron_param_count  # noqa: PLC0415 - optional extra

    m = load_model(name)
    sandwich = 2 * m.hidden * m.num_layers if m.sandwich_norm else 0
    assert megatron_param_count(m) + sandwich == m.total_params - m.mtp_params


# Published: GLM-4-9B-0414 9B (Hugging Face lists 9.4B); MiMo-7B 7B main model (arXiv 2505.07608). GLM-4-32B-0414:
# slime's 64 layers give 34.7B against the published 32B (Hugging Face lists 33B, which 61 layers would give): the
# bundle follows slime's MODEL_ARGS, as the issue asks, and is checked against megatron-core's count only.
@pytest.mark.parametrize("name,billions", [("GLM-4-9B", 9.4), ("MiMo-7B", 7.6)])
def test_glm4_and_mimo_near_published(name, billions):
    m = load_model(name)
    assert abs((m.total_params - m.mtp_params) / 1e9 - billions) / billions < 0.01


# DeepSeek-V3 / Kimi K2 (MLA): slime 624b824a scripts/models/deepseek-v3.sh (NLAYERS 61, or 5 / 20 through
# MODEL_ARGS_NUM_LAYERS: deepseek-v3-5layer.sh, -20layer.sh), kimi-k2.sh, kimi-k2-thinking.sh. Compared as maps, less
# what does nothing: --kv-channels (Megatron-LM 1dcf0daf multi_latent_attention.py never reads kv_channels),
# --moe-token-drop-policy (read only on the capacity-factor path, moe/router.py line 598), group-limited routing
# over 1 group, and --attention-softmax-in-fp32 (attune's runtime flags pass it); --moe-layer-freq as its list.
_DS_COMMON = ("--disable-bias-linear --normalization RMSNorm --position-embedding-type rope --swiglu "
              "--untie-embeddings-and-output-weights --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
              "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --mscale 1.0 "
              "--mscale-all-dim 1.0 --attention-softmax-in-fp32 --no-rope-fusion --moe-ffn-hidden-size 2048 "
              "--moe-router-topk 8 --moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax "
              "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type "
              "seq_aux_loss --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 "
              "--moe-grouped-gemm --moe-router-dtype fp32 --moe-permute-fusion --hidden-size 7168 --ffn-hidden-size 18432")
_DS = (" --num-attention-heads 128 --kv-channels 128 --norm-epsilon 1e-6 --vocab-size 129280 --rotary-scaling-factor 40 "
       "--rotary-base 10000 --num-experts 256 --moe-router-group-topk 4 --moe-router-num-groups 8 "
       "--moe-router-topk-scaling-factor 2.5")
_KIMI = (" --num-attention-heads 64 --kv-channels 64 --vocab-size 163840 --rotary-base 50000 --num-experts 384 "
         "--moe-router-group-topk 1 --moe-router-num-groups 1 --moe-router-topk-scaling-factor 2.827")
SLIME_MLA_ARGS = {
    "DeepSeek-V3": _DS_COMMON + _DS + " --num-layers 61 --moe-layer-freq [0]*3+[1]*58",
    "DeepSeek-V3-5layer": _DS_COMMON + _DS + " --num-layers 5 --moe-layer-freq [0]*3+[1]*2",
    "DeepSeek-V3-20layer": _DS_COMMON + _DS + " --num-layers 20 --moe-layer-freq [0]*3+[1]*17",
    "Kimi-K2": _DS_COMMON + _KIMI + " --num-layers 61 --norm-epsilon 1e-6 --rotary-scaling-factor 32.0 "
                                    "--moe-layer-freq [0]*1+[1]*60",
    "Kimi-K2-Thinking": _DS_COMMON + _KIMI + " --num-layers 61 --norm-epsilon 1e-5 --rotary-scaling-factor 64.0 "
                                             "--moe-layer-freq [0]*1+[1]*60",
}
_NO_EFFECT = ("--kv-channels", "--moe-token-drop-policy", "--attention-softmax-in-fp32") + LAYOUT_FLAGS


def _mla_map(words: list[str]) -> dict:
    out = _flag_groups(words)
    for k in _NO_EFFECT:
        out.pop(k, None)
    if out.get("--moe-router-num-groups") == ("1",):
        out.pop("--moe-router-num-groups")
        out.pop("--moe-router-group-topk", None)
    out["--moe-layer-freq"] = (list(eval(out["--moe-layer-freq"][0])),)
    return {k: tuple(_numbers(list(v))) if k != "--moe-layer-freq" else v for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(SLIME_MLA_ARGS))
def test_mla_model_args_equal_slimes(name):
    m = load_model(name)
    assert _mla_map(model_args(m)) == _mla_map(shlex.split(SLIME_MLA_ARGS[name]))


# Every file of slime 624b824a scripts/models/ (git ls-tree --name-only 624b824a scripts/models/) and the bundled
# model it is; None with the reason where it is not bundled.
SLIME_SCRIPTS = {
    "deepseek-v3-20layer.sh": "DeepSeek-V3-20layer", "deepseek-v3-5layer.sh": "DeepSeek-V3-5layer",
    "deepseek-v3.sh": "DeepSeek-V3", "glm4-32B.sh": "GLM-4-32B", "glm4-9B.sh": "GLM-4-9B",
    "glm4.5-106B-A12B.sh": "GLM-4.5-Air", "glm4.5-355B-A32B.sh": "GLM-4.5-355B-A32B",
    "glm4.7-30B-A3B.sh": "GLM-4.7-30B-A3B", "glm5-744B-A40B.sh": "GLM-5-744B-A40B",
    "glm5.2-744B-A40B.sh": "GLM-5.2-744B-A40B",
    "kimi-k2-thinking.sh": "Kimi-K2-Thinking", "kimi-k2.sh": "Kimi-K2",
    "llama3.1-8B-Instruct.sh": "Llama-3.1-8B", "llama3.2-3B-Instruct-amd.sh": "Llama-3.2-3B",
    "llama3.2-3B-Instruct.sh": "Llama-3.2-3B", "mimo-7B-rl.sh": "MiMo-7B", "minimax-m2.sh": "MiniMax-M2",
    "moonlight.sh": "Moonlight-16B-A3B", "qwen2.5-0.5B.sh": "Qwen2.5-0.5B", "qwen2.5-1.5B.sh": "Qwen2.5-1.5B",
    "qwen2.5-32B.sh": "Qwen2.5-32B", "qwen2.5-3B.sh": "Qwen2.5-3B", "qwen2.5-7B.sh": "Qwen2.5-7B",
    "qwen3-0.6B.sh": "Qwen3-0.6B", "qwen3-1.7B.sh": "Qwen3-1.7B", "qwen3-14B.sh": "Qwen3-14B",
    "qwen3-235B-A22B.sh": "Qwen3-235B-A22B", "qwen3-30B-A3B.sh": "Qwen3-30B-A3B", "qwen3-32B.sh": "Qwen3-32B",
    "qwen3-4B-Instruct-2507.sh": "Qwen3-4B-Instruct-2507", "qwen3-4B.sh": "Qwen3-4B", "qwen3-8B.sh": "Qwen3-8B",
    "qwen3-next-80B-A3B.sh": "Qwen3-Next-80B-A3B", "qwen3.5-0.8B.sh": "Qwen3.5-0.8B", "qwen3.5-27B.sh": "Qwen3.5-27B",
    "qwen3.5-35B-A3B-vl.sh": "Qwen3.5-35B-A3B",  # the same MODEL_ARGS with the VL provider: the text model is bundled
    "qwen3.5-35B-A3B.sh": "Qwen3.5-35B-A3B", "qwen3.5-4B.sh": "Qwen3.5-4B", "qwen3.5-9B.sh": "Qwen3.5-9B",
}


def test_every_slime_model_script_is_bundled():
    assert len(SLIME_SCRIPTS) == 39  # ls-tree at 624b824a lists 39 files
    missing = [f"{s} -> {n}" for s, n in SLIME_SCRIPTS.items() if n is not None and n not in bundled_names()]
    assert not missing
    for name in {n for n in SLIME_SCRIPTS.values() if n}:
        m = load_model(name)
        assert model_args(m) and m.total_params > 0


def test_glm52_shares_the_indexer_by_stage_and_refuses_a_stage_starting_on_a_sharing_layer():
    g5, g52 = load_model("GLM-5-744B-A40B"), load_model("GLM-5.2-744B-A40B")
    engine, wl = get_engine("slime"), Workload()
    lay = baseline_layout(g52, parse_cluster("32x8xH200"), wl, engine)[0]
    assert (lay.tp, lay.pp, lay.cp, lay.ep, lay.first, lay.last) == (4, 8, 8, 32, 14, 16)  # run-glm5.2 PERF_ARGS
    assert check(lay, g52, 256, wl, engine) == []
    # GLM-5's split (PP 4, last stage 18: 20/20/20/18) starts stages on layers 21, 41, 61: sharing layers
    glm5_split = replace(lay, pp=4, cp=16, first=None, last=18)
    assert check(glm5_split, g5, 256, wl, engine) == []
    assert any("starts on layer 21, 41, 61" in e for e in check(glm5_split, g52, 256, wl, engine))
    # per GPU of each stage, through the layer kinds the estimator prices: GLM-5.2 holds no indexer on its sharing
    # layers (the indexer's matrices TP-sharded, its k_norm weight and bias whole)
    idx = g52.mla.indexer(g52.hidden) / lay.tp + 2 * g52.mla.index_head_dim
    for r, chunks in enumerate(chunk_ranges(lay, g52.num_layers)):
        shared = sum(not g52.mla.computes_index(i) for a, b in chunks for i in range(a, b))
        got = [stage_params(m, lay, r, lambda k, m=m: m.kind_params(k).matrix / lay.tp + m.kind_params(k).vectors)
               for m in (g5, g52)]
        assert got[0] - got[1] == pytest.approx(shared * idx) and shared > 0
    # 57 of 78 layers share; the MTP layer (Megatron layer 79) computes its own, as GLM-5's does
    assert g52.mtp_kind == "full"
    assert g5.total_params - g52.total_params == 57 * (g52.mla.indexer(g52.hidden) + 2 * g52.mla.index_head_dim)
