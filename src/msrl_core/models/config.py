"""The Hugging Face side of the one model description: the transformers config of a :class:`ModelConfig`
(``ModelConfig.from_hf`` / ``from_pretrained`` read one; :func:`hf_config` writes one)."""

from __future__ import annotations

from typing import Any

from msrl_core.reshard.errors import CheckpointError
from msrl_core.reshard.layout import ModelConfig

__all__ = ["ModelConfig", "hf_config", "HF_CLASSES"]

# model_type -> (transformers config class, causal-LM class)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


def hf_config(mc: ModelConfig, **extra: Any) -> Any:
    """The transformers ``PretrainedConfig`` of ``mc`` (``extra``: more keys, e.g. token ids), such that
    ``ModelConfig.from_hf(hf_config(mc))`` describes the same model."""
    import transformers as tf

    if mc.qkv_bias and mc.arch not in ("qwen2", "qwen2_moe"):
        raise CheckpointError(
            f"{mc.arch} with qkv_bias has no Hugging Face equivalent (its attention_bias also adds an "
            "output-projection bias)"
        )
    cfg_cls, lm_cls = HF_CLASSES[mc.arch]
    kw: dict[str, Any] = dict(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        hidden_act="silu",
        rms_norm_eps=mc.norm_epsilon,
        max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
        dtype=mc.dtype,
        architectures=[lm_cls],
    )
    if mc.arch != "qwen2_moe":
        kw["head_dim"] = mc.hd
    elif mc.hd * mc.num_attention_heads != mc.hidden_size:
        raise CheckpointError(f"qwen2_moe needs head_dim = hidden_size / heads, got head_dim {mc.hd}")
    if mc.is_moe:
        kw.update(
            num_experts=mc.num_experts,
            moe_intermediate_size=mc.moe_intermediate_size,
            num_experts_per_tok=mc.moe_router_topk,
            norm_topk_prob=bool(mc.moe_norm_topk_prob),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if mc.arch == "qwen2_moe":
            kw.update(
                shared_expert_intermediate_size=mc.shared_expert_intermediate_size, qkv_bias=mc.qkv_bias
            )
    kw.update(extra)
    return getattr(tf, cfg_cls)(**kw)


def hf_model_class(mc: ModelConfig) -> Any:
    """The transformers causal-LM class of ``mc.arch``."""
    import transformers as tf

    return getattr(tf, HF_CLASSES[mc.arch][1])
