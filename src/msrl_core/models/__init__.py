"""Models: the one model description (:class:`ModelConfig`, from a Hugging Face ``config.json``), the one
megatron-core ``GPTModel`` builder, and Hugging Face checkpoints in and out of Megatron's TP/PP/EP shards
through the reshard plan (both directions from one set of layout rules).

Architectures: Llama, Qwen2, Qwen3, Qwen3-MoE (and Qwen2-MoE)."""

from msrl_core.models.checkpoint import (
    CheckpointError,
    LoadReport,
    SafetensorsCheckpoint,
    ShardLayout,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from msrl_core.models.config import ModelConfig, hf_config, hf_model_class
from msrl_core.models.megatron import build_gpt, init_model_parallel, megatron_groups, transformer_config
from msrl_core.models.pipeline import finish_grads, grad_norm, pipeline_forward

__all__ = [
    "CheckpointError",
    "LoadReport",
    "ModelConfig",
    "SafetensorsCheckpoint",
    "ShardLayout",
    "build_gpt",
    "finish_grads",
    "grad_norm",
    "hf_config",
    "hf_model_class",
    "init_model_parallel",
    "load_hf_checkpoint",
    "megatron_groups",
    "pipeline_forward",
    "save_hf_checkpoint",
    "transformer_config",
]
