"""Broadcast of the switch to rollout ranks outside the training group: 2 training + 2 rollout processes over
gloo. Every rollout rank's tensors equal the layout rules (the independent torch reference of vLLM's
per-rank layout) and it receives only its own TP rank's bytes."""

from __future__ import annotations

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [  # (config, inference TP); rollout ranks 2, 3 are TP ranks (TP_i 2) or replicas (TP_i 1)
    ("qwen2_gqa_bias", 2),
    ("qwen2_gqa_bias", 1),
    ("qwen3_moe", 2),  # experts TP-sharded: w13_weight / w2_weight per rank
]


def _worker(rank: int, world: int, port: int, cases: list, out: str) -> None:
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from msrl_core.reshard import Parallel, ReshardError, megatron_to_vllm, reference
    from msrl_core.reshard.broadcast import RolloutBroadcast
    from reshard_util import CONFIGS, random_shards

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tp_group = dist.new_group([0, 1])
    res: dict = {}
    for name, ti in cases:
        cfg = CONFIGS[name]
        train = Parallel(tp=2)
        plan = megatron_to_vllm(cfg, train, Parallel(tp=ti))
        shards = random_shards(plan, seed=3)
        bc = RolloutBroadcast(plan, trainers=[0, 1], rollouts=[2, 3], bucket_bytes=8 << 10)
        key = f"{name}/tp{ti}"
        if rank < 2:
            rep = bc.send(shards[(0, rank, 0)], {"tp": tp_group})
            res[key] = {"sent_ranks": rep.infer_ranks, "buckets": rep.buckets, "bytes": rep.bytes}
        else:
            got = bc.receive_all()
            r = bc.infer_rank()
            hf = reference.megatron_to_hf(cfg, train, {(0, k, 0): shards[(0, k, 0)] for k in range(2)})
            exp = reference.hf_to_vllm(cfg, plan.infer, r, hf)
            res[key] = {
                "infer_rank": r,
                "names_equal": sorted(got) == sorted(exp),
                "mismatch": [n for n in exp if n in got and not torch.equal(got[n], exp[n])],
                "bytes": bc.report.bytes,
                "own_bytes": plan.infer_layout(r)[1],
                "tp1_bytes": megatron_to_vllm(cfg, train, Parallel(tp=1)).infer_layout(0)[1],
                "buckets": bc.report.buckets,
                "has_w13": any(n.endswith("w13_weight") for n in got),
            }
    # wrong role and a topology that is not whole replicas: clear errors, no collective entered
    bad = {}
    plan = megatron_to_vllm(CONFIGS["qwen2_gqa_bias"], Parallel(tp=2), Parallel(tp=2))
    for label, kw in {
        "odd_replicas": dict(trainers=[0, 1], rollouts=[2]),
        "overlap": dict(trainers=[0, 1], rollouts=[1, 2]),
    }.items():
        try:
            RolloutBroadcast(plan, **kw)
            bad[label] = None
        except ReshardError as e:
            bad[label] = str(e)
    bc = RolloutBroadcast(plan, trainers=[0, 1], rollouts=[2, 3])
    try:
        if rank >= 2:
            bc.send({}, {})  # a rollout rank that tries to send
        else:
            bc.infer_rank()  # a trainer rank that asks for a rollout role
        bad["wrong_role"] = None
    except ReshardError as e:
        bad["wrong_role"] = str(e)
    res["bad"] = bad
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    from megatron_harness import spawn

    return spawn(_worker, CASES, 4, 300.0, "broadcast workers")


@pytest.mark.parametrize("name,ti", CASES)
def test_every_rollout_rank_gets_its_layout(results, name, ti):
    key = f"{name}/tp{ti}"
    for rank in (2, 3):
        r = results[rank][key]
        assert r["infer_rank"] == (rank - 2) % ti
        assert r["names_equal"] and not r["mismatch"], r["mismatch"][:5]
        assert r["bytes"] == r["own_bytes"]  # only its own TP rank's slices travelled to it
        assert r["buckets"] > 1  # bucket by bucket, never the whole rank in one message
        if ti == 2:
            assert r["bytes"] < 0.6 * r["tp1_bytes"]
        assert r["has_w13"] == name.endswith("moe")
    sent = [results[k][key]["sent_ranks"] for k in (0, 1)]
    assert sent == ([[0], [1]] if ti == 2 else [[0], [0]])  # replicas: fed by both trainers in parallel


def test_bad_topologies_and_roles_raise(results):
    bad = results[0]["bad"]
    assert "do not make whole replicas of inference TP 2" in bad["odd_replicas"]
    assert "must be distinct" in bad["overlap"]
    assert "is not a rollout rank" in bad["wrong_role"]
    assert "is not a trainer rank" in results[2]["bad"]["wrong_role"]
