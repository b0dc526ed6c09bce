"""stream_buckets(inplace=True): tensors a training rank holds as one contiguous range of its own parameter
are yielded as views of it (no gather, no copy, no scratch), gather buckets no rank needs are skipped, and
buckets with nothing to exchange are copied straight from the parameters. The plan's rule is checked
against the reference layout for every rank of multi-rank layouts (TP 2, PP 2, EP 2; single process); the
stream on one process (training TP 1) yields the same tensors as without in place, with the measured peak
within what is still copied. The multi-process Megatron cases (TP 2 x PP 2, TP 1, TP 1 x EP 2, ... against
verl's own export) are in verl_tests/test_verl_weights.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from msrl_core.reshard import Parallel, ReshardError, megatron_to_vllm, reference, stream_buckets, to_hf
from msrl_core.reshard.memory import MemoryProbe
from reshard_util import CONFIGS, gathered_bucket, random_shards

BUCKET = 16 << 10
HERE = os.path.dirname(os.path.abspath(__file__))
# two gloo ranks: (config, training layout, names); the group is the layout's only dimension of size 2
PAIR_CASES = [
    ("qwen3_moe", {"ep": 2}, "hf"),  # own experts in place, the other rank's from a compacted exchange
    ("qwen3_moe", {"ep": 2}, "vllm"),  # w13/w2 fused from both ranks: the own slot is read, kept
    ("qwen2_gqa_bias", {"tp": 2}, "hf"),  # only the norms in place; every other bucket exchanged
]


def _pair_worker(rank: int, world: int, port: int, cases: list, out: str) -> None:
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from msrl_core.reshard import Parallel, megatron_to_vllm, stream_buckets, to_hf
    from reshard_util import CONFIGS, random_shards

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    res: dict = {}
    for name, dims, names in cases:
        cfg = CONFIGS[name]
        train = Parallel(tp=dims.get("tp", 1), ep=dims.get("ep", 1))
        plan = to_hf(cfg, train) if names == "hf" else megatron_to_vllm(cfg, train, Parallel(tp=2, ep=2))
        groups = {k: group for k in dims}
        params = random_shards(plan, seed=5)[(0, rank if "tp" in dims else 0, rank if "ep" in dims else 0)]
        kw = dict(names=names, bucket_bytes=BUCKET, infer_rank=rank if names == "vllm" else None)
        base = {n: t.clone() for b in stream_buckets(params, plan, groups, **kw) for n, t in b}
        stream = stream_buckets(params, plan, groups, inplace=True, **kw)
        got = {n: t.clone() for b in stream for n, t in b}
        t = stream.telemetry
        biggest = max(b.local_bytes for b in plan.buckets(BUCKET) if b.members > 1)
        res[f"{name}/{names}"] = {
            "names_equal": sorted(got) == sorted(base),
            "mismatch": [n for n in base if n in got and not torch.equal(got[n], base[n])][:5],
            "inplace": t.inplace_tensors,
            "scratch_views": t.scratch_views,
            "gather_scratch": t.gather_scratch_bytes,
            "biggest_member_bytes": biggest,
        }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair():
    from megatron_harness import spawn

    return spawn(_pair_worker, PAIR_CASES, 2, 300.0, "in-place stream workers")


@pytest.mark.parametrize("case", [f"{n}/{x}" for n, _, x in PAIR_CASES])
def test_two_ranks_inplace_equals_the_copying_stream(pair, case):
    """Over gloo (p2p exchange): the in-place stream yields what the copying stream yields on both ranks;
    at EP 2 in HF names each rank's scratch holds only the other rank's slot (compacted, sent straight from
    the parameters), and the other rank's experts are views of it."""
    for rank in (0, 1):
        r = pair[rank][case]
        assert r["names_equal"] and not r["mismatch"], (rank, r)
        assert r["inplace"] > 0
        if case == "qwen3_moe/hf":
            assert r["scratch_views"] == 2 * 2 * 3  # 2 layers x the other rank's 2 experts x gate, up, down
            assert r["gather_scratch"] == r["biggest_member_bytes"], r  # one slot, not two


@pytest.mark.parametrize(
    "cfg_name,train,infer",
    [
        ("qwen2_gqa_bias", Parallel(tp=1), None),
        ("qwen2_gqa_bias", Parallel(tp=2, pp=2), None),
        ("llama_mqa_tied", Parallel(tp=2), None),
        ("qwen3_moe", Parallel(tp=1, ep=2), None),
        ("qwen3_moe", Parallel(tp=1, pp=2, ep=2), None),
        ("qwen2_moe_shared", Parallel(tp=2), None),
        ("qwen2_gqa_bias", Parallel(tp=1), Parallel(tp=1)),  # vLLM names: gate_up_proj is fc1 itself
        ("qwen3_moe", Parallel(tp=2, ep=2), Parallel(tp=2)),
    ],
)
def test_inplace_views_equal_the_reference_on_every_rank(cfg_name, train, infer):
    cfg = CONFIGS[cfg_name]
    plan = to_hf(cfg, train) if infer is None else megatron_to_vllm(cfg, train, infer)
    shards = random_shards(plan)
    hf = reference.megatron_to_hf(cfg, train, shards)
    for r in range(plan.infer.tp):
        exp = hf if infer is None else reference.hf_to_vllm(cfg, infer, r, hf)
        seen = 0
        for (s, tp, ep), params in shards.items():
            views = plan.inplace_targets(r, s, tp, ep)
            for name, (param, off) in views.items():
                t = exp[name]
                got = params[param].reshape(-1)[off : off + t.numel()].view(t.shape)
                assert torch.equal(got, t), (name, (s, tp, ep))
            seen += len(views)
        assert seen > 0
    if train.pp > 1:  # the other stages need every bucket through the PP broadcast
        assert plan.needed_buckets(BUCKET) == frozenset(range(len(plan.buckets(BUCKET))))


def test_what_is_in_place_at_tp1_ep2():
    """Qwen3-MoE, TP 1 x EP 2, HF names: on each EP rank everything but q/k/v and the other rank's experts;
    the expert buckets are still exchanged, the dense buckets without q/k/v are skipped by every rank."""
    cfg = CONFIGS["qwen3_moe"]
    plan = to_hf(cfg, Parallel(tp=1, ep=2))
    names = [t.name for t in plan.targets(0)]
    half = cfg.num_experts // 2
    for ep in (0, 1):
        views = plan.inplace_targets(0, 0, 0, ep)
        not_in_place = {n for n in names if n not in views}
        qkv = {n for n in names if any(f"self_attn.{w}_proj" in n for w in "qkv")}
        other = {
            n
            for n in names
            if ".experts." in n and (int(n.split(".experts.")[1].split(".")[0]) < half) == (ep == 1)
        }
        assert not_in_place == qkv | other
    buckets = plan.buckets(BUCKET)
    needed = plan.needed_buckets(BUCKET)
    for b in buckets:
        has_qkv = any("linear_qkv" in n for n in b.names)
        assert (b.index in needed) == (b.group == "ep" or has_qkv), b.names


@pytest.mark.parametrize("train", [Parallel(tp=1, ep=2), Parallel(tp=1, pp=2, ep=2), Parallel(tp=2, ep=2)])
def test_views_of_the_gather_scratch_are_the_other_ranks_experts(train):
    """In place mode, a tensor that is one contiguous range of a gathered bucket (another EP rank's expert)
    is yielded as a view of the gather scratch, right after that bucket's gather: checked against the
    bucket a real exchange produces (reshard_util.gathered_bucket) for each rank."""
    cfg = CONFIGS["qwen3_moe"]
    plan = to_hf(cfg, train)
    shards = random_shards(plan)
    ref = reference.megatron_to_hf(cfg, train, shards)
    buckets = plan.buckets(BUCKET)
    half = cfg.num_experts // 2
    for (s, tp, ep), _params in shards.items():
        views = plan.inplace_targets(0, s, tp, ep)
        schedule, _ = plan.stream_schedule(BUCKET, 0, frozenset(views))
        seen = set()
        for sb in schedule:
            for name, off, shape in sb.gathered:
                k = sb.gather[
                    -1
                ]  # the last gather of the stream bucket: nothing overwrites it before the yield
                buf = gathered_bucket(plan, buckets[k], shards, tp_rank=tp, ep_rank=ep)
                n = ref[name].nbytes
                got = torch.from_numpy(buf[off : off + n].copy()).view(ref[name].dtype).view(shape)
                assert torch.equal(got, ref[name]), (name, (s, tp, ep))
                seen.add(name)
        layer = {n: int(n.split(".")[2]) for n in ref if n.startswith("model.layers.")}
        other = {
            n
            for n in ref
            if ".experts." in n
            and (int(n.split(".experts.")[1].split(".")[0]) < half) == (ep == 1)
            and layer[n] // (cfg.num_layers // train.pp) == s
        }
        assert seen >= other, sorted(other - seen)[:3]  # every expert of the other EP rank on this stage


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("names", ["hf", "vllm"])
def test_inplace_stream_yields_the_same_tensors(cfg_name, names):
    cfg = CONFIGS[cfg_name]
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=1))
    params = random_shards(plan)[(0, 0, 0)]
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    base = {
        n: t.clone() for b in stream_buckets(params, plan, {}, names=names, bucket_bytes=BUCKET) for n, t in b
    }
    stream = stream_buckets(params, plan, {}, names=names, bucket_bytes=BUCKET, inplace=True)
    got, aliasing = {}, 0
    for bucket in stream:
        for n, t in bucket:
            assert n not in got, f"{n} yielded twice"
            aliasing += t.untyped_storage().data_ptr() in storages
            got[n] = t.clone()
    assert sorted(got) == sorted(base)
    assert all(torch.equal(got[n], base[n]) for n in base)
    tele = stream.telemetry
    assert tele.finished and tele.inplace_tensors == aliasing > 0
    assert tele.bytes_yielded == sum(t.nbytes for t in base.values())
    # training TP, EP, PP 1: nothing is gathered; what is not in place is copied from the parameters
    assert tele.gather_scratch_bytes == 0 and tele.direct_buckets == tele.gather_buckets
    assert tele.gather_buckets + tele.skipped_buckets == len(
        plan.hf_plan().buckets(BUCKET) if names == "hf" else plan.buckets(BUCKET)
    )
    copied = sum(t.nbytes for t in base.values()) - tele.bytes_inplace
    assert tele.output_scratch_bytes <= copied + 64 * len(base)


def test_measured_peak_is_what_is_still_copied():
    """The allocations during an in-place stream (a dispatch-mode tally) are the output scratch of the
    copied tensors alone: for Llama MQA every HF tensor is one contiguous range of a parameter, so the
    stream allocates nothing; for Qwen2 GQA only q/k/v are copied."""
    for cfg_name, expect_zero in (("llama_mqa_tied", True), ("qwen2_gqa_bias", False)):
        plan = to_hf(CONFIGS[cfg_name], Parallel(tp=1))
        params = random_shards(plan)[(0, 0, 0)]
        stream = stream_buckets(params, plan, {}, names="hf", bucket_bytes=BUCKET, inplace=True)
        sink = {}
        with MemoryProbe() as m:
            for bucket in stream:
                for n, t in bucket:
                    sink[n] = t.sum()  # a consumer reading each tensor (0-d results: 64 B blocks)
        tele = stream.telemetry
        assert tele.gather_scratch_bytes == 0
        if expect_zero:
            assert tele.output_scratch_bytes == 0 and tele.skipped_buckets == len(plan.buckets(BUCKET))
        else:
            views = plan.inplace_targets()
            copied = [t for t in plan.targets() if t.name not in views]
            assert {t.name.split(".")[-2] for t in copied} == {"q_proj", "k_proj", "v_proj"}
            assert 0 < tele.output_scratch_bytes <= sum(t.numel * plan.itemsize + 64 for t in copied)
        assert m.peak_bytes <= tele.output_scratch_bytes + 64 * len(sink) + (4 << 10), (
            cfg_name,
            m.peak_bytes,
        )


def test_inplace_bad_value_is_refused_before_anything_runs():
    plan = to_hf(CONFIGS["qwen2_gqa_bias"], Parallel(tp=1))
    params = random_shards(plan)[(0, 0, 0)]
    with pytest.raises(ReshardError, match="inplace must be True or False, got 'yes'"):
        stream_buckets(params, plan, {}, inplace="yes")


@pytest.mark.parametrize(
    "cfg_name,train",
    [
        ("qwen2_gqa_bias", Parallel(tp=1)),
        ("qwen2_gqa_bias", Parallel(tp=1, pp=2)),  # padding-only embedding chunks: nobody reads them
        ("llama_mqa_tied", Parallel(tp=2)),
        ("qwen3_moe", Parallel(tp=1, ep=2)),
        ("qwen3_moe", Parallel(tp=2, ep=2)),
        ("qwen2_moe_shared", Parallel(tp=1)),
    ],
)
def test_needed_buckets_is_its_definition(cfg_name, train):
    """The pruned search equals the definition: a bucket is needed iff, for some training rank (every
    stage x TP x EP rank) and inference rank, a tensor read from it is not in place there."""
    import numpy as np

    cfg = CONFIGS[cfg_name]
    for plan in (to_hf(cfg, train), megatron_to_vllm(cfg, train, Parallel(tp=2))):
        for bb in (4 << 10, BUCKET):
            want: set[int] = set()
            for r in range(plan.infer.tp):
                layout, _ = plan.infer_layout(r)
                names = list(layout)
                offs = np.asarray([layout[n][0] for n in names])
                for k, d in enumerate(plan.bucket_descriptors(bb, r)):
                    readers = {names[i] for i in np.searchsorted(offs, d[:, 1], side="right") - 1}
                    for s in range(train.pp):
                        for tp in range(train.tp):
                            for ep in range(train.ep):
                                if readers - plan.inplace_targets(r, s, tp, ep).keys():
                                    want.add(k)
            assert plan.needed_buckets(bb) == frozenset(want), (plan, bb)
