"""stream_buckets on one process (training TP 1, host runtime): every inference tensor exactly once, equal to
the reference layout, in HF and vLLM per-rank names; scratch reused; measured peak within shard + buckets.
The multi-process Megatron case (TP 2, logits of a transformers model loaded bucket by bucket) is in
test_reshard_megatron.py."""

from __future__ import annotations

import pytest
import torch

from msrl_core.reshard import (
    Parallel,
    ReshardError,
    megatron_to_vllm,
    reference,
    stream_buckets,
    to_hf,
)
from msrl_core.reshard.memory import MemoryProbe
from reshard_util import CONFIGS, random_shards

BUCKET = 16 << 10


def shards_of(plan, seed=0):
    return random_shards(plan, seed)[(0, 0, 0)]


@pytest.mark.parametrize(
    "cfg_name,infer,rank",
    [
        ("qwen2_gqa_bias", Parallel(tp=2), 1),
        ("llama_mqa_tied", Parallel(tp=4), 3),
        ("qwen3_moe", Parallel(tp=2, ep=2), 1),
        ("qwen2_moe_shared", Parallel(tp=2), 0),
    ],
)
def test_vllm_names_every_tensor_once_equal_to_the_reference(cfg_name, infer, rank):
    cfg = CONFIGS[cfg_name]
    plan = megatron_to_vllm(cfg, Parallel(tp=1), infer)
    params = shards_of(plan)
    exp = reference.hf_to_vllm(
        cfg, infer, rank, reference.megatron_to_hf(cfg, plan.train, {(0, 0, 0): params})
    )
    stream = stream_buckets(params, plan, {}, names="vllm", infer_rank=rank, bucket_bytes=BUCKET)
    seen: dict[str, torch.Tensor] = {}
    ptrs = set()
    for bucket in stream:
        assert bucket, "no empty buckets"
        for name, t in bucket:
            assert name not in seen, f"{name} yielded twice"
            seen[name] = t.clone()
            ptrs.add(t.untyped_storage().data_ptr())
    assert sorted(seen) == sorted(exp)
    bad = [n for n in exp if not torch.equal(seen[n], exp[n])]
    assert not bad, bad[:5]
    tele = stream.telemetry
    assert tele.finished and tele.buckets == len(stream) > 1
    assert len(ptrs) == 1  # every bucket is a view of the one reused output scratch
    assert tele.bytes_yielded == sum(t.nbytes for t in exp.values())
    assert tele.output_scratch_bytes <= max(BUCKET, max(t.nbytes for t in exp.values())) + 64 * len(exp)


def test_hf_names_from_a_vllm_plan_and_from_to_hf():
    cfg = CONFIGS["qwen2_moe_shared"]
    vplan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=2))
    params = shards_of(vplan)
    exp = reference.megatron_to_hf(cfg, vplan.train, {(0, 0, 0): params})
    for plan in (vplan, to_hf(cfg, Parallel(tp=1))):
        got = {
            n: t.clone()
            for b in stream_buckets(params, plan, {}, names="hf", bucket_bytes=BUCKET)
            for n, t in b
        }
        assert sorted(got) == sorted(exp)
        assert all(torch.equal(got[n], exp[n]) for n in exp)
    with pytest.raises(ReshardError, match="names='vllm' needs a megatron_to_vllm"):
        stream_buckets(params, to_hf(cfg, Parallel(tp=1)), {}, names="vllm")
    with pytest.raises(ReshardError, match="names must be 'hf' or 'vllm', got 'sglang'"):
        stream_buckets(params, vplan, {}, names="sglang")


def test_zero_padding_rows_are_cleared_in_the_reused_scratch():
    """vLLM's padded vocab rows must be zero in every bucket, though the scratch held other data before."""
    cfg = CONFIGS["llama_mqa_tied"]  # vocab 997 -> padded 1024: the last rank's shard has zero rows
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=2))
    params = shards_of(plan)
    got = {
        n: t.clone()
        for b in stream_buckets(params, plan, {}, infer_rank=1, bucket_bytes=4 << 10)
        for n, t in b
    }
    emb = got["model.embed_tokens.weight"]
    assert torch.count_nonzero(emb[997 - 512 :]) == 0 and torch.count_nonzero(emb[: 997 - 512]) > 0


def _consume(stream, model_params, extra_copy=False):
    for bucket in stream:
        for name, t in bucket:
            src = t.clone() if extra_copy else t
            model_params[name].copy_(src)


def test_measured_peak_is_within_shard_plus_one_bucket():
    """Streaming into an engine's existing weights: the allocations made during the stream (measured by a
    dispatch-mode tally, not summed) stay within the gather scratch + the output bucket + 64 KiB; the
    training shard and the engine's weights exist before. A consumer that makes one extra temporary copy
    per tensor breaks the bound (the measurement sees it)."""
    cfg = CONFIGS["qwen2_gqa_bias"]
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=1))
    params = shards_of(plan)
    exp = reference.hf_to_vllm(
        cfg, plan.infer, 0, reference.megatron_to_hf(cfg, plan.train, {(0, 0, 0): params})
    )
    engine = {n: torch.zeros_like(t) for n, t in exp.items()}  # the engine's own weights
    allowance = 64 << 10
    stream = stream_buckets(params, plan, {}, bucket_bytes=BUCKET)
    with MemoryProbe() as m:
        _consume(stream, engine)
    tele = stream.telemetry
    bound = tele.gather_scratch_bytes + tele.output_scratch_bytes + allowance
    assert all(torch.equal(engine[n], exp[n]) for n in exp)
    assert tele.gather_scratch_bytes + tele.output_scratch_bytes <= 2 * BUCKET + max(
        t.nbytes for t in exp.values()
    )
    assert 0 < m.peak_bytes <= bound, (m.peak_bytes, bound)
    biggest = max(t.nbytes for t in exp.values())
    with MemoryProbe() as m2:  # the same stream with a temporary clone of each tensor: caught
        _consume(stream_buckets(params, plan, {}, bucket_bytes=BUCKET), engine, extra_copy=True)
    assert m2.peak_bytes >= m.peak_bytes + biggest
    print(f"stream peak {m.peak_bytes} B, bound {bound} B, with an extra copy {m2.peak_bytes} B")


def test_switcher_stream_uses_its_engine_and_matches_stream_buckets():
    import msrl_core
    from msrl_core.reshard import Switcher

    cfg = CONFIGS["qwen3_moe"]
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=2, ep=2))
    params = shards_of(plan)
    engine = msrl_core.CopyEngine()
    sw = Switcher(plan, engine=engine)
    assert sw.engine is engine
    a = {n: t.clone() for b in sw.stream(params, {}, infer_rank=1, bucket_bytes=BUCKET) for n, t in b}
    b = {
        n: t.clone()
        for b in stream_buckets(params, plan, {}, infer_rank=1, bucket_bytes=BUCKET)
        for n, t in b
    }
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
