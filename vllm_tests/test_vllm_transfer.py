"""Optional tier: resharded Megatron TP 2 weights into a live multi-process vLLM engine through vLLM's
weight-transfer API (backend ``"msrl"``), for TP_i = 1 and TP_i = 2. See vllm_harness.py for the cases.

vLLM's own backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress) all need CUDA, so
our ``BucketSource`` (a vLLM ``WeightSource``) is carried here by our backend in the HF layout, which loads
through vLLM's own ``model.load_weights`` + layerwise reload exactly as vLLM's IPC backend does.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytest.importorskip("torch")

import vllm_harness  # noqa: E402

TPS = [1, 2]


@pytest.fixture(scope="module")
def results():
    res = vllm_harness.run(TPS)
    assert "error" not in res, res.get("traceback")
    assert res["ref_step_changes_tokens"], "the training step must change the reference's greedy tokens"
    return res


def _matches(case) -> None:
    assert case["tokens_equal"], (case["tokens"], case["ref_tokens"])
    assert case["lp_diff"] <= 1e-3, case["lp_diff"]


@pytest.mark.parametrize("ti", TPS)
def test_dummy_weights_differ(results, ti):
    assert not results[f"tp{ti}"]["dummy"]["tokens_equal"]


@pytest.mark.parametrize("ti", TPS)
def test_weight_source_through_weight_transfer_api(results, ti):
    r = results[f"tp{ti}"]["source_hf"]
    _matches(r)
    assert r["chunks"] > 1  # streamed: several chunks, never the whole model at once
    assert 0 < r["stream_output_scratch"] <= 512 << 10


@pytest.mark.parametrize("ti", TPS)
def test_per_rank_backend_second_step_replaces_first(results, ti):
    r = results[f"tp{ti}"]
    _matches(r["per_rank"])
    assert r["per_rank"]["swapped_out"]
    assert r["per_rank_changed_outputs"]
    # each inference rank received only its own slices: TP_i ranks, each 1/TP_i of the sharded tensors
    sizes = list(r["per_rank"]["per_rank_bytes"].values())
    assert len(sizes) == ti and len(set(sizes)) == 1
    if ti == 2:
        assert sizes[0] < 0.6 * results["tp1"]["per_rank"]["per_rank_bytes"]["0"]


@pytest.mark.parametrize("ti", TPS)
def test_corrupted_slice_is_caught(results, ti):
    r = results[f"tp{ti}"]
    assert not (r["corrupt"]["tokens_equal"] and r["corrupt"]["lp_diff"] <= 1e-3), r["corrupt"]
    _matches(r["restored"])  # streamed per-rank chunks (StreamSource) repaired it
    assert r["restored"]["chunks"] > 1
    assert r["restored"]["per_rank_bytes"] == r["per_rank"]["per_rank_bytes"]


@pytest.mark.parametrize("ti", TPS)
@pytest.mark.parametrize(
    "label,needle",
    [("bad_shape", "got shape ("), ("bad_dtype", "dtype torch.bfloat16"), ("bad_name", "qkv.weight")],
)
def test_bad_input_rejected_engine_unchanged(results, ti, label, needle):
    r = results[f"tp{ti}"][label]
    assert r["raised"] == "ReshardError", r
    assert needle in r["msg"] and "nothing was loaded" in r["msg"], r["msg"]
    assert r["unchanged"]
