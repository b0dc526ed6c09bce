"""MsrlDock's field <-> dock column codec, without Ray: what comes back equals what SimpleStorage returns.

The codec's own output (the values it hands the dock) is fed back as the "fetched" value, so these tests pin
the encoding and the packing; the Ray tests (test_msrl_dock_backend.py) run the same through a dock.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

from msrl_core.dock._objects import ObjectCodec
from msrl_core.errors import InvalidArgument
from msrl_core.integrations import transfer_queue as msrl_tq

CODEC = ObjectCodec.new(allow_pickle=True)


def simple_storage_result(td: TensorDict, field: str):
    """What SimpleStorage returns for one field: its own selection, wire round trip and packing."""
    n = td.batch_size[0]
    sel = AsyncSimpleStorageManager._select_by_positions(td[field], list(range(n)))
    msg = ZMQMessage.create(
        request_type=ZMQRequestType.PUT_DATA, sender_id="a", receiver_id="b", body={"data": {field: sel}}
    )
    back = ZMQMessage.deserialize(msg.serialize()).body["data"][field]
    return AsyncSimpleStorageManager._pack_field_values(list(back))


def msrl_dock_result(td: TensorDict, field: str):
    n = td.batch_size[0]
    columns, chosen = msrl_tq.encode_fields(td.select(field), n, CODEC)
    column = chosen[field]
    kind, value = msrl_tq.decode_column(column, columns[column], CODEC)
    return column, msrl_tq.pack_field([(list(range(n)), kind, value)], n)


def assert_same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.is_nested == b.is_nested and a.dtype == b.dtype and a.layout == b.layout
        if a.is_nested:
            if a.layout == torch.jagged:  # verl pads what it reads
                assert a.to_padded_tensor(0).shape == b.to_padded_tensor(0).shape
            for x, y in zip(a.unbind(), b.unbind(), strict=True):
                assert x.shape == y.shape and x.dtype == y.dtype
                # Bit-exact (NaN payloads included).
                assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        else:
            assert a.shape == b.shape
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    else:
        assert a.tolist() == b.tolist()
        assert [type(x) for x in a.tolist()] == [type(x) for x in b.tolist()]


def complex_batch(n: int = 5) -> TensorDict:
    jag = [torch.arange(i, 2 * i + 1, dtype=torch.float32) for i in range(n)]
    jag[0][0] = float("nan")
    return TensorDict(
        {
            "dense_f32": torch.randn(n, 7),
            "dense_i64": torch.arange(n * 3).reshape(n, 3),
            "dense_bf16": torch.randn(n, 4).to(torch.bfloat16),
            "dense_f16_3d": torch.randn(n, 2, 3).to(torch.float16),
            "scalar_i64": torch.arange(n),
            "scalar_bool": torch.arange(n) % 2 == 0,
            "f64": torch.randn(n, 3, dtype=torch.float64),
            "i16_jagged": torch.nested.as_nested_tensor(
                [torch.arange(i + 1, dtype=torch.int16) for i in range(n)], layout=torch.jagged
            ),
            "jagged": torch.nested.as_nested_tensor(jag, layout=torch.jagged),
            "jagged_2d": torch.nested.as_nested_tensor(
                [torch.full((i + 1, 4), float(i)) for i in range(n)], layout=torch.jagged
            ),
            "strided": torch.nested.nested_tensor([torch.full((3, 4), float(i)) for i in range(n)]),
            "strided_mixed": torch.nested.nested_tensor([torch.zeros(2, i + 1) for i in range(n)]),
            "text": NonTensorStack(*[f"sample {i} \u00e9\u4e2d" for i in range(n)]),
            "chat": NonTensorStack(*[[{"role": "user", "content": f"q{i}"}] for i in range(n)]),
            "np_bytes": np.array([f"b{i}".encode() for i in range(n)], dtype="|S4"),
            "np_obj": np.array([f"o{i}" for i in range(n)], dtype=object),
            "empty_str": NonTensorStack(*["" for _ in range(n)]),
        },
        batch_size=n,
    )


EXPECTED_KINDS = {
    "dense_f32": "t.float32.1",
    "dense_i64": "t.int64.1",
    "dense_bf16": "t.bfloat16.1",
    "dense_f16_3d": "t.float16.2.3",
    "scalar_i64": "t.int64.0",
    "scalar_bool": "t.bool.0",
    "f64": "t.float64.1",
    "i16_jagged": "t.int16.1",
    "jagged": "t.float32.1",
    "jagged_2d": "t.float32.2.4",
    "strided": "t.float32.2.4",
    "strided_mixed": "obj",
    "text": "obj",
    "chat": "obj",
    "np_bytes": "obj",
    "np_obj": "obj",
    "empty_str": "obj",
}


@pytest.mark.parametrize("field", sorted(EXPECTED_KINDS))
def test_field_round_trip_equals_simple_storage(field: str) -> None:
    td = complex_batch()
    column, got = msrl_dock_result(td, field)
    assert column == f"{field}::{EXPECTED_KINDS[field]}"
    assert_same(got, simple_storage_result(td, field))


def test_dense_and_jagged_fields_are_stored_without_copies() -> None:
    td = complex_batch()
    columns, chosen = msrl_tq.encode_fields(td.select("dense_f32", "jagged"), 5, CODEC)
    dense = columns[chosen["dense_f32"]]
    assert dense.values.data_ptr() == td["dense_f32"].data_ptr()
    assert dense.lengths.tolist() == [7] * 5
    jagged = columns[chosen["jagged"]]
    assert jagged.values.data_ptr() == td["jagged"].values().data_ptr()
    assert jagged.lengths.tolist() == [1, 2, 3, 4, 5]


def test_unsupported_dtypes_travel_as_exact_bytes() -> None:
    values = torch.tensor([[1.0, float("nan"), -0.0]], dtype=torch.float64)
    values.view(torch.int64)[0, 1] = 0x7FF8_DEAD_BEEF_0001  # a NaN with a payload
    td = TensorDict({"x": values}, batch_size=1)
    columns, chosen = msrl_tq.encode_fields(td, 1, CODEC)
    stored = columns[chosen["x"]].values
    assert stored.dtype == torch.uint8 and tuple(stored.shape) == (3, 8)
    kind, got = msrl_tq.decode_column(chosen["x"], columns[chosen["x"]], CODEC)
    assert kind == "jagged"
    assert got.unbind()[0].view(torch.int64).tolist() == values[0].view(torch.int64).tolist()


def test_mixed_columns_of_one_field_pack_like_simple_storage() -> None:
    # Positions 0, 2 hold 1-D float rows, positions 1, 3 objects: SimpleStorage packs the mix into a
    # NonTensorStack, and so does pack_field.
    a = TensorDict({"f": torch.ones(2, 3)}, batch_size=2)
    b = TensorDict({"f": NonTensorStack("x", "y")}, batch_size=2)
    parts = []
    for positions, td in (([0, 2], a), ([1, 3], b)):
        columns, chosen = msrl_tq.encode_fields(td, 2, CODEC)
        kind, value = msrl_tq.decode_column(chosen["f"], columns[chosen["f"]], CODEC)
        parts.append((positions, kind, value))
    got = msrl_tq.pack_field(parts, 4)
    assert isinstance(got, NonTensorStack)
    items = got.tolist()
    assert items[1] == "x" and items[3] == "y"
    assert torch.equal(items[0], torch.ones(3)) and torch.equal(items[2], torch.ones(3))


def test_column_names_survive_field_names_with_separators() -> None:
    assert msrl_tq._parse_kind("a::b::t.float32.2.3x4") == ("a::b", torch.float32, 2, (3, 4))
    assert msrl_tq._parse_kind("weird.name::obj") == ("weird.name", None, 0, ())
    for bad in ("plain", "x::t.nosuchdtype.1", "x::q.float32.1"):
        with pytest.raises(InvalidArgument, match="not a column this backend wrote"):
            msrl_tq._parse_kind(bad)


def test_config_keys_are_checked() -> None:
    assert msrl_tq._user_options({}) == {"capacity": 100_000, "warehouses": 2}
    assert msrl_tq._user_options({"capacity": 64, "warehouses": 1}) == {"capacity": 64, "warehouses": 1}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_data_storage_units'\]; allowed"):
        msrl_tq._user_options({"num_data_storage_units": 2})
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"backend.MsrlDock.capacity must be a positive integer"):
            msrl_tq._user_options({"capacity": bad})


def test_other_transferqueue_versions_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(msrl_tq.importlib.metadata, "version", lambda name: "0.1.9")
    with pytest.raises(ImportError, match=r"supports transferqueue 0\.1\.11 .* found transferqueue 0\.1\.9"):
        msrl_tq._check_version()


def test_register_is_idempotent_and_names_this_backend() -> None:
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManagerFactory

    msrl_tq.register()
    msrl_tq.register()
    assert StorageManagerFactory._registry["MsrlDock"] is msrl_tq.MsrlDockStorageManager
    assert StorageBootstrapProvider.get_provider("MsrlDock") is not None


def test_round_trip_through_a_keyed_dock_with_rewrites_erase_and_checkpoint(tmp_path) -> None:
    from msrl_core.dock import Dock

    dock = Dock(columns={}, stages={}, capacity=64, backend="local", output="torch")
    td = complex_batch(5)
    keys = [3, 7, 11, 12, 40]  # TQ global indexes: sparse, any order
    columns, chosen = msrl_tq.encode_fields(td, 5, CODEC)
    dock.put(columns, keys=keys, partition=msrl_tq.PARTITION, overwrite=True)
    dock.put(columns, keys=keys, partition=msrl_tq.PARTITION, overwrite=True)  # TQ puts are upserts

    def samples(x) -> list:
        return list(x.unbind()) if isinstance(x, torch.Tensor) else x.tolist()

    def check(positions: list[int]) -> None:
        ks = [keys[p] for p in positions]
        batch = dock.get(ks, sorted(columns), partition=msrl_tq.PARTITION, output="torch")
        for field, column in chosen.items():
            kind, value = msrl_tq.decode_column(column, batch[column], CODEC)
            got = msrl_tq.pack_field([(list(range(len(ks))), kind, value)], len(ks))
            want = samples(simple_storage_result(td, field))
            if len(positions) == len(keys):
                assert_same(got, simple_storage_result(td, field))
            for g, p in zip(samples(got), positions, strict=True):
                w = want[p]
                if isinstance(w, torch.Tensor):
                    assert g.dtype == w.dtype and g.shape == w.shape
                    assert torch.equal(
                        g.flatten().contiguous().view(torch.uint8), w.flatten().contiguous().view(torch.uint8)
                    )
                else:
                    assert g == w and type(g) is type(w)

    check([0, 1, 2, 3, 4])
    msrl_tq.erase_present(dock, [3, 99, 7], msrl_tq.PARTITION)  # 99 never had data: no error
    assert sorted(dock.keys(partition=msrl_tq.PARTITION)) == [11, 12, 40]
    dock.save(msrl_tq.PARTITION, tmp_path / "ck")
    dock.clear(msrl_tq.PARTITION)
    dock.load(msrl_tq.PARTITION, tmp_path / "ck")
    check([2, 3, 4])
