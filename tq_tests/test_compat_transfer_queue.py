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
    assert list(got["raw_prompt"]) == chats  # the container TensorDict makes of it, as with SimpleStorage


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


def test_kv_list_is_in_insertion_order_and_a_key_put_again_goes_last(compat) -> None:
    for key in ["k2", "k0", "k1"]:  # rows are allocated k2, k0, k1; erase frees k2's, reused by k3
        tq.kv_put(key=key, partition_id="train", fields={"v": torch.tensor([1])}, tag={"name": key})
    tq.kv_put(key="k0", partition_id="train", tag={"again": True})  # an upsert keeps k0's place
    tq.kv_clear(keys="k2", partition_id="train")
    tq.kv_put(key="k3", partition_id="train", fields={"v": torch.tensor([3])})
    tq.kv_put(key="k2", partition_id="train", tag={"name": "k2, second life"})
    listed = tq.kv_list("train")["train"]
    assert list(listed) == ["k0", "k1", "k3", "k2"]
    assert listed["k0"] == {"name": "k0", "again": True} and listed["k2"] == {"name": "k2, second life"}
    client = tq.get_client()
    assert client.kv_retrieve_meta(["k1", "k3"], "train").global_indexes == [
        int(r) for r in compat._STATE["dock"].rows_of(["k1", "k3"], partition="train")
    ]


def test_one_d_fields_are_b_by_1_in_the_schema_and_scalars_per_sample(compat) -> None:
    scores = torch.tensor([0.5, 1.5, -2.0])
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="train", fields=TensorDict({"score": scores}, [3]))
    meta = tq.get_client().kv_retrieve_meta(["a", "b", "c"], "train")
    schema = meta.field_schema["score"]
    assert schema["shape"] == torch.Size([1]) and schema["dtype"] == torch.float32 and not schema["is_nested"]
    got = tq.kv_batch_get(keys=["c", "a"], partition_id="train", select_fields="score")["score"]
    assert not got.is_nested and got.tolist() == [-2.0, 0.5]  # 0-d samples stacked, as SimpleStorage


def test_a_missing_key_in_kv_batch_get_is_named_and_nothing_is_read(compat) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=TensorDict({"v": torch.ones(2, 2)}, [2]))
    with pytest.raises(ValueError, match=r"keys were not found in partition 'train': \['zz'\] \(1 of the 3"):
        tq.kv_batch_get(keys=["a", "zz", "b"], partition_id="train")
    with pytest.raises(ValueError, match="partition 'nope' does not exist"):
        tq.kv_batch_get(keys=["a"], partition_id="nope")
    assert list(tq.kv_list()) == ["train"]  # the failed read created nothing


def test_a_field_absent_for_some_keys_is_named_and_nothing_is_read(compat) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=TensorDict({"v": torch.ones(2, 2)}, [2]))
    tq.kv_put(key="b", partition_id="train", fields={"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"key 'a' has no field 'w' in partition 'train' \(1 of 2 keys"):
        tq.kv_batch_get(keys=["a", "b"], partition_id="train", select_fields=["v", "w"])
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="train")  # select_fields=None: the common ones
    assert list(got.keys()) == ["v"]


def test_a_refused_put_writes_neither_fields_nor_tags(compat) -> None:
    tq.kv_batch_put(
        keys=["a"], partition_id="train", fields=TensorDict({"v": torch.ones(1, 2)}, [1]), tags=[{"s": 1}]
    )
    before = tq.kv_list()
    with pytest.raises(ValueError, match="does not match length of tags"):
        tq.kv_batch_put(keys=["a", "new"], partition_id="train", tags=[{"s": 2}])
    with pytest.raises(ValueError, match="appears twice"):
        tq.kv_batch_put(keys=["a", "a"], partition_id="train", tags=[{"s": 2}, {"s": 3}])
    with pytest.raises(Exception, match="not JSON-able"):  # the dock refuses the tag: the data goes neither
        tq.kv_batch_put(
            keys=["a", "new"],
            partition_id="train",
            fields=TensorDict({"v": torch.zeros(2, 2), "w": torch.zeros(2, 1)}, [2]),
            tags=[{"s": 2}, {"s": torch.ones(1)}],
        )
    assert tq.kv_list() == before
    got = tq.kv_batch_get(keys=["a"], partition_id="train")
    assert list(got.keys()) == ["v"] and got["v"].unbind()[0].tolist() == [1.0, 1.0]


def test_get_meta_stub_fetches_ready_keys_once_per_task(compat) -> None:
    client = tq.get_client()
    tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=TensorDict({"x": torch.ones(2, 1)}, [2]))
    tq.kv_batch_put(keys=["c"], partition_id="train", tags=[{"only": "tag"}])  # not ready: no field x
    first = client.get_meta(data_fields=["x"], batch_size=2, partition_id="train", task_name="t")
    assert client.kv_retrieve_keys(first.global_indexes, "train") == ["a", "b"]
    assert client.get_meta(data_fields=["x"], batch_size=1, partition_id="train", task_name="t").size == 0
    other = client.get_meta(data_fields=["x"], batch_size=1, partition_id="train", task_name="u")
    assert client.kv_retrieve_keys(other.global_indexes, "train") == ["a"]  # tasks consume apart
    tq.kv_clear(keys="a", partition_id="train")  # clearing forgets the consumption of the key
    tq.kv_put(key="a", partition_id="train", fields={"x": torch.ones(1)})
    again = client.get_meta(data_fields=["x"], batch_size=1, partition_id="train", task_name="t")
    assert client.kv_retrieve_keys(again.global_indexes, "train") == ["a"]


def test_a_partition_dropped_by_another_process_is_found_again(compat) -> None:
    tq.kv_put(key="a", partition_id="train", fields={"x": torch.ones(2)})
    actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    ray.get(actor.clear_partition.remote("train"), timeout=60)  # its dock handle drops it
    tq.kv_put(key="b", partition_id="train", fields={"x": torch.zeros(2)})  # this handle's id is stale
    assert list(tq.kv_list("train")["train"]) == ["b"]


VERSION_PROBE = """
import importlib.metadata as md
real = md.version
md.version = lambda name: {fake!r}.get(name) or real(name)
try:
    import msrl_core.compat.transfer_queue
except ImportError as e:
    print("REFUSED:", e)
else:
    print("IMPORTED")
"""


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        ({"transferqueue": "0.1.10"}, "supports transferqueue 0.1.11 .*found transferqueue 0.1.10"),
        ({"verl": "0.9.1"}, r"TransferQueue calls of verl 0.10.0.dev .*found verl 0.9.1"),
    ],
    ids=["transferqueue-0.1.10", "verl-0.9.1"],
)
def test_an_unsupported_transferqueue_or_verl_is_refused_at_import(fake: dict, message: str) -> None:
    import re
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", VERSION_PROBE.format(fake=fake)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("REFUSED:") and re.search(message, out.stdout), out.stdout


def test_the_verl_shaped_example_runs() -> None:
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "tq_compat_verl_step.py"
    ray_tmp = tempfile.mkdtemp(prefix="rq", dir="/tmp")  # its own Ray (short: AF_UNIX paths <= 107 bytes)
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    try:
        out = subprocess.run(
            [sys.executable, str(example)], capture_output=True, text=True, timeout=540, env=env
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DP 2 x TP 2 chunked reads, every value checked" in out.stdout


def test_a_put_result_is_the_state_right_after_that_put(compat) -> None:
    # Results are read when first used or before this process next changes their keys: never later state.
    first = tq.kv_put(key="a", partition_id="train", fields={"x": torch.ones(1)}, tag={"v": 1})
    second = tq.kv_put(key="a", partition_id="train", fields={"y": torch.ones(1)}, tag={"v": 2})
    tq.kv_clear(keys="a", partition_id="train")
    assert first.fields == ["x"] and first.tags == [{"v": 1}]
    assert second.fields == ["x", "y"] and second.tags == [{"v": 2}]
    dropped = tq.kv_batch_put(keys=["b"], partition_id="train", tags=[{"s": 1}])
    del dropped  # a result nobody reads is never read (verl's agent loop)
    assert tq.get_client()._pending == {}
