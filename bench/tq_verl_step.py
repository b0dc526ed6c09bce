"""A verl GRPO step's TransferQueue traffic, through TQ + SimpleStorage, TQ + MsrlDock and the compat module.

verl V1 (`verl/trainer/ppo/v1/trainer_base.py`, `agent_loop_tq.py`, `utils/transferqueue_utils.py`) moves a
step through TransferQueue's key-value API. This driver replays that traffic for one step of ``--prompts``
prompts x ``--n`` responses (512 keys by default), in one process, through each system in turn (the three
alternate, ``--rounds`` times):

1. prompts: ``kv_batch_put`` of the prompt uids with ``prompts`` (1,024 int64 each), ``raw_prompt`` (a chat
   message list) and tags ``{is_prompt, status: pending, global_steps}``;
2. rollout: per prompt group a tag-only ``async_kv_put(status=running)``, then ``kv_batch_put`` of the
   group's trajectories (jagged ``responses`` 16..2,048 int64, ``response_mask``, jagged
   ``rollout_log_probs`` f32, tags with lengths) and ``status=finished``;
3. the replay buffer polls ``kv_list()``;
4. old log-probs, reference, values: per stage the worker path — ``kv_retrieve_meta``, ``BatchMeta.chunk``
   over 2 DP ranks, ``get_data`` of ``prompts`` + ``responses`` per chunk, ``put`` of a jagged f32 field back
   by metadata;
5. reward: ``kv_batch_get(prompts, responses, raw_prompt)`` then ``kv_batch_put(rm_scores)``;
6. advantages: ``kv_batch_get`` of the scores and log-probs, ``kv_batch_put(advantages)``;
7. update: ``get_data`` of every tensor field per DP chunk;
8. ``kv_clear`` of every key.

Prints one JSON line per system (median step seconds, per-phase medians) and the ratios against TQ +
SimpleStorage in the same run. The data read back is compared with what was written after timing.

    .venv-tq/bin/python bench/tq_verl_step.py [--prompts 128] [--n 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback

SYSTEMS = ("SimpleStorage", "MsrlDock", "compat")


def make_step(prompts: int, n: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    keys = [f"uid{p}_{i}" for p in range(prompts) for i in range(n)]
    lengths = torch.randint(16, 2049, (prompts * n,), generator=g).tolist()
    return {
        "keys": keys,
        "groups": [keys[p * n : (p + 1) * n] for p in range(prompts)],
        "prompts": torch.randint(0, 32000, (prompts * n, 1024), generator=g),
        "raw_prompt": [[{"role": "user", "content": f"question {k}"}] for k in keys],
        "responses": [torch.randint(0, 32000, (L,), generator=g) for L in lengths],
        "log_probs": [torch.randn(L, generator=g) for L in lengths],
        "lengths": lengths,
    }


def jagged(parts: list) -> Any:
    import torch

    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def run_step(tq: Any, step: dict[str, Any], partition: str) -> dict[str, float]:
    import torch
    from tensordict import NonTensorStack, TensorDict

    keys, groups = step["keys"], step["groups"]
    size = len(keys)
    t: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        t[name] = t.get(name, 0.0) + time.perf_counter() - t0
        return out

    timed(
        "prompts_put",
        lambda: tq.kv_batch_put(
            keys=keys,
            partition_id=partition,
            fields=TensorDict(
                {"prompts": step["prompts"], "raw_prompt": NonTensorStack(*step["raw_prompt"])}, [size]
            ),
            tags=[{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in keys],
        ),
    )

    async def rollout() -> None:
        for group in groups:
            for k in group:
                await tq.async_kv_put(key=k, partition_id=partition, tag={"status": "running"})
            idx = [keys.index(group[0]) + i for i in range(len(group))]
            await tq.async_kv_batch_put(
                keys=group,
                partition_id=partition,
                fields=TensorDict(
                    {
                        "responses": jagged([step["responses"][i] for i in idx]),
                        "response_mask": jagged([torch.ones_like(step["responses"][i]) for i in idx]),
                        "rollout_log_probs": jagged([step["log_probs"][i] for i in idx]),
                    },
                    [len(group)],
                ),
                tags=[
                    {"status": "finished", "response_len": step["lengths"][i], "global_steps": 1} for i in idx
                ],
            )

    timed("rollout", lambda: asyncio.run(rollout()))
    listed = timed("kv_list", lambda: tq.kv_list())
    assert len(listed[partition]) == size
    client = tq.get_client()

    def worker_stage(out_field: str) -> None:
        meta = asyncio.run(client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False))
        for chunk in meta.chunk(2):
            chunk = chunk.select_fields(["prompts", "responses"])
            data = asyncio.run(client.async_get_data(chunk))
            out = jagged([torch.zeros(r.shape[0]) for r in data["responses"].unbind()])
            asyncio.run(client.async_put(data=TensorDict({out_field: out}, [chunk.size]), metadata=chunk))

    for stage in ("old_log_probs", "ref_log_prob", "values"):
        timed(f"worker_{stage}", lambda stage=stage: worker_stage(stage))

    def reward() -> None:
        got = tq.kv_batch_get(
            keys=keys, partition_id=partition, select_fields=["prompts", "responses", "raw_prompt"]
        )
        scores = jagged([torch.zeros(r.shape[0]) for r in got["responses"].unbind()])
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=TensorDict({"rm_scores": scores}, [size]))

    timed("reward", reward)

    def advantages() -> None:
        got = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=["rm_scores", "old_log_probs"])
        adv = jagged([s + 1 for s in got["rm_scores"].unbind()])
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=TensorDict({"advantages": adv}, [size]))

    timed("advantages", advantages)

    def update() -> TensorDict:
        meta = asyncio.run(client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False))
        fields = ["prompts", "responses", "response_mask", "old_log_probs", "ref_log_prob", "advantages"]
        return [asyncio.run(client.async_get_data(c.select_fields(fields))) for c in meta.chunk(2)]

    batches = timed("update_reads", update)
    timed("clear", lambda: tq.kv_clear(keys=keys, partition_id=partition))
    t["step"] = sum(t.values())
    # After timing: what the update read is what was written.
    got_resp = [r for b in batches for r in b["responses"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(got_resp, step["responses"], strict=True))
    got_prompts = [r for b in batches for r in b["prompts"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(got_prompts, step["prompts"].unbind(), strict=True))
    return t


def open_system(name: str, modules: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    if name == "compat":
        tq = modules["compat"]
        tq.init(OmegaConf.create({"backend": {"MsrlDock": {"capacity": 8192, "warehouses": 2}}}))
        return tq
    tq = modules["tq"]
    backend: dict[str, Any] = {"storage_backend": name}
    backend[name] = (
        {"num_data_storage_units": 2} if name == "SimpleStorage" else {"capacity": 8192, "warehouses": 2}
    )
    tq.init(OmegaConf.create({"controller": {"polling_mode": True}, "backend": backend}))
    return tq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="steps per system (after one warm-up each)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]

    import ray
    import torch
    import transfer_queue as real_tq
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    import msrl_core.integrations.transfer_queue as msrl_tq

    for actor_cls in (TransferQueueController, SimpleStorageUnit):
        actor_cls._default_options["num_cpus"] = 0.1  # 2-core machine
    import msrl_core.compat.transfer_queue as compat

    modules = {"tq": real_tq, "compat": compat}
    ray.init(  # address="local": a Ray of its own (a bare init joins whatever cluster /tmp/ray names)
        address="local",
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        object_store_memory=512 * 2**20,
    )
    step = make_step(args.prompts, args.n, seed=0)
    payload = int(
        step["prompts"].numel() * 8
        + sum(r.numel() * 8 for r in step["responses"])
        + sum(x.numel() * 4 for x in step["log_probs"])
    )
    times: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    for r in range(args.rounds + 1):
        for s in systems:
            tq = open_system(s, modules)
            try:
                t = run_step(tq, step, partition=f"train_{r}")
            finally:
                tq.close()
            if r > 0:
                times[s].append(t)
    meta = {
        "transferqueue": msrl_tq.TQ_VERSION,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "keys": len(step["keys"]),
        "payload_mb": payload / 1e6,
    }
    med = {s: {k: statistics.median(t[k] for t in times[s]) for k in times[s][0]} for s in systems}
    for s in systems:
        print(
            json.dumps(
                {
                    "bench": "tq_verl_step",
                    "system": s,
                    "n": len(times[s]),
                    "statistic": "median",
                    **med[s],
                    **meta,
                }
            )
        )
    if "SimpleStorage" in med:
        base = med["SimpleStorage"]
        for s in systems:
            if s != "SimpleStorage":
                ratios = {k: base[k] / med[s][k] for k in base}
                print(
                    json.dumps(
                        {
                            "bench": "tq_verl_step_speedup",
                            "system": s,
                            "baseline": "TQ + SimpleStorage, same run",
                            **ratios,
                        }
                    )
                )
    ray.shutdown()


if __name__ == "__main__":
    main()
