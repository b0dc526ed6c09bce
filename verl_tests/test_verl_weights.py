"""The weights are verl's: the same megatron-core GPTModel (CPU, gloo, 4 ranks) through verl's own
``MegatronEngine.get_per_tensor_param`` and through the one ``msrl_core.integrations.verl`` installs
yields the same names, shapes, dtypes and values (dense TP 2 x PP 2; Qwen3-MoE TP 2 x EP 2 and PP 2 x EP 2).
How verl runs here (mbridge, the TE-spec names, no DDP): verl_util.py."""

from __future__ import annotations

import differential_worker
import pytest

import megatron_harness

DENSE = dict(
    arch="qwen2",
    hidden_size=64,
    num_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=512,  # a multiple of 128 x TP: no vocabulary padding (verl's mbridge export does not trim it)
    qkv_bias=True,
)
MOE = dict(
    arch="qwen3_moe",
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=512,
    qk_norm=True,
    num_experts=4,
    moe_intermediate_size=32,
)
CASES = [
    {"name": "dense_tp2_pp2", "model": DENSE, "tp": 2, "pp": 2},
    {"name": "moe_tp2_ep2", "model": MOE, "tp": 2, "ep": 2},
    {"name": "moe_pp2_ep2", "model": MOE, "pp": 2, "ep": 2},
]
# HF tensors per case: embed, norm, lm_head + per layer (dense: 2 norms, q/k/v w+b, o, gate, up, down = 12;
# Qwen3-MoE: 2 norms, q/k/v, o, q_norm, k_norm, router, 4 experts x 3 = 21)
COUNTS = {"dense_tp2_pp2": 3 + 4 * 12, "moe_tp2_ep2": 3 + 2 * 21, "moe_pp2_ep2": 3 + 2 * 21}


@pytest.fixture(scope="module")
def results():
    return megatron_harness.spawn(differential_worker.main, CASES, 4, 900.0, "verl differential workers")


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_the_weights_are_verls(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert "error" not in r, f"rank {rank}: {r.get('traceback')}"
        assert r["fallback"] is None and r["peft_config"] is None
        assert r["twice"] == []
        v = r["ours_vs_verl"]
        assert v["names_equal"], (rank, v["missing"], v["extra"])
        assert not v["shape_mismatch"] and not v["dtype_mismatch"] and not v["value_mismatch"], (rank, v)
        assert v["count"] == COUNTS[case]
        assert r["dtypes"] == ["torch.float32"]
        assert r["ours_buckets"] > 1
        ref = r["verl_vs_reference"]  # verl's export itself equals the independent torch reference
        assert ref["names_equal"] and not ref["value_mismatch"], ref


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_patched_to_round_trip(results, case):
    for per_rank in results:
        r = per_rank[case]
        assert "error" not in r, r.get("traceback")
        o = r["offloaded"]
        assert o["weights"] and o["grads"] and o["optimizer"]
        assert o["weight_bytes"] == o["param_bytes"]
        a = r["after_offload_vs_verl"]
        assert a["names_equal"] and not a["value_mismatch"], a
        assert r["grads_still_freed"]  # get_per_tensor_param loads the weights only, as verl's does
        assert r["restored_equal"] and r["grads_zero"] and r["optimizer_back"]
