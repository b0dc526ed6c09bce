"""HF -> Megatron is exact: a tiny transformers model built in code, saved as a Hugging Face directory, loaded
into megatron-core GPTModels (TP 1, TP 2, PP 2, Qwen3-MoE EP 2; CPU, gloo, 2 processes) by
``load_hf_checkpoint`` through the reshard plan run in reverse; Megatron's logits equal transformers' logits
of the checkpoint within 1e-5 (fp32). The same workers save the shards back with ``save_hf_checkpoint``
(the forward plan) and compare with the source checkpoint tensor by tensor.

All cases run in one pair of spawned workers (start-up and imports dominate the cost).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed")
pytest.importorskip("transformers", reason="transformers not installed")

import models_harness  # noqa: E402

TOL = 1e-5
ATTN = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, max_position_embeddings=64)
# Qwen3-MoE: 4 experts of FFN 32, top-2, head_dim 16 (the cases differ in router normalisation, layout)
MOE = dict(
    vocab_size=1000,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    **ATTN,
)
CASES = [
    # Qwen2: GQA (8 heads, 2 KV), QKV bias, untied, vocab 1000 (Megatron pads to 1024)
    dict(
        name="qwen2_tp1",
        arch="qwen2",
        tp=1,
        errors=True,
        hf=dict(vocab_size=1000, num_attention_heads=8, num_key_value_heads=2, **ATTN),
    ),
    # Qwen2 TP 2 from a sharded checkpoint (index + several files), a non-integer rope_theta, eps 1e-5
    dict(
        name="qwen2_tp2_sharded",
        arch="qwen2",
        tp=2,
        max_shard_size="40KB",
        hf=dict(
            vocab_size=1000,
            num_attention_heads=8,
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 12345.5},
            **ATTN,
        ),
    ),
    # Llama MQA (1 KV head < TP 2: a query group split across ranks), tied embeddings, vocab 997
    dict(
        name="llama_tp2_tied",
        grad=True,
        arch="llama",
        tp=2,
        hf=dict(
            vocab_size=997, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, **ATTN
        ),
    ),
    # Qwen3: QK norm, head_dim 32 != hidden/heads, PP 2 (stage-local layers), tied (output layer copy)
    dict(
        name="qwen3_pp2_tied",
        grad=True,
        arch="qwen3",
        pp=2,
        hf=dict(
            vocab_size=1000,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            **ATTN,
        ),
    ),
    # Qwen3-MoE: 4 experts over EP 2 (2 per rank), top-2, renormalised top-k (hub Qwen3-MoE setting)
    dict(
        name="qwen3_moe_ep2",
        grad=True,
        arch="qwen3_moe",
        ep=2,
        hf=dict(MOE, norm_topk_prob=True),
    ),
    # Qwen3-MoE with its experts TP-sharded (TP 2, EP 1), the top-k of the full softmax (norm_topk_prob False:
    # Megatron's pre-softmax router)
    dict(
        name="qwen3_moe_tp2_presoftmax",
        grad=True,
        arch="qwen3_moe",
        tp=2,
        hf=dict(MOE, norm_topk_prob=False),
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = [dict(c, dir=str(tmp_path_factory.mktemp(c["name"]))) for c in CASES]
    return models_harness.run(cases, world=2)


def _case(results, name):
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert "error" not in r, r.get("traceback", r.get("error"))
    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_megatron_forward_after_load_equals_transformers(results, name):
    per_rank = _case(results, name)
    with_logits = [r for r in per_rank if "logits_max_abs_diff" in r]
    case = next(c for c in CASES if c["name"] == name)
    # every TP/EP rank holds the (gathered) logits; with PP only the last stage does
    assert len(with_logits) == (1 if case.get("pp", 1) > 1 else 2)
    for r in with_logits:
        assert r["logits_scale"] > 1.0  # the comparison is not between near-zero logits
        assert r["logits_max_abs_diff"] <= TOL, (name, r["logits_max_abs_diff"])
        assert r["padded_logits_zero"]  # Megatron's vocab-padding rows were zeroed


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_save_back_through_the_forward_plan_is_the_source(results, name):
    r0 = _case(results, name)[0]
    assert r0["saved_names_equal"]
    assert r0["saved_max_abs_diff"] == 0.0
    assert r0["saved_logits_equal"]
    assert r0["saved_config_same_model"]


@pytest.mark.slow
def test_each_rank_reads_only_its_slices(results):
    # no rank reads more than the parameters it fills (Megatron's vocab padding is zeroed, not read)
    for c in CASES:
        for r in _case(results, c["name"]):
            assert r["bytes_read"] <= r["model_bytes"], c["name"]
    # TP 2: each rank about half of the checkpoint (replicated norms in full), from the index's shards
    for r in _case(results, "qwen2_tp2_sharded"):
        assert 0.4 * r["checkpoint_bytes"] < r["bytes_read"] < 0.55 * r["checkpoint_bytes"]
        assert len(r["files"]) > 1
    # PP 2 (Qwen3, 11 tensors a layer): stage 0 the embedding and layer 0, stage 1 layer 1, the final norm
    # and the embedding again (the tied output layer's copy)
    pp = _case(results, "qwen3_pp2_tied")
    assert (pp[0]["tensors_read"], pp[1]["tensors_read"], pp[0]["checkpoint_tensors"]) == (12, 13, 24)
    # EP 2: 21 non-expert tensors and 2 of the 4 experts (x 3 tensors x 2 layers) per rank, of 45
    ep = _case(results, "qwen3_moe_ep2")
    assert [r["tensors_read"] for r in ep] == [33, 33] and ep[0]["checkpoint_tensors"] == 45


@pytest.mark.slow
def test_config_values_reach_megatron(results):
    r = _case(results, "qwen2_tp2_sharded")[0]
    assert r["rope_theta"] == 12345.5 and r["norm_epsilon"] == 1e-5


@pytest.mark.slow
def test_a_bad_checkpoint_on_one_rank_raises_on_every_rank(results):
    r0, r1 = (r["errors"] for r in _case(results, "qwen2_tp1"))
    assert r1["raised"] == r0["raised"] == "CheckpointError"
    assert "'model.layers.1.mlp.down_proj.weight'" in r1["msg"] and "broken" in r1["msg"]
    assert "another rank" in r0["msg"]
    assert r0["intact"] and r1["intact"]  # nothing written on either rank


GRAD_TOL = 1e-5  # relative to the largest gradient
GRAD_CASES = [c["name"] for c in CASES if c.get("grad")]


@pytest.mark.slow
@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients_through_pipeline_forward_equal_transformers(results, name):
    # pipeline_forward + finish_grads (tied embedding over PP stages, experts seen EP times): the gradient of
    # one loss, in HF layout by the forward plan, equals transformers' gradient of it
    g = _case(results, name)[0]["grad"]
    assert g["names_equal"]
    assert g["max_abs_diff"] <= GRAD_TOL * g["scale"], g
    assert abs(g["grad_norm"] - g["hf_grad_norm"]) <= GRAD_TOL * g["hf_grad_norm"], (
        g
    )  # grad_norm over the grid


@pytest.mark.slow
@pytest.mark.parametrize("name", GRAD_CASES)
def test_a_few_sgd_steps_follow_transformers(results, name):
    per_rank = _case(results, name)
    hf_losses = per_rank[0]["train"]["hf_losses"]
    losses = [r["train"]["losses"] for r in per_rank if r["train"]["losses"]]
    assert losses and all(len(x) == 3 for x in losses)
    assert hf_losses[-1] < hf_losses[0]  # the steps do something
    for x in losses:
        assert max(abs(a - b) for a, b in zip(x, hf_losses)) <= 1e-5, (x, hf_losses)
