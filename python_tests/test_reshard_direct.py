"""The switch with nothing to gather (training TP, EP and PP 1): one direct fused copy per parameter from
its own storage into the inference buffer — no pack into a scratch, no gather, no collective — and the
rollout weights equal the training weights bit for bit; the swap back restores every byte exactly. And with
something to gather, the pack on a CPU device runs on the copy engine, and the ranks agree per 16 MiB
gathered rather than per (small) bucket."""

from __future__ import annotations

import pytest
import torch

import msrl_core
from msrl_core.reshard import Parallel, ReshardError, Switcher, megatron_to_vllm, reference, steps, to_hf
from reshard_util import CONFIGS

BUCKET = 16 << 10


def random_bits(plan, seed: int = 0) -> dict:
    """Training parameters holding random bit patterns: NaNs with payloads, infinities, -0.0, subnormals
    (a float comparison would miss a copy that canonicalises them; these are compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, plan.cfg.dtype)
    out = {}
    for name, shape, _ in plan.stage_params[0]:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        out[name] = torch.nn.Parameter(raw.view(dt).view(shape), requires_grad=False)
    return out


def as_bytes(t) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class RecordingEngine:
    """A real engine that records the source and destination pointers of every fused copy."""

    def __init__(self) -> None:
        self.e = msrl_core.CopyEngine()
        self.executes: list[tuple[int, int]] = []
        self.batches = 0

    def execute(self, plan, dst, src, **k):
        self.executes.append((int(src.data_ptr()), int(src.numel() * src.element_size())))
        return self.e.execute(plan, dst, src, **k)

    def copy_many(self, *a, **k):
        self.batches += 1
        return self.e.copy_many(*a, **k)


def _forbid(*_a, **_k):
    raise AssertionError("a TP 1 switch must not pack, gather or run a collective")


@pytest.mark.parametrize("layout", ["hf", "vllm"])
def test_tp1_switch_does_no_gather_and_copies_straight_from_the_parameters(layout, monkeypatch):
    cfg = CONFIGS["qwen2_gqa_bias"]
    plan = (
        to_hf(cfg, Parallel(tp=1))
        if layout == "hf"
        else megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=1))
    )
    params = random_bits(plan)
    snap = {k: as_bytes(p).clone() for k, p in params.items()}
    ptrs = {int(p.data_ptr()) for p in params.values()}  # before the swap-out frees them
    monkeypatch.setattr(steps.Gatherer, "gather", _forbid)
    monkeypatch.setattr(steps, "_collective", _forbid)
    monkeypatch.setattr(torch, "_foreach_copy_", _forbid)
    engine = RecordingEngine()
    flat, views = plan.allocate_inference()
    s = Switcher(plan).switch(params, flat, {}, BUCKET, engine=engine, measure=True)
    t = s.telemetry
    assert t.gather == "none" and t.scratch_bytes == 0 and t.bytes_gathered == 0 and t.pack_s == 0.0
    # one fused copy per parameter, each reading that parameter's own bytes (no scratch in between)
    assert len(engine.executes) == len(params) and {p for p, _ in engine.executes} <= ptrs
    assert engine.batches == 1  # the swap-out: one batch
    assert t.measured_switch_bytes <= 4 << 10  # no scratch, no temporaries
    s.swap_back().wait()
    # the rollout weights are the reference reshard, bit for bit
    exp = reference.megatron_to_hf(cfg, plan.train, {(0, 0, 0): {k: p.detach() for k, p in params.items()}})
    if layout == "vllm":
        exp = reference.hf_to_vllm(cfg, plan.infer, 0, exp)
    assert set(exp) == set(views)
    assert all(torch.equal(as_bytes(views[k]), as_bytes(exp[k])) for k in exp)
    # HF layout (the trainer's): every tensor made from one unfused parameter is that parameter's bytes (a
    # prefix of them: Megatron's vocabulary padding rows stay behind; vLLM pads with zeros of its own)
    same = 0
    for name, srcs in plan.name_map(0).items() if layout == "hf" else ():
        if len(srcs) == 1 and not any(k in srcs[0][2] for k in ("linear_qkv", "linear_fc1")):
            v = as_bytes(views[name])
            assert torch.equal(v, snap[srcs[0][2]][: v.numel()]), name
            same += 1
    assert layout != "hf" or same >= 2 * cfg.num_layers + 2  # o_proj/down_proj per layer, embeddings...
    # and the swap back restored every training byte
    assert all(torch.equal(as_bytes(params[k]), snap[k]) for k in snap)


def test_tp1_swap_in_restores_every_byte_over_repeated_switches():
    cfg = CONFIGS["llama_mqa_tied"]
    plan = to_hf(cfg, Parallel(tp=1))
    params = random_bits(plan, seed=3)
    snap = {k: as_bytes(p).clone() for k, p in params.items()}
    sw = Switcher(plan)
    flat, _ = plan.allocate_inference()
    for i in range(3):
        s = sw.switch(params, flat, {}, BUCKET)
        assert all(p.untyped_storage().nbytes() == 0 for p in params.values())
        assert s.telemetry.freed_bytes == s.telemetry.train_bytes
        s.swap_back().wait()
        assert all(torch.equal(as_bytes(params[k]), snap[k]) for k in snap), i
        with torch.no_grad():  # training changes the weights between switches: the next switch copies those
            for p in params.values():
                p.view(torch.uint8).reshape(-1)[0] ^= 0x5A
        snap = {k: as_bytes(p).clone() for k, p in params.items()}


def test_direct_descriptors_are_the_bucket_descriptors_rebased():
    """Same descriptor count and bytes as the bucket plan (rows, row bytes and pitches unchanged); only the
    source offset moves from the packed bucket into the parameter."""
    cfg = CONFIGS["qwen2_gqa_bias"]
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=2))
    direct = steps.direct_descriptors(plan, BUCKET, 1)
    bucketed = [d for d in plan.bucket_descriptors(BUCKET, 1) if len(d)]
    assert sum(len(d) for d in direct.values()) == sum(len(d) for d in bucketed)
    moved = torch.cat([torch.from_numpy(d[:, 1:]) for d in direct.values()])
    kept = torch.cat([torch.from_numpy(d[:, 1:]) for d in bucketed])
    assert sorted(map(tuple, moved.tolist())) == sorted(map(tuple, kept.tolist()))
    shapes = plan.train_shapes(0)
    for name, d in direct.items():  # every source range lies inside its parameter
        nbytes = int(torch.Size(shapes[name]).numel()) * plan.itemsize
        assert int(d[:, 0].min()) >= 0
        assert int((d[:, 0] + (d[:, 2] - 1) * d[:, 4] + d[:, 3]).max()) <= nbytes, name
    with pytest.raises(ReshardError, match="TP, EP and PP 1"):
        steps.direct_descriptors(megatron_to_vllm(cfg, Parallel(tp=2), Parallel(tp=1)), BUCKET, 0)


def test_the_pack_on_a_cpu_device_is_one_copy_engine_batch_per_bucket(monkeypatch):
    """TP 2: the local shards are packed into this member's slot of the gathered bucket by the copy engine
    (one copy_many batch), not by torch's intra-op threads; the slot holds exactly the shards' bytes."""
    from reshard_util import gathered_bucket, random_shards

    cfg = CONFIGS["qwen2_gqa_bias"]
    plan = to_hf(cfg, Parallel(tp=2))
    shards = random_shards(plan)
    params = shards[(0, 0, 0)]
    monkeypatch.setattr(torch, "_foreach_copy_", _forbid)
    monkeypatch.setattr(steps, "_exchange", lambda *a, **k: None)  # member 0 of a group of 2, no peer
    engine = RecordingEngine()
    prep = steps.Prepared(
        params, 0, 0, {"tp": "p2p", "ep": "p2p"}, torch.device("cpu"), steps.Deadline(60), BUCKET
    )
    gatherer = steps.Gatherer(prep, {}, engine=engine)
    buckets = plan.buckets(BUCKET)
    scratch = torch.zeros(steps.scratch_bytes(buckets, prep.modes), dtype=torch.uint8)
    for b in buckets:
        scratch.zero_()
        gathered, err = gatherer.gather(b, scratch, steps.Deadline(60))
        assert err is None
        want = torch.from_numpy(gathered_bucket(plan, b, shards))[: b.local_bytes]
        assert torch.equal(gathered[: b.local_bytes], want), b.index
    assert engine.batches == len(buckets) and engine.executes == []


def _tp2_rank0_alone(monkeypatch, bucket_bytes: int, fail_at: int | None = None):
    """Rank 0 of a TP 2 switch run alone: the exchange with the (absent) peer is a no-op, every status
    agreement is recorded. Returns the plan, the agreements' verdicts and the raised error (or None)."""
    from msrl_core.reshard import swap
    from reshard_util import random_shards

    plan = to_hf(CONFIGS["qwen2_gqa_bias"], Parallel(tp=2))
    params = random_shards(plan)[(0, 0, 0)]
    verdicts: list[bool] = []

    def agree(ok, *a, **k):
        verdicts.append(bool(ok))
        return ok, True

    monkeypatch.setattr(steps, "_exchange", lambda *a, **k: None)
    monkeypatch.setattr(swap, "agree", agree)
    prep = steps.Prepared(
        params, 0, 0, {"tp": "p2p", "ep": "p2p"}, torch.device("cpu"), steps.Deadline(60), bucket_bytes
    )
    sw = Switcher(plan)
    flat, _ = plan.allocate_inference()
    tele = sw._new_telemetry(prep, flat, [], bucket_bytes, False)

    def fail(b):
        if b is not None and b.index == fail_at:
            raise msrl_core.errors.OutOfMemory(f"injected OOM packing bucket {fail_at}")

    err = None
    try:
        sw._reshard_buckets(prep, {}, flat, bucket_bytes, sw.engine, False, tele, swap._Meter(), fail)
    except Exception as e:
        err = e
    return plan, verdicts, err


def test_the_ranks_agree_per_16_mib_gathered_not_per_small_bucket(monkeypatch):
    """Small buckets: one status agreement before the buckets, one per AGREE_BYTES gathered, one after the
    last; buckets of AGREE_BYTES or more: one per bucket (as before)."""
    from msrl_core.reshard import swap

    monkeypatch.setattr(swap, "AGREE_BYTES", 64 << 10)
    plan, verdicts, err = _tp2_rank0_alone(monkeypatch, 4 << 10)
    buckets = plan.buckets(4 << 10)
    since, want = 0, 1
    for k, b in enumerate(buckets):
        since += b.gathered_bytes
        if since >= 64 << 10 or k == len(buckets) - 1:
            since, want = 0, want + 1
    assert err is None and all(verdicts)
    assert len(verdicts) == want < 1 + len(buckets) // 4, (len(verdicts), len(buckets))
    _, verdicts, _ = _tp2_rank0_alone(monkeypatch, 64 << 10)
    assert len(verdicts) == 1 + len(plan.buckets(64 << 10))


def test_a_failure_between_agreements_is_agreed_at_the_next_one(monkeypatch):
    from msrl_core.reshard import swap

    monkeypatch.setattr(swap, "AGREE_BYTES", 64 << 10)
    plan, verdicts, err = _tp2_rank0_alone(monkeypatch, 4 << 10, fail_at=5)
    assert isinstance(err, msrl_core.reshard.SwitchAborted) and "bucket 5 " in str(err), err
    assert "injected OOM packing bucket 5" in str(err)
    assert verdicts[0] and verdicts[-1] is False  # the first agreement after bucket 5 carries the failure
    assert verdicts.count(False) == 1  # and the switch stops there
