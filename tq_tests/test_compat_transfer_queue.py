"""msrl_core.compat.transfer_queue: the semantics verl relies on, with no TransferQueue controller.

Runs in the compat pass of `make test-tq` (MSRL_TQ_COMPAT=1: the module is installed as `transfer_queue`).
"""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
import tq_harness as harness
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict


@pytest.fixture(scope="module")
def compat():
    import msrl_core.compat.transfer_queue as module

    assert tq is module  # installed as `transfer_queue` by the conftest
    ray.init(namespace="msrl_tq_compat")
    tq.init(OmegaConf.create(harness.backend_config("Compat")))
    yield module
    tq.close()
    ray.shutdown()


@pytest.fixture(autouse=True)
def clean(compat):
    yield
    dock = compat._STATE["dock"]
    for p in dock.partitions():
        dock.drop_partition(p)


def test_no_transferqueue_controller_or_storage_runs(compat) -> None:
    names = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "transfer_queue"
    }
    assert names == {"TransferQueueController"}  # the stand-in answering TQ's e2e fixtures
    actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    assert ray.get(actor.handle.remote())[0].backend == "ray"


def test_fields_added_rewritten_and_tags_upserted(compat) -> None:
    keys = ["u0", "u1"]
    meta = tq.kv_batch_put(
        keys=keys,
        partition_id="train",
        fields=TensorDict({"prompts": torch.arange(6).reshape(2, 3)}, [2]),
        tags=[{"status": "pending", "global_steps": 3}] * 2,
    )
    assert meta.fields == ["prompts"] and meta.tags[0] == {"status": "pending", "global_steps": 3}
    tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict({"log_probs": torch.zeros(2, 4)}, [2]))
    tq.kv_put(key="u1", partition_id="train", fields={"log_probs": torch.ones(4)})  # rewrite
    asyncio.run(tq.async_kv_put(key="u0", partition_id="train", tag={"status": "finished"}))  # tag only
    got = tq.kv_batch_get(keys=keys, partition_id="train")
    assert sorted(got.keys()) == ["log_probs", "prompts"]
    assert [t.tolist() for t in got["log_probs"].unbind()] == [[0.0] * 4, [1.0] * 4]
    assert tq.kv_list("train") == {
        "train": {
            "u0": {"status": "finished", "global_steps": 3},
            "u1": {"status": "pending", "global_steps": 3},
        }
    }


def test_dense_in_comes_back_jagged_and_objects_as_nontensorstack(compat) -> None:
    chats = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "\u4f60\u597d"}]]
    tq.kv_batch_put(
        keys=["a", "b"],
        partition_id="train",
        fields=TensorDict(
            {"ids": torch.ones(2, 5, dtype=torch.int64), "raw_prompt": NonTensorStack(*chats)}, [2]
        ),
    )
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="train")
    assert got["ids"].is_nested and got["ids"].layout == torch.jagged
    assert got["ids"].offsets().diff().tolist() == [5, 5]
    assert got["ids"].to_padded_tensor(0).shape == (2, 5)
    assert got["raw_prompt"].tolist() == chats  # the container TensorDict makes of it, as with SimpleStorage


def test_delete_by_key_frees_the_row_for_reuse(compat) -> None:
    tq.kv_batch_put(keys=["x", "y"], partition_id="train", fields=TensorDict({"v": torch.ones(2, 2)}, [2]))
    client = tq.get_client()
    rows = client.kv_retrieve_meta(["x", "y"], "train").global_indexes
    tq.kv_clear(keys="x", partition_id="train")
    tq.kv_clear(keys=["x", "never-there"], partition_id="train")  # idempotent
    assert list(tq.kv_list("train")["train"]) == ["y"]
    tq.kv_batch_put(keys=["z"], partition_id="train", fields=TensorDict({"v": torch.zeros(1, 2)}, [1]))
    assert client.kv_retrieve_meta(["z"], "train").global_indexes == [rows[0]]  # x's row, reused
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys="x", partition_id="train")


def test_batchmeta_chunks_per_dp_rank_and_every_rank_of_a_group_reads_the_same(compat) -> None:
    n = 8
    keys = [f"k{i}" for i in range(n)]
    values = torch.arange(n * 2).reshape(n, 2)
    tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict({"v": values}, [n]))
    client = tq.get_client()
    meta = asyncio.run(client.async_kv_retrieve_meta(keys=keys, partition_id="train", create=False))
    chunks = meta.chunk(2)  # DP 2

    @ray.remote(num_cpus=0.01)
    def rank_reads(chunk):
        import transfer_queue as worker_tq

        worker_tq.init()
        data = asyncio.run(worker_tq.get_client().async_get_data(chunk))
        return [t.tolist() for t in data["v"].unbind()]

    # 2 DP groups x 2 TP ranks, each a Ray worker process attaching to the same dock.
    out = ray.get([rank_reads.remote(chunks[dp]) for dp in (0, 0, 1, 1)])
    assert out[0] == out[1] == values[: n // 2].tolist()
    assert out[2] == out[3] == values[n // 2 :].tolist()
    # A worker writes its output back by metadata; the driver reads it by key.
    asyncio.run(
        client.async_put(TensorDict({"ref": torch.full((n // 2, 1), 9.0)}, [n // 2]), metadata=chunks[1])
    )
    assert [
        t.tolist() for t in tq.kv_batch_get(keys=keys[n // 2 :], partition_id="train")["ref"].unbind()
    ] == [[9.0]] * (n // 2)
    assert asyncio.run(client.async_kv_retrieve_keys(chunks[1].global_indexes, "train")) == keys[n // 2 :]


def test_checkpoint_round_trip(compat, tmp_path) -> None:
    tq.kv_batch_put(
        keys=["c0"], partition_id="train", fields=TensorDict({"v": torch.ones(1, 3)}, [1]), tags=[{"s": 1}]
    )
    tq.save_checkpoint(tmp_path / "ck", metadata={"step": 4})
    tq.kv_clear(keys="c0", partition_id="train")
    tq.kv_batch_put(keys=["c1"], partition_id="val", fields=TensorDict({"v": torch.ones(1, 3)}, [1]))
    tq.load_checkpoint(tmp_path / "ck")
    assert tq.kv_list() == {"train": {"c0": {"s": 1}}}
    assert tq.kv_batch_get(keys="c0", partition_id="train")["v"].unbind()[0].tolist() == [1.0] * 3


def test_bad_input_is_refused_with_nothing_written(compat) -> None:
    tq.kv_batch_put(keys=["a"], partition_id="train", fields=TensorDict({"v": torch.ones(1, 2)}, [1]))
    with pytest.raises(ValueError, match="does not match"):
        tq.kv_batch_put(
            keys=["b", "c"], partition_id="train", fields=TensorDict({"v": torch.ones(1, 2)}, [1])
        )
    with pytest.raises(ValueError, match="key 'a' has no field 'w'"):
        tq.kv_batch_get(keys=["a"], partition_id="train", select_fields="w")
    with pytest.raises(ValueError, match="reserved"):
        tq.kv_put(key="a", partition_id="train", tag={"\x00msrl.column:v": "x"})
    assert tq.kv_list("train") == {"train": {"a": {}}}
