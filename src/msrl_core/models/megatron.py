"""The one megatron-core ``GPTModel`` builder of a :class:`ModelConfig`: local layer spec (RMSNorm, SwiGLU,
RoPE, optional QKV bias and QK norm; MoE as SequentialMLP experts with the allgather dispatcher), sharded for
``Parallel(tp, pp, ep)``. Its parameter names and shapes are the ones the reshard plan describes."""

from __future__ import annotations

import warnings
from typing import Any

from msrl_core.reshard.errors import ReshardError
from msrl_core.reshard.layout import ModelConfig, Parallel, megatron_padded_vocab
from msrl_core.reshard.spec import check_train

__all__ = ["build_gpt", "init_model_parallel", "megatron_groups", "transformer_config"]


def _megatron() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
    return ps


def init_model_parallel(train: Parallel, reinit: bool = False) -> None:
    """Set up megatron-core's model-parallel groups for ``train`` (torch.distributed must be initialised; its
    world a multiple of tp x pp x ep / ...). Already set up with the same sizes: nothing to do; with other
    sizes: a :class:`ReshardError`, unless ``reinit`` (then they are destroyed and rebuilt — models built on
    the old groups must not be used afterwards)."""
    ps = _megatron()
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if have == (train.tp, train.pp, train.ep, train.expert_tp):
            return
        if not reinit:
            raise ReshardError(
                f"megatron-core's model parallel state is set up for (tp, pp, ep, etp) = {have}, the model "
                f"needs {(train.tp, train.pp, train.ep, train.expert_tp)}"
            )
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=train.tp,
        pipeline_model_parallel_size=train.pp,
        expert_model_parallel_size=train.ep,
        expert_tensor_parallel_size=train.expert_tp,
    )


def megatron_groups() -> dict[str, Any]:
    """``{"tp", "pp", "ep"}`` process groups of this rank for :mod:`msrl_core.reshard` (None for a size 1)."""
    ps = _megatron()
    return {
        "tp": ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None,
        "pp": ps.get_pipeline_model_parallel_group()
        if ps.get_pipeline_model_parallel_world_size() > 1
        else None,
        "ep": ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None,
    }


def transformer_config(mc: ModelConfig, train: Parallel, *, cpu_init: bool = True, **overrides: Any) -> Any:
    """megatron-core's ``TransformerConfig`` of ``mc`` for ``train`` (``overrides``: any of its fields, e.g.
    ``moe_aux_loss_coeff``, ``init_method_std``)."""
    import torch
    import torch.nn.functional as F

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, mc.dtype)
    kw: dict[str, Any] = dict(
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.hd,
        ffn_hidden_size=mc.intermediate_size,
        tensor_model_parallel_size=train.tp,
        pipeline_model_parallel_size=train.pp,
        use_cpu_initialization=cpu_init,
        perform_initialization=True,
        init_method_std=0.02,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=mc.qkv_bias,
        qk_layernorm=mc.qk_norm,
        normalization="RMSNorm",
        layernorm_epsilon=mc.norm_epsilon,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
    )
    if mc.is_moe:
        kw.update(
            num_moe_experts=mc.num_experts,
            moe_ffn_hidden_size=mc.moe_intermediate_size,
            moe_router_topk=mc.moe_router_topk,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            # HF norm_topk_prob=True: softmax over the top-k logits (Megatron's default); False: the top-k of
            # the full softmax, not renormalised (Megatron's pre-softmax router)
            moe_router_pre_softmax=not mc.moe_norm_topk_prob,
            moe_grouped_gemm=False,
            expert_model_parallel_size=train.ep,
            expert_tensor_parallel_size=train.expert_tp,
        )
        if mc.shared_expert_intermediate_size:
            kw.update(
                moe_shared_expert_intermediate_size=mc.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
            )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(
    mc: ModelConfig,
    train: Parallel,
    *,
    seed: int = 1234,
    device: Any = None,
    reinit: bool = False,
    transformer_overrides: dict[str, Any] | None = None,
) -> Any:
    """This rank's megatron-core ``GPTModel`` of ``mc`` sharded for ``train`` (process groups: see
    :func:`init_model_parallel`; its PP stage decides the layers, embedding and output layer it holds),
    initialised by megatron-core (seeded with ``seed``) on ``device`` (default: the CPU, where megatron-core's
    ``torch.cuda`` calls are redirected by :mod:`msrl_core.trainer.engines.megatron_cpu`; an accelerator
    must be the current device). Its parameter names and shapes: ``to_hf(mc, train).train_shapes(stage)``."""
    import torch

    check_train(mc, train)
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cpu":
        from msrl_core.trainer.engines import megatron_cpu

        megatron_cpu.activate(force=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    init_model_parallel(train, reinit=reinit)
    ps = _megatron()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tc = transformer_config(mc, train, cpu_init=device.type == "cpu", **(transformer_overrides or {}))
    spec = get_gpt_layer_local_spec(
        num_experts=mc.num_experts or None, qk_layernorm=mc.qk_norm, normalization="RMSNorm"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            tc,
            spec,
            vocab_size=megatron_padded_vocab(mc.vocab_size, mc.make_vocab_size_divisible_by, train.tp),
            max_sequence_length=mc.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=mc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=mc.rope_theta,  # a float, as in config.json
            parallel_output=False,
        )
    return model.to(device)
