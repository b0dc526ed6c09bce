"""MsrlDock behind TransferQueue's controller, through TQ's public API (one Ray, one tq.init per module).

TQ's controller allocates the global indexes and keeps keys, tags and status; these tests check what the
byte store must do under it: field additions, partial overwrites, an index reused after a clear (also in
another partition, with another dtype), exact checkpoints, and that tq.close() frees the dock.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
import tq_harness as harness
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict

from msrl_core.integrations import transfer_queue as msrl_tq


@pytest.fixture(scope="module")
def tq_msrl():
    ray.init(namespace="msrl_tq_backend")
    tq.init(OmegaConf.create(harness.backend_config("MsrlDock")))
    yield tq.get_client().storage_manager
    tq.close()
    ray.shutdown()


@pytest.fixture(autouse=True)
def clean(tq_msrl):
    yield
    for pid in tq.get_client().get_partition_list():
        tq.get_client().clear_partition(pid)


def stored_keys(manager) -> list:
    return sorted(manager.dock.keys(partition=msrl_tq.PARTITION))


def test_the_dock_holds_rows_by_tq_global_index(tq_msrl) -> None:
    meta = tq.kv_batch_put(
        keys=["a", "b", "c"], partition_id="p", fields=TensorDict({"x": torch.arange(6).reshape(3, 2)}, [3])
    )
    gidx = tq.get_client().kv_retrieve_meta(keys=meta.keys, partition_id="p").global_indexes
    assert stored_keys(tq_msrl) == sorted(gidx)
    batch = tq_msrl.dock.get(list(gidx), ["x::t.int64.1"], partition=msrl_tq.PARTITION, output="torch")
    assert batch["x::t.int64.1"].values.tolist() == [0, 1, 2, 3, 4, 5]


def test_field_addition_and_partial_overwrite(tq_msrl) -> None:
    keys = ["k0", "k1"]
    tq.kv_batch_put(keys=keys, partition_id="p", fields=TensorDict({"prompt": torch.ones(2, 3)}, [2]))
    tq.kv_batch_put(keys=keys, partition_id="p", fields=TensorDict({"log_probs": torch.zeros(2, 4)}, [2]))
    # verl overwrites log_probs when the reference runs inside the actor: one key only.
    tq.kv_put(key="k1", partition_id="p", fields={"log_probs": torch.full((4,), 7.0)})
    got = tq.kv_batch_get(keys=keys, partition_id="p")
    assert sorted(got.keys()) == ["log_probs", "prompt"]
    assert [t.tolist() for t in got["log_probs"].unbind()] == [[0.0] * 4, [7.0] * 4]
    assert [t.tolist() for t in got["prompt"].unbind()] == [[1.0] * 3, [1.0] * 3]


def test_cleared_index_reused_in_another_partition_with_another_dtype(tq_msrl) -> None:
    tq.kv_batch_put(keys=["x"], partition_id="p1", fields=TensorDict({"v": torch.tensor([[1.5, 2.5]])}, [1]))
    (old,) = tq.get_client().kv_retrieve_meta(keys=["x"], partition_id="p1").global_indexes
    tq.kv_clear(keys=["x"], partition_id="p1")
    assert old not in stored_keys(tq_msrl)  # the row and its bytes are gone from the dock
    # A batch larger than TQ's pool of freed indexes (FIFO) drains it, so it gets the cleared index too.
    n = 512
    ys = [f"y{i}" for i in range(n)]
    values = torch.arange(3 * n).reshape(n, 3)
    tq.kv_batch_put(keys=ys, partition_id="p2", fields=TensorDict({"v": values}, [n]))
    assert old in tq.get_client().kv_retrieve_meta(keys=ys, partition_id="p2").global_indexes
    got = tq.kv_batch_get(keys=ys, partition_id="p2")["v"].unbind()
    assert all(t.dtype == torch.int64 for t in got)
    assert torch.equal(torch.stack(list(got)), values)


def test_objects_and_tags_round_trip(tq_msrl) -> None:
    chats = [[{"role": "user", "content": "\u4f60\u597d"}], [{"role": "user", "content": ""}]]
    tq.kv_batch_put(
        keys=["u0", "u1"],
        partition_id="p",
        fields=TensorDict({"raw_prompt": NonTensorStack(*chats), "uid": NonTensorStack("u0", "")}, [2]),
        tags=[{"status": "pending"}, {"status": "running"}],
    )
    got = tq.kv_batch_get(keys=["u0", "u1"], partition_id="p")
    assert list(got["raw_prompt"]) == chats and list(got["uid"]) == ["u0", ""]
    assert tq.kv_list(partition_id="p")["p"] == {"u0": {"status": "pending"}, "u1": {"status": "running"}}


def test_checkpoint_restores_storage_exactly(tq_msrl, tmp_path) -> None:
    data = TensorDict(
        {
            "ids": torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged),
            "bf": torch.randn(2, 2).to(torch.bfloat16),
            "text": NonTensorStack("s0", "s1"),
        },
        [2],
    )
    tq.kv_batch_put(keys=["c0", "c1"], partition_id="ck", fields=data)
    tq.save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / msrl_tq._CHECKPOINT_SUBDIR).is_dir()
    # After the save: one key rewritten, one cleared, one added.
    tq.kv_put(key="c0", partition_id="ck", fields={"bf": torch.zeros(2, dtype=torch.bfloat16)})
    tq.kv_clear(keys=["c1"], partition_id="ck")
    tq.kv_batch_put(keys=["c2"], partition_id="ck2", fields=TensorDict({"z": torch.ones(1, 1)}, [1]))
    tq.load_checkpoint(tmp_path / "ck")
    got = tq.kv_batch_get(keys=["c0", "c1"], partition_id="ck")
    assert [t.tolist() for t in got["ids"].unbind()] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    assert torch.equal(torch.stack(list(got["bf"].unbind())).view(torch.int16), data["bf"].view(torch.int16))
    assert list(got["text"]) == ["s0", "s1"]
    assert "ck2" not in tq.get_client().get_partition_list()


def test_data_parser_is_refused_naming_the_backend(tq_msrl) -> None:
    before = stored_keys(tq_msrl)
    with pytest.raises(NotImplementedError, match="MsrlDock backend takes none"):
        tq.kv_batch_put(
            keys=["d"], partition_id="p", fields=TensorDict({"x": torch.ones(1, 1)}, [1]), data_parser=dict
        )
    assert stored_keys(tq_msrl) == before


def test_close_shuts_the_dock_down() -> None:
    # Its own TransferQueue (the module's is closed and reopened around it).
    tq.close()
    tq.init(OmegaConf.create(harness.backend_config("MsrlDock")))
    manager = tq.get_client().storage_manager
    dock = manager.dock
    assert manager.dock_id in msrl_tq._OWNED
    tq.close()
    try:
        assert manager.dock_id not in msrl_tq._OWNED
        # ray.kill is asynchronous (under load a call right after it may still be served): every call
        # fails once the dock's actors are gone, within a deadline.
        deadline = time.monotonic() + 60.0
        while True:
            try:
                dock.keys(partition=msrl_tq.PARTITION)
            except Exception:
                break
            assert time.monotonic() < deadline, "the dock still answers 60 s after tq.close()"
            time.sleep(0.2)
    finally:
        tq.init(OmegaConf.create(harness.backend_config("MsrlDock")))
