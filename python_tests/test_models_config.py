"""ModelConfig from a Hugging Face config.json: every architecture's values carried (rope_theta a float,
norm_epsilon, positions, MoE router), unknown architectures and unsupported features refused by name, and
hf_config() writing a config that reads back as the same model."""

from __future__ import annotations

import json

import pytest

from msrl_core.models import CheckpointError, ModelConfig, hf_config
from msrl_core.reshard import ReshardError

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


def _save(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    "arch, cls, extra, want",
    [
        ("qwen2", "Qwen2Config", {}, dict(qkv_bias=True, qk_norm=False, head_dim=8)),
        ("llama", "LlamaConfig", dict(head_dim=16), dict(qkv_bias=False, head_dim=16)),
        (
            "qwen3",
            "Qwen3Config",
            dict(head_dim=32, tie_word_embeddings=True),
            dict(qk_norm=True, head_dim=32),
        ),
        (
            "qwen3_moe",
            "Qwen3MoeConfig",
            dict(num_experts=8, moe_intermediate_size=32, num_experts_per_tok=3, norm_topk_prob=True),
            dict(num_experts=8, moe_intermediate_size=32, moe_router_topk=3, moe_norm_topk_prob=True),
        ),
    ],
)
def test_from_pretrained_carries_every_value(tmp_path, arch, cls, extra, want):
    path = _save(tmp_path, getattr(transformers, cls)(**{**COMMON, **extra}))
    mc = ModelConfig.from_pretrained(path)
    assert mc.arch == arch
    assert (mc.hidden_size, mc.num_layers, mc.num_attention_heads, mc.num_key_value_heads) == (64, 2, 8, 2)
    assert (mc.intermediate_size, mc.vocab_size, mc.max_position_embeddings) == (96, 1000, 4096)
    assert type(mc.rope_theta) is float and mc.rope_theta == 1e6
    assert mc.norm_epsilon == 1e-5
    assert mc.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    for k, v in want.items():
        assert getattr(mc, k) == v, k
    # written back by hf_config: the same model
    assert ModelConfig.from_hf(hf_config(mc)) == mc


def test_a_transformers_4_config_json_is_read(tmp_path):
    # older checkpoints: rope_theta at the top level, torch_dtype, Qwen3-MoE's num_experts
    d = dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=500,
        rope_theta=5000000,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
        num_experts=4,
        moe_intermediate_size=16,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    (tmp_path / "config.json").write_text(json.dumps(d))
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert type(mc.rope_theta) is float and mc.rope_theta == 5e6
    assert (mc.dtype, mc.num_experts, mc.moe_norm_topk_prob) == ("bfloat16", 4, False)
    assert ModelConfig.from_pretrained(str(tmp_path), dtype="float32").dtype == "float32"


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(CheckpointError) as ei:
        ModelConfig.from_pretrained(str(tmp_path))
    msg = str(ei.value)
    assert "'gpt2'" in msg and "GPT2LMHeadModel" in msg and "config.json" in msg
    assert "llama, qwen2, qwen3, qwen3_moe" in msg
    assert isinstance(ei.value, ReshardError) and isinstance(ei.value, ValueError)


@pytest.mark.parametrize(
    "cls, extra, key",
    [
        (
            "LlamaConfig",
            dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 8.0}),
            "rope",
        ),
        ("LlamaConfig", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("LlamaConfig", dict(attention_bias=True), "attention_bias=True"),
        ("LlamaConfig", dict(mlp_bias=True), "mlp_bias=True"),
        ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=True"),
        (
            "Qwen3MoeConfig",
            dict(num_experts=4, moe_intermediate_size=16, mlp_only_layers=[0]),
            "mlp_only_layers=[0]",
        ),
    ],
)
def test_unsupported_features_are_refused_by_name(tmp_path, cls, extra, key):
    path = _save(tmp_path, getattr(transformers, cls)(**{**COMMON, **extra}))
    with pytest.raises(CheckpointError, match="not supported") as ei:
        ModelConfig.from_pretrained(path)
    assert key in str(ei.value)


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        ModelConfig.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="no 'num_attention_heads'"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_model_config_values_are_checked():
    base = dict(arch="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=100)  # fmt: skip
    assert type(ModelConfig(**base, rope_theta=500000).rope_theta) is float
    for bad in (dict(rope_theta=0), dict(norm_epsilon=-1.0), dict(max_position_embeddings=0)):
        with pytest.raises(ReshardError, match=next(iter(bad))):
            ModelConfig(**base, **bad)
    moe = dict(base, arch="qwen3_moe", num_experts=4, moe_intermediate_size=16)
    assert (ModelConfig(**moe).moe_router_topk, ModelConfig(**moe).moe_norm_topk_prob) == (2, True)
    with pytest.raises(ReshardError, match="moe_router_topk"):
        ModelConfig(**moe, moe_router_topk=5)
