"""A verl-shaped GRPO step through msrl_core.compat.transfer_queue (verl's TransferQueue calls, on the dock).

What verl V1 does with TransferQueue in one step, in the order it does it, through the compat module
installed as ``transfer_queue`` (what the ``worker_process_setup_hook`` override does in every verl process):

1. the driver puts the prompts: uids, prompt token ids, chat-message objects (``raw_prompt``), tags;
2. the agent loop marks each prompt ``running`` (tag-only upsert), puts its n trajectories — jagged
   responses and rollout log-probs, tags with lengths — and marks the prompt ``finished``;
3. the replay buffer lists the tags (``kv_list``);
4. a worker group with DP 2 x TP 2: the driver's KVBatchMeta becomes a BatchMeta, ``chunk(2)`` gives each DP
   rank its share, every TP rank of a DP group fetches the same chunk itself, TP rank 0 writes the jagged
   ``old_log_probs`` back by metadata;
5. the driver reads the step back by key (jagged out, ``to_padded_tensor``) and clears it.

Every value read is checked against what was written (the script fails otherwise).

    .venv-tq/bin/python examples/tq_compat_verl_step.py      # needs transferqueue==0.1.11 (make setup-tq)
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback

import ray
import torch
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict

import msrl_core.compat.transfer_queue as compat

PROMPTS, N, DP, TP = 4, 2, 2, 2


def jagged(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


@ray.remote(num_cpus=0.01)
def worker_rank(chunk, dp_rank: int, tp_rank: int) -> list[list[int]]:
    """One rank of the worker group (verl's tqbridge): fetch the chunk, compute, TP rank 0 writes back."""
    import transfer_queue as tq  # the compat module: the setup hook installed it in this worker process

    assert tq.__name__ == "msrl_core.compat.transfer_queue"
    tq.init()  # attaches to the dock the driver created
    client = tq.get_client()
    data = asyncio.run(client.async_get_data(chunk))
    responses = data["responses"]  # jagged, as verl reads it
    old = jagged([torch.full((int(n),), -0.5 - dp_rank) for n in responses.offsets().diff()])
    if tp_rank == 0:  # verl's collect mask: one rank per DP group writes
        asyncio.run(client.async_put(data=TensorDict({"old_log_probs": old}, [chunk.size]), metadata=chunk))
    return [r.tolist() for r in responses.unbind()]


def main() -> None:
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=200 << 20,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"worker_process_setup_hook": "msrl_core.compat.transfer_queue.install"},
    )
    compat.install()  # the driver process too (verl's driver is a Ray actor: the hook covers it)
    import transfer_queue as tq

    tq.init(OmegaConf.create({"backend": {"MsrlDock": {"capacity": 64, "warehouses": 2}}}))
    try:
        run_step(tq)
    finally:
        tq.close()
        ray.shutdown()


def run_step(tq) -> None:  # noqa: ANN001 (the module installed as transfer_queue)
    g = torch.Generator().manual_seed(0)
    uids = [f"uid{p}" for p in range(PROMPTS)]
    prompt_ids = torch.randint(0, 32000, (PROMPTS, 16), generator=g)
    chats = [[{"role": "user", "content": f"What is {p} + {p}?"}] for p in range(PROMPTS)]

    # 1. the driver submits the prompts (trainer_base._submit_batch_to_rollout)
    tq.kv_batch_put(
        keys=uids,
        partition_id="train",
        fields=TensorDict({"prompts": prompt_ids, "raw_prompt": NonTensorStack(*chats)}, [PROMPTS]),
        tags=[{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in uids],
    )

    # 2. the agent loop (agent_loop_tq._run_prompt / _agent_loop_postprocess)
    keys, responses, log_probs = [], [], []

    async def rollout() -> None:
        for p, uid in enumerate(uids):
            await tq.async_kv_put(key=uid, partition_id="train", tag={"status": "running"})
            for i in range(N):
                length = int(torch.randint(3, 9, (1,), generator=g))
                resp = torch.randint(0, 32000, (length,), generator=g)
                lp = -torch.rand(length, generator=g)
                key = f"{uid}_0_{i}"
                keys.append(key)
                responses.append(resp)
                log_probs.append(lp)
                await tq.async_kv_batch_put(
                    keys=[key],
                    partition_id="train",
                    fields=TensorDict(
                        {
                            "prompts": prompt_ids[p : p + 1],
                            "responses": jagged([resp]),
                            "response_mask": jagged([torch.ones(length, dtype=torch.int64)]),
                            "rollout_log_probs": jagged([lp]),
                            "raw_prompt": NonTensorStack(chats[p]),
                        },
                        [1],
                    ),
                    tags=[{"status": "finished", "response_len": length, "global_steps": 1}],
                )
            await tq.async_kv_put(key=uid, partition_id="train", tag={"status": "finished"})

    asyncio.run(rollout())

    # 3. the replay buffer polls the tags (replay_buffer._sync_metadata_from_transfer_queue)
    listed = tq.kv_list(partition_id="train")["train"]
    assert list(listed) == uids + keys  # insertion order, as TransferQueue lists them
    assert all(listed[u]["status"] == "finished" for u in uids)
    assert [listed[k]["response_len"] for k in keys] == [len(r) for r in responses]

    # 4. the worker group, DP 2 x TP 2 (verl.utils.transferqueue_utils: KVBatchMeta -> BatchMeta -> chunk)
    client = tq.get_client()
    meta = asyncio.run(client.async_kv_retrieve_meta(keys=keys, partition_id="train", create=False))
    chunks = meta.select_fields(["prompts", "responses"]).chunk(DP)
    seen = ray.get([worker_rank.remote(chunks[d], d, t) for d in range(DP) for t in range(TP)], timeout=120)
    for d in range(DP):
        assert seen[d * TP] == seen[d * TP + 1]  # every TP rank of a DP group read the same chunk
    assert [r for d in range(DP) for r in seen[d * TP]] == [r.tolist() for r in responses]

    # 5. the driver reads the step back by key and clears it
    got = tq.kv_batch_get(
        keys=keys, partition_id="train", select_fields=["responses", "old_log_probs", "raw_prompt"]
    )
    assert got["responses"].is_nested and got["old_log_probs"].is_nested
    assert got["responses"].offsets().diff().tolist() == [len(r) for r in responses]
    padded = got["old_log_probs"].to_padded_tensor(0.0)
    assert padded.shape == (len(keys), max(len(r) for r in responses))
    half = len(keys) // DP
    assert all(float(x[0]) == -0.5 - (i // half) for i, x in enumerate(got["old_log_probs"].unbind()))
    assert list(got["raw_prompt"]) == [chats[p] for p in range(PROMPTS) for _ in range(N)]
    lp = tq.kv_batch_get(keys=keys, partition_id="train", select_fields="rollout_log_probs")
    assert all(torch.equal(a, b) for a, b in zip(lp["rollout_log_probs"].unbind(), log_probs, strict=True))
    tq.kv_clear(keys=uids + keys, partition_id="train")
    assert tq.kv_list(partition_id="train") == {"train": {}}
    print(
        f"verl-shaped step through msrl_core.compat.transfer_queue: {PROMPTS} prompts x {N} responses, "
        f"DP {DP} x TP {TP} chunked reads, every value checked"
    )


if __name__ == "__main__":
    main()
