"""The weights are verl's: the same megatron-core GPTModel (CPU, gloo, 4 ranks) through verl's own
``MegatronEngine.get_per_tensor_param`` and through the one ``msrl_core.integrations.verl`` installs
yields the same names, shapes, dtypes and values: dense TP 2 x PP 2; Llama with tied embeddings TP 2 x PP 2
(where verl's mbridge export adds lm_head.weight); Qwen3-MoE TP 2 x EP 2 and PP 2 x EP 2.
How verl runs here (mbridge, the TE-spec names, DDP-wrapped chunks): verl_util.py."""

from __future__ import annotations

import dataclasses

import differential_worker
import pytest

import megatron_harness
from reshard_util import CONFIGS

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
# Qwen3-MoE: 4 heads / 2 KV heads, head_dim 16, q/k norms, 4 experts (reshard_util's config, vocab 512)
MOE = dataclasses.asdict(dataclasses.replace(CONFIGS["qwen3_moe"], vocab_size=512))
TIED = dict(
    arch="llama",
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    tie_word_embeddings=True,
)
CASES = [
    {"name": "dense_tp2_pp2", "model": DENSE, "tp": 2, "pp": 2},
    {"name": "tied_tp2_pp2", "model": TIED, "tp": 2, "pp": 2},
    {"name": "moe_tp2_ep2", "model": MOE, "tp": 2, "ep": 2},
    {"name": "moe_pp2_ep2", "model": MOE, "pp": 2, "ep": 2},
    # TP 1: mbridge yields the parameters themselves; the stream yields views of them where it can
    {"name": "dense_tp1", "model": DENSE},
    {"name": "moe_ep2", "model": MOE, "ep": 2},
]
# HF tensors per case: embed, norm, lm_head + per layer (dense: 2 norms, q/k/v w+b, o, gate, up, down = 12;
# Qwen3-MoE: 2 norms, q/k/v, o, q_norm, k_norm, router, 4 experts x 3 = 21)
# Llama tied: embed, norm + per layer 2 norms, q, k, v, o, gate, up, down = 9 (no lm_head in the HF layout)
COUNTS = {
    "dense_tp2_pp2": 3 + 4 * 12,
    "tied_tp2_pp2": 2 + 4 * 9,
    "moe_tp2_ep2": 3 + 2 * 21,
    "moe_pp2_ep2": 3 + 2 * 21,
    "dense_tp1": 3 + 4 * 12,
    "moe_ep2": 3 + 2 * 21,
}
# tensors yielded in place (views of the rank's own parameters) at TP 1, per rank:
# dense: all but q/k/v weight and bias (6 per layer); Qwen3-MoE EP 2: all but q/k/v and the 2 x 3 tensors of
# the other EP rank's experts (per layer 3 + 6 = 9)
INPLACE = {"dense_tp1": 3 + 4 * 6, "moe_ep2": 3 + 2 * (21 - 9)}


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
        if case == "tied_tp2_pp2":
            # With tied embeddings and PP > 1, Megatron keeps a copy of the embedding on the last stage as
            # output_layer.weight, and mbridge yields it too, as lm_head.weight (equal to the embedding).
            # The HF checkpoint layout of a tied model, and ours, has only model.embed_tokens.weight; vLLM's
            # load_weights skips lm_head.weight for tied models. Everything else is identical.
            assert v["missing"] == ["lm_head.weight"] and not v["extra"], v
            assert r["verl_lm_head_equals_embedding"]
            v = r["ours_vs_verl_but_lm_head"]
        assert v["names_equal"], (rank, v["missing"], v["extra"])
        assert not v["shape_mismatch"] and not v["dtype_mismatch"] and not v["value_mismatch"], (rank, v)
        assert v["count"] == COUNTS[case]
        assert r["dtypes"] == ["torch.float32"]
        assert r["ours_buckets"] > 1
        t = r["telemetry"]
        assert t["inplace_tensors"] == r["aliasing"]  # exactly the in-place tensors alias the parameters
        if case in INPLACE:
            assert t["inplace_tensors"] == INPLACE[case], t
            if case == "dense_tp1":  # nothing crosses ranks: q/k/v copied from the parameters, no gather
                assert t["gather_scratch_bytes"] == 0 and t["direct_buckets"] == t["gather_buckets"] > 0, t
            else:  # only the expert buckets are exchanged; the dense ones are copied from the parameters
                assert t["gather_scratch_bytes"] > 0 and t["direct_buckets"] > 0, t
                # the other EP rank's 2 experts x 3 tensors x 2 layers: views of the gather scratch
                assert t["scratch_views"] == 12, t
        else:  # TP 2 or PP 2: the replicated norms (and at PP 2 x EP 2 the own experts) in place
            assert t["inplace_tensors"] > 0 and t["direct_buckets"] == 0, t
        ref = r["verl_vs_reference"]  # verl's export itself equals the independent torch reference
        assert ref["names_equal"] or ref["extra"] == ["lm_head.weight"], ref
        assert not ref["value_mismatch"], ref


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_patched_to_round_trip(results, case):
    for per_rank in results:
        r = per_rank[case]
        assert "error" not in r, r.get("traceback")
        o = r["offloaded"]
        assert o["weights"] and o["grads"] and o["optimizer"]
        # the whole DDP parameter buffers (the parameters and DDP's bucket padding), as verl's cpu_data copies
        assert o["weight_bytes"] == o["storage_bytes"] >= o["param_bytes"]
        assert o["storages"] <= 2  # dense + expert buffers, not one storage per parameter
        a = r["after_offload_vs_verl"]
        assert a["names_equal"] and not a["value_mismatch"], a
        assert r["grads_still_freed"]  # get_per_tensor_param loads the weights only, as verl's does
        assert r["restored_equal"] and r["grads_zero"] and r["optimizer_back"]
        assert r["optimizer_equal"]  # Adam's moments and step counts bit for bit after the round trip
