"""The mixed layouts in 4 spawned processes (CPU, gloo, fp32): TP 2 x PP 2 (a tied Qwen2) and TP 2 x EP 2 (a
Qwen3-MoE, experts not TP-sharded). Megatron's logits after load_hf_checkpoint equal transformers' (<= 1e-5),
gradients through pipeline_forward + finish_grads equal transformers' (relative 1e-5), three SGD steps give
transformers' losses, and the save back is the source checkpoint."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed")
pytest.importorskip("transformers", reason="transformers not installed")

import models_harness  # noqa: E402
from test_models_load import ATTN, GRAD_TOL, MOE, TOL, _case  # noqa: E402

CASES = [
    dict(
        name="qwen2_tp2_pp2_tied",
        arch="qwen2",
        tp=2,
        pp=2,
        grad=True,
        hf=dict(
            vocab_size=1000, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, **ATTN
        ),
    ),
    dict(
        name="qwen3_moe_tp2_ep2",
        arch="qwen3_moe",
        tp=2,
        ep=2,
        grad=True,
        hf=dict(MOE, norm_topk_prob=True),
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = [dict(c, dir=str(tmp_path_factory.mktemp(c["name"]))) for c in CASES]
    return models_harness.run(cases, world=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_mixed_layouts_are_exact(results, name):
    per_rank = _case(results, name)
    with_logits = [r for r in per_rank if "logits_max_abs_diff" in r]
    assert len(with_logits) == (2 if name.endswith("pp2_tied") else 4)  # PP 2: the last stage's 2 TP ranks
    for r in with_logits:
        assert r["logits_max_abs_diff"] <= TOL and r["logits_scale"] > 1.0
    r0 = per_rank[0]
    g = r0["grad"]
    assert g["names_equal"] and g["max_abs_diff"] <= GRAD_TOL * g["scale"], g
    assert abs(g["grad_norm"] - g["hf_grad_norm"]) <= GRAD_TOL * g["hf_grad_norm"]
    hf_losses = r0["train"]["hf_losses"]
    for r in per_rank:
        if r["train"]["losses"]:
            assert max(abs(a - b) for a, b in zip(r["train"]["losses"], hf_losses)) <= 1e-5
    assert r0["saved_names_equal"] and r0["saved_max_abs_diff"] == 0.0 and r0["saved_logits_equal"]
