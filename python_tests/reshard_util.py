"""Test helpers for the reshard tests: random Megatron shards for every rank and the gathered buckets a
real all-gather would produce (single process)."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from msrl_core.reshard import ModelConfig
from msrl_core.reshard.plan import ReshardPlan, execute_numpy, views_of


def random_shards(plan: ReshardPlan, seed: int = 0) -> dict:
    """(stage, tp_rank, ep_rank) -> {name: tensor}; replicated params equal over tp ranks, expert params
    equal over tp ranks when ep > 1 (expert data parallel), as Megatron keeps them."""
    tr = plan.train
    out = {}
    for s in range(tr.pp):
        for r in range(tr.tp):
            for e in range(tr.ep):
                d = {}
                for name, shape, grp in plan.stage_params[s]:
                    sharded = _is_tp_sharded(name)
                    key = (s, r if (sharded and grp == "tp") else 0, e if grp == "ep" else 0)
                    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(f"{name}/{key}".encode()))
                    d[name] = torch.randn(shape, generator=g, dtype=getattr(torch, plan.cfg.dtype))
                out[(s, r, e)] = d
    return out


def _is_tp_sharded(name: str) -> bool:
    return not any(k in name for k in ("layernorm", "router", "gate_weight"))


def gathered_bucket(plan: ReshardPlan, b, shards: dict, tp_rank: int = 0, ep_rank: int = 0) -> np.ndarray:
    buf = np.zeros(b.gathered_bytes, dtype=np.uint8)
    for m in range(b.members):
        key = (b.stage, m, ep_rank) if b.group == "tp" else (b.stage, tp_rank, m)
        for name, shape, off, nb, r0, r1 in b.params:
            t = shards[key][name].contiguous().view(shape[0], -1)[r0:r1]
            base = m * b.local_bytes + off
            buf[base : base + nb] = t.view(torch.uint8).reshape(-1).numpy()
    return buf


def run_plan_numpy(plan: ReshardPlan, shards: dict, infer_rank: int, bucket_bytes: int) -> dict:
    layout, total = plan.infer_layout(infer_rank)
    flat = np.zeros(total, dtype=np.uint8)
    for b, d in zip(plan.buckets(bucket_bytes), plan.bucket_descriptors(bucket_bytes, infer_rank)):
        if len(d):
            execute_numpy(d, flat, gathered_bucket(plan, b, shards))
    return views_of(torch.from_numpy(flat), layout, getattr(torch, plan.cfg.dtype))


# Small models covering the layout features, shared by the reshard tests.
CONFIGS = {
    "qwen2_gqa_bias": ModelConfig(
        "qwen2",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=1000,
        qkv_bias=True,
    ),
    "llama_mqa_tied": ModelConfig(
        "llama",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=997,
        tie_word_embeddings=True,
    ),
    "qwen3_qknorm_hd": ModelConfig(
        "qwen3",
        hidden_size=48,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=64,
        vocab_size=1024,
        qk_norm=True,
    ),
    "qwen3_moe": ModelConfig(
        "qwen3_moe",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=1000,
        qk_norm=True,
        num_experts=4,
        moe_intermediate_size=32,
    ),
    "qwen2_moe_shared": ModelConfig(
        "qwen2_moe",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        vocab_size=1000,
        qkv_bias=True,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=True,
    ),
}
