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


# ---------------------------------------------------------------------------------------------------------
# 2 processes over gloo without Megatron (fast start-up): run named cases in one spawn, as a new user would.

GLOO_TIMEOUT_S = 40.0  # a case that leaves a rank blocked fails fast (gloo raises) instead of hanging CI


def spawn_cases(cases: list[str], world: int = 2, timeout: float = 300.0) -> list[dict]:
    """Run the case functions named ``cases`` (``case_<name>`` below) in ``world`` spawned processes over
    gloo, in order, in one spawn; returns per rank ``{name: result dict}`` (an exception is recorded)."""
    from megatron_harness import spawn

    return spawn(_case_main, cases, world, timeout, "reshard case workers")


def _case_main(rank: int, world: int, port: int, cases: list[str], out: str) -> None:
    import datetime
    import json
    import os
    import sys
    import traceback

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    )
    import reshard_util

    results: dict = {}
    for name in cases:
        dist.barrier()
        try:
            results[name] = getattr(reshard_util, "case_" + name)(rank, world)
        except Exception as e:  # recorded, the test asserts on it
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        with open(
            os.path.join(out, f"rank{rank}.json"), "w"
        ) as f:  # after every case: a crash keeps the rest
            json.dump(results, f)
    dist.destroy_process_group()


def _tp2_setup(cfg_name: str = "qwen2_gqa_bias", infer_tp: int = 0):
    import torch.distributed as dist

    from msrl_core.reshard import Parallel, megatron_to_vllm, to_hf

    cfg = CONFIGS[cfg_name]
    train = Parallel(tp=2)
    plan = megatron_to_vllm(cfg, train, Parallel(tp=infer_tp)) if infer_tp else to_hf(cfg, train)
    shards = random_shards(plan)
    # clones: the shards stay the reference the tests compare with (not views of the swapped storages)
    mine = shards[(0, dist.get_rank(), 0)]
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in mine.items()}
    return plan, params, shards, {"tp": dist.group.WORLD}


def _intact(params: dict, shards: dict) -> bool:
    import torch.distributed as dist

    want = shards[(0, dist.get_rank(), 0)]
    return all(
        p.untyped_storage().nbytes() == p.nbytes and torch.equal(p.detach(), want[k])
        for k, p in params.items()
    )


def _attempt(fn) -> dict:
    import time

    t0 = time.monotonic()
    try:
        fn()
        out: dict = {"raised": None}
    except Exception as e:
        out = {"raised": type(e).__name__, "msg": str(e), "msrl": _is_msrl(e)}
    out["elapsed_s"] = time.monotonic() - t0
    return out


def _is_msrl(e: Exception) -> bool:
    import msrl_core

    return isinstance(e, msrl_core.errors.MsrlError)


class FailingEngine:
    """A real copy engine whose fused copy (``execute``) raises ``OutOfMemory`` at call ``at`` (1-based)."""

    def __init__(self, at: int) -> None:
        import msrl_core

        self.e, self.n, self.at = msrl_core.CopyEngine(), 0, at

    def execute(self, *a, **k):
        import msrl_core

        self.n += 1
        if self.n == self.at:
            raise msrl_core.errors.OutOfMemory(f"injected OOM in the fused copy of call {self.n}")
        return self.e.execute(*a, **k)

    def __getattr__(self, name):
        return getattr(self.e, name)


def case_split_swap_out(rank: int, world: int) -> dict:
    """Rank 0 called .numpy() on one parameter for logging: its swap-out fails. Every rank must raise and
    keep (or get back) its training weights; none returns a swapped-out Swap."""
    from msrl_core import reshard
    from msrl_core.reshard import allgather_swap

    plan, params, shards, groups = _tp2_setup()
    flat, _ = plan.allocate_inference()
    if rank == 0:
        list(params.values())[3].detach().numpy()  # a storage shared with numpy cannot be resized
    res = _attempt(lambda: allgather_swap(params, flat, plan, groups, 16 << 10))
    res["intact"] = _intact(params, shards)
    # nothing left "swapped out" (the default switcher's state; plan._active before there was one)
    active = reshard.default_switcher(plan).active if hasattr(reshard, "default_switcher") else plan._active
    res["active_none"] = active is None
    return res


def case_not_swapped_back_on_one_rank(rank: int, world: int) -> dict:
    from msrl_core.reshard import allgather_swap

    plan, params, shards, groups = _tp2_setup()
    flat, _ = plan.allocate_inference()
    s = allgather_swap(params, flat, plan, groups, 16 << 10)
    if rank == 1:
        s.swap_back().wait()
    res = _attempt(lambda: allgather_swap(params, flat, plan, groups, 16 << 10))
    if rank == 0:
        s.swap_back().wait()
    res["intact"] = _intact(params, shards)
    return res


def case_group_check_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 passes the plan of another training TP: its group check fails; rank 0 must not be blocked."""
    from msrl_core.reshard import Parallel, allgather_swap, to_hf

    plan, params, shards, groups = _tp2_setup()
    if rank == 1:
        plan = to_hf(plan.cfg, Parallel(tp=1))
    flat, _ = plan.allocate_inference()
    res = _attempt(lambda: allgather_swap(params, flat, plan, groups, 16 << 10))
    res["intact"] = _intact(params, shards)
    return res


def _different(rank: int, **kw) -> dict:
    from msrl_core.reshard import allgather_swap

    plan, params, shards, groups = _tp2_setup()
    flat, _ = plan.allocate_inference()
    args = {"bucket_bytes": 16 << 10, **{k: v[rank] for k, v in kw.items()}}
    res = _attempt(lambda: allgather_swap(params, flat, plan, groups, **args))
    res["intact"] = _intact(params, shards)
    return res


def case_different_bucket_bytes(rank: int, world: int) -> dict:
    return _different(rank, bucket_bytes=(16 << 10, 32 << 10))


def case_different_gather(rank: int, world: int) -> dict:
    return _different(rank, gather=("p2p", "all_gather"))


def case_different_verify(rank: int, world: int) -> dict:
    return _different(rank, verify=(False, True))


def case_buffer_carries_its_rank(rank: int, world: int) -> dict:
    """Both ranks fill a buffer allocated for inference rank 0 without passing infer_rank: the buffer's rank
    is used (before: global rank % TP_i, rank 1 filled rank 0's buffer with rank 1's slices). An explicit
    other infer_rank raises on every rank."""
    from msrl_core.reshard import allgather_swap, reference

    plan, params, shards, groups = _tp2_setup(infer_tp=2)
    flat, views = plan.allocate_inference(0)
    s = allgather_swap(params, flat, plan, groups, 16 << 10, swap=False)
    hf = reference.megatron_to_hf(plan.cfg, plan.train, {(0, r, 0): shards[(0, r, 0)] for r in range(2)})
    exp = reference.hf_to_vllm(plan.cfg, plan.infer, 0, hf)
    res = {
        "infer_rank": s.telemetry["infer_rank"],
        "equal_rank0": all(torch.equal(views[k], exp[k]) for k in exp),
    }
    res["mismatch"] = _attempt(lambda: allgather_swap(params, views, plan, groups, 16 << 10, infer_rank=rank))
    res["intact"] = _intact(params, shards)
    return res


def case_read_swapped_out(rank: int, world: int) -> dict:
    """Reading a swapped-out parameter is a Python error (it was a SIGSEGV on the CPU)."""
    from msrl_core.reshard import allgather_swap

    plan, params, shards, groups = _tp2_setup()
    flat, _ = plan.allocate_inference()
    s = allgather_swap(params, flat, plan, groups, 16 << 10)
    p = next(iter(params.values()))
    res = {
        "sum": _attempt(lambda: p.sum()),
        "clone": _attempt(lambda: p.clone()),
        "add": _attempt(lambda: torch.add(p, 1)),
        "shape_ok": tuple(p.shape) == tuple(shards[(0, rank, 0)][next(iter(params))].shape),
        "is_parameter": isinstance(p, torch.nn.Parameter),
    }
    s.swap_back()
    res["sum_while_swapping_in"] = _attempt(lambda: p.sum())
    s.wait()
    res["sum_after_wait"] = _attempt(lambda: p.sum())
    res["type_after_wait"] = type(p).__name__
    res["intact"] = _intact(params, shards)
    return res


def _inject(rank: int, where: str, gather: str, pipeline: bool = False) -> dict:
    """OOM on rank 1 at gather bucket k of N (k = N // 2): every rank raises within the timeout, no hang,
    weights intact everywhere, and the next switch works."""
    import msrl_core
    from msrl_core.reshard import Switcher, reference

    plan, params, shards, groups = _tp2_setup()
    sw = Switcher(plan)
    flat, views = plan.allocate_inference()
    n = len(plan.buckets(8 << 10))
    k = n // 2
    engine, fail = None, None
    if rank == 1 and where == "copy":
        engine = FailingEngine(k + 1)
    if rank == 1 and where == "pack":

        def fail(b):
            if b is not None and b.index == k:
                raise msrl_core.errors.OutOfMemory(f"injected OOM packing bucket {k}")

    res = _attempt(
        lambda: sw.switch(
            params,
            flat,
            groups,
            8 << 10,
            gather=gather,
            pipeline=pipeline,
            engine=engine,
            _fail=fail,
            timeout=60,
        )
    )
    res.update(buckets=n, k=k, intact=_intact(params, shards), active_none=sw.active is None)
    hf = reference.megatron_to_hf(plan.cfg, plan.train, {(0, r, 0): shards[(0, r, 0)] for r in range(2)})
    s = sw.switch(params, flat, groups, 8 << 10, gather=gather, pipeline=pipeline)  # the group still works
    res["next_switch_equal"] = all(torch.equal(views[k2], hf[k2]) for k2 in hf)
    s.swap_back().wait()
    res["intact_after_next"] = _intact(params, shards)
    return res


def case_oom_copy_p2p(rank: int, world: int) -> dict:
    return _inject(rank, "copy", "p2p")


def case_oom_copy_all_gather(rank: int, world: int) -> dict:
    return _inject(rank, "copy", "all_gather")


def case_oom_pack_p2p(rank: int, world: int) -> dict:
    return _inject(rank, "pack", "p2p")


def case_oom_pack_all_gather_pipelined(rank: int, world: int) -> dict:
    return _inject(rank, "pack", "all_gather", pipeline=True)


def case_oom_copy_p2p_pipelined(rank: int, world: int) -> dict:
    return _inject(rank, "copy", "p2p", pipeline=True)


def case_stream_oom(rank: int, world: int) -> dict:
    """The same for stream_buckets: an OOM in rank 1's fused copy at gather bucket k; every rank raises."""
    from msrl_core.reshard import stream_buckets

    plan, params, shards, groups = _tp2_setup()
    k = len(plan.buckets(8 << 10)) // 2
    engine = FailingEngine(k + 1) if rank == 1 else None

    def consume():
        for _ in stream_buckets(params, plan, groups, bucket_bytes=8 << 10, engine=engine, timeout=60):
            pass

    res = _attempt(consume)
    res["intact"] = _intact(params, shards)
    return res


def case_bucket_bytes_auto_takes_the_smallest_choice(rank: int, world: int) -> dict:
    """bucket_bytes="auto": each rank proposes from its own free memory; all use the smallest proposal."""
    from msrl_core.reshard import allgather_swap, steps

    plan, params, shards, groups = _tp2_setup()
    flat, _ = plan.allocate_inference()
    real = steps.auto_bucket_bytes
    steps.auto_bucket_bytes = lambda device, members: (2 << 20) if rank == 0 else (1 << 20)
    try:
        s = allgather_swap(params, flat, plan, groups, "auto")
    finally:
        steps.auto_bucket_bytes = real
    s.swap_back().wait()
    return {"bucket_bytes": s.telemetry["bucket_bytes"], "intact": _intact(params, shards)}


def case_timeout_for_the_whole_switch(rank: int, world: int) -> dict:
    """Rank 1 arrives 6 s late; rank 0's switch has timeout=2: it raises SwitchTimeout within ~2 s instead of
    waiting for gloo's own timeout. (Leaves the group unusable: run last.)"""
    import time

    from msrl_core.reshard import allgather_swap

    plan, params, shards, groups = _tp2_setup()
    flat, _ = plan.allocate_inference()
    if rank == 1:
        time.sleep(6.0)
    res = _attempt(lambda: allgather_swap(params, flat, plan, groups, 16 << 10, timeout=2.0))
    res["intact"] = _intact(params, shards)
    return res
