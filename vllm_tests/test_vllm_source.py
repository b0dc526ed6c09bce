"""``BucketSource`` is a vLLM ``WeightSource``: vLLM's own consumers (metadata, the default per-layer
``iter_groups`` with its order check) accept it, and it streams every HF tensor exactly, bucket by bucket."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python_tests"))

from vllm.distributed.weight_transfer.base import WeightSource, layerwise_groups  # noqa: E402

from msrl_core.reshard import Parallel, ReshardError, reference, to_hf  # noqa: E402
from msrl_core.reshard.vllm.source import BucketSource  # noqa: E402
from reshard_util import CONFIGS, random_shards  # noqa: E402


@pytest.mark.parametrize("name", ["qwen2_gqa_bias", "qwen3_moe"])
def test_bucket_source_through_vllms_group_iteration(name):
    cfg = CONFIGS[name]
    plan = to_hf(cfg, Parallel(tp=1))
    params = random_shards(plan, seed=5)[(0, 0, 0)]
    exp = reference.megatron_to_hf(cfg, plan.train, {(0, 0, 0): params})
    src = BucketSource.from_stream(params, plan, {}, bucket_bytes=8 << 10)
    assert isinstance(src, WeightSource)
    meta = src.metadata()
    assert sorted(m.name for m in meta) == sorted(exp)
    assert all(m.shape == tuple(exp[m.name].shape) and m.dtype == torch.float32 for m in meta)
    for _ in range(2):  # a fresh pass each round
        got = {}
        groups = list(src.iter_groups())  # vLLM's default: per-layer groups, order checked against metadata
        assert [g[0] for g in groups] == layerwise_groups([m.name for m in meta])
        for names, tensors in groups:
            got.update({n: t.clone() for n, t in zip(names, tensors)})
        assert all(torch.equal(got[n], exp[n]) for n in exp)
        assert src.last.telemetry.buckets > 1
    # plain iteration: views valid until the next tensor (what a per-tensor sender consumes)
    seen = {n: t.clone() for n, t in src}
    assert all(torch.equal(seen[n], exp[n]) for n in exp)
    kept = dict(iter(src))  # views kept past their bucket: overwritten (why stable= exists)
    assert not all(torch.equal(kept[n], exp[n]) for n in exp)
    stable = BucketSource.from_stream(params, plan, {}, stable=True, bucket_bytes=8 << 10)
    held = dict(iter(stable))  # vLLM's unpacked IPC sender keeps every tensor until the end
    assert all(torch.equal(held[n], exp[n]) for n in exp)


def test_bucket_source_rejects_a_stream_that_disagrees_with_its_metadata():
    cfg = CONFIGS["qwen2_gqa_bias"]
    plan = to_hf(cfg, Parallel(tp=1))
    params = random_shards(plan)[(0, 0, 0)]
    good = BucketSource.from_stream(params, plan, {}, bucket_bytes=8 << 10)
    swapped = BucketSource(lambda: reversed(list(good._buckets())), good.metadata())
    with pytest.raises(ReshardError, match="bucket stream yielded 'lm_head.weight'"):
        list(swapped)
