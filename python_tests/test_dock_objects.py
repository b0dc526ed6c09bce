"""Object columns (msrl_core.dock._objects): values encoded by the writing client, stored as ragged uint8
rows, decoded only by reading clients. The codec directly, then through the Dock on main (a ragged uint8
column: the local backend, and Ray actors that must never run a crafted pickle)."""

from __future__ import annotations

import math
import os
import pickle
import struct

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.dock._objects import JSON, MAC_BYTES, MAX_DEPTH, PICKLED, SAFE, ObjectCodec
from msrl_core.errors import InvalidArgument

CHAT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Wie viel ist 2+2? 你好 🌍", "name": None},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "arguments": {"x": 1.5, "y": [1, 2]}}]},
]


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def round_trip(codec: ObjectCodec, values: list, reader: ObjectCodec | None = None) -> list:
    flat, lengths = codec.encode(values, "x")
    assert flat.dtype == np.uint8 and lengths.dtype == np.int64 and len(lengths) == len(values)
    assert int(lengths.sum()) == flat.size
    return (reader or codec).decode(flat, offsets_of(lengths), "x")


def same(a, b) -> bool:
    """Exact equality: types at every level, float bits (NaN, -0.0), dict order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k, k2) and same(a[k], b[k2]) for k, k2 in zip(a, b))
    return a == b


VALUES = [
    "",
    "ünïcødé — 你好 — 🌍🚀",
    "\ud800 lone surrogate",
    b"",
    bytes(range(256)),
    None,
    True,
    False,
    0,
    -(2**63),
    2**63 - 1,
    2**200,
    -(2**77) + 3,
    1.5,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0],  # a NaN with a payload
    CHAT,
    [],
    {},
    (),
    (1, ("a", b"b"), [None]),
    {1: "int key", (2, 3): "tuple key", None: b"none key", "s": (1.0,)},
    [[[[["deep"]]]]],
]


def test_every_safe_value_round_trips_exactly():
    codec = ObjectCodec.new()
    out = round_trip(codec, VALUES)
    assert len(out) == len(VALUES)
    for v, o in zip(VALUES, out):
        assert same(v, o), (v, o)


def test_formats_json_for_plain_json_tagged_for_the_rest():
    codec = ObjectCodec.new()
    assert codec.encode_one(CHAT)[0] == JSON
    assert codec.encode_one("")[0] == JSON
    for v in (b"x", (1,), {1: 2}, [1, (2,)], {"a": b"x"}, 2**63, [10**5000], math.nan):
        assert codec.encode_one(v)[0] == SAFE, v
    assert codec.decode_one(codec.encode_one([10**5000])) == [10**5000]  # beyond json's digit limit
    # JSON rows are plain ASCII JSON after the format byte.
    assert codec.encode_one({"a": [1, None]}) == b'\x03{"a":[1,null]}'


def test_one_mib_bytes_and_empty_values_round_trip():
    codec = ObjectCodec.new()
    big = os.urandom(1 << 20)
    values = [big, b"", "", big[:7], "x" * (1 << 20)]
    out = round_trip(codec, values)
    assert out[0] == big and type(out[0]) is bytes
    assert out[1] == b"" and out[2] == "" and out[3] == big[:7] and out[4] == "x" * (1 << 20)


def test_chat_message_lists_round_trip_per_row():
    codec = ObjectCodec.new()
    rows = [CHAT[: i % 4] for i in range(64)]
    out = round_trip(codec, rows)
    assert all(same(a, b) for a, b in zip(rows, out))


def test_other_objects_need_the_pickle_opt_in():
    codec = ObjectCodec.new()
    with pytest.raises(InvalidArgument, match=r"row 1: a list holding a builtins\.set .*allow_pickle=True"):
        codec.encode(["fine", [1, {2, 3}]], "extras")
    with pytest.raises(InvalidArgument, match="numpy.ndarray"):
        codec.encode_one(np.zeros(2))


def test_pickle_opt_in_round_trips_other_objects():
    codec = ObjectCodec.new(allow_pickle=True)
    values = [{1, 2}, np.arange(5), ("safe", 1), frozenset({"a"})]
    out = round_trip(codec, values)
    assert out[0] == {1, 2} and np.array_equal(out[1], np.arange(5)) and out[2] == ("safe", 1)
    assert out[3] == frozenset({"a"})
    assert codec.encode_one({1, 2})[0] == PICKLED and codec.encode_one(("safe", 1))[0] == SAFE


def test_codec_travels_pickled_with_its_secret_and_hides_it():
    codec = ObjectCodec.new(allow_pickle=True)
    twin = pickle.loads(pickle.dumps(codec))  # as with a dock handle sent to a worker
    assert twin.decode_one(codec.encode_one({3})) == {3}
    assert "secret" not in repr(codec) and repr(codec) == "ObjectCodec(allow_pickle=True)"


class Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling for you")


def test_unpicklable_object_is_a_clear_error_naming_the_row():
    codec = ObjectCodec.new(allow_pickle=True)
    with pytest.raises(
        InvalidArgument, match=r"column 'extras' row 2: a Unpicklable cannot be pickled.*no pick"
    ):
        codec.encode(["a", "b", Unpicklable()], "extras")
    with pytest.raises(InvalidArgument, match="cannot be pickled"):
        codec.encode([lambda: 1], "extras")
    a: list = []
    a.append(a)
    with pytest.raises(InvalidArgument, match="contains itself"):
        ObjectCodec.new().encode([a])


def test_column_arguments_are_checked():
    codec = ObjectCodec.new()
    with pytest.raises(InvalidArgument, match="one value per row"):
        codec.encode("abc", "s")  # a str is not a list of rows
    flat, lengths = codec.encode(["ab", "c"])
    with pytest.raises(InvalidArgument, match="offsets must rise"):
        codec.decode(flat, [0, 100, int(flat.size)])
    with pytest.raises(InvalidArgument, match="offsets must rise"):
        codec.decode(flat, [0, 1])
    with pytest.raises(InvalidArgument, match="at least 16 bytes"):
        ObjectCodec(b"short")


# ---- crafted rows: nothing runs, a clear error --------------------------------------------------


class RunsCode:
    """Unpickling this calls os.mkdir(marker): the marker directory tells whether anyone unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def forged_rows(marker: str) -> list[bytes]:
    """Rows an attacker without the dock's secret could write: raw pickles, a pickle row with a made-up
    MAC, and a pickle row signed by another dock."""
    payload = pickle.dumps(RunsCode(marker))
    return [
        payload,  # no format byte: raw pickle (starts with 0x80)
        bytes((PICKLED,)) + b"\0" * MAC_BYTES + payload,
        ObjectCodec.new(allow_pickle=True).encode_one(RunsCode(marker)),
        bytes((PICKLED,)) + b"\0" * 5,  # shorter than a MAC
    ]


def test_crafted_pickles_are_refused_without_running(tmp_path):
    marker = str(tmp_path / "ran")
    reader = ObjectCodec.new(allow_pickle=True)
    for i, row in enumerate(forged_rows(marker)):
        with pytest.raises(InvalidArgument, match="unknown format byte|MAC|shorter"):
            reader.decode_one(row, f"row {i}")
    # A reader without the opt-in never unpickles, even a row signed with its own secret.
    signer = ObjectCodec.new(allow_pickle=True)
    strict = pickle.loads(pickle.dumps(signer))
    strict.allow_pickle = False
    with pytest.raises(InvalidArgument, match="allow_pickle=False"):
        strict.decode_one(signer.encode_one(RunsCode(marker)))
    assert not os.path.exists(marker)
    # The boundary: a row signed by a client holding this dock's secret (part of the job) is trusted.
    signer.decode_one(signer.encode_one(RunsCode(marker)))
    assert os.path.isdir(marker)


@pytest.mark.parametrize(
    "row, match",
    [
        (b"", "empty"),
        (b"\x07abc", "unknown format byte 0x07"),
        (bytes((SAFE,)) + b"s" + struct.pack("<Q", 2**62), "needs 4611686018427387904 more bytes"),
        (bytes((SAFE,)) + b"l" + struct.pack("<Q", 10**12), "items announced"),
        (bytes((SAFE,)) + b"Z", "unknown tag 0x5a"),
        (bytes((SAFE,)) + b"N" + b"N", "1 bytes after the value"),
        (bytes((SAFE,)) + b"s" + struct.pack("<Q", 1) + b"\xff", "not UTF-8"),
        (bytes((SAFE,)) + b"d" + struct.pack("<Q", 1) + b"l" + struct.pack("<Q", 0) + b"N", "not hashable"),
        (bytes((SAFE,)) + (b"l" + struct.pack("<Q", 1)) * (MAX_DEPTH + 1) + b"N", "deeper than"),
        (bytes((JSON,)) + b"{not json", "not a JSON value"),
        (bytes((JSON,)) + b"[" * 100_000, "not a JSON value"),
    ],
)
def test_corrupt_rows_are_clear_errors(row, match):
    with pytest.raises(InvalidArgument, match=match):
        ObjectCodec.new(allow_pickle=True).decode_one(row)


def test_fuzzed_rows_never_escape_invalid_argument():
    codec = ObjectCodec.new(allow_pickle=True)
    good = [codec.encode_one(v) for v in VALUES if not isinstance(v, bytes) or len(v) < 300]
    rng = np.random.default_rng(0)
    decoded = 0
    for _ in range(2000):
        row = bytearray(good[int(rng.integers(len(good)))])
        for _ in range(int(rng.integers(1, 4))):
            row[int(rng.integers(len(row)))] = int(rng.integers(256))
        if rng.random() < 0.3:
            row = row[: int(rng.integers(len(row) + 1))]
        try:
            codec.decode_one(bytes(row))
            decoded += 1
        except InvalidArgument:
            pass
    assert 0 < decoded < 2000  # some mutations still decode (e.g. a changed character), many do not


# ---- through the Dock on main: an object column is a ragged uint8 column -------------------------


def object_dock(**kw) -> Dock:
    return Dock(
        columns={"prompt": Column("uint8", ragged=True, max_len=256), "reward": Column("float32")},
        stages={"score": ["prompt"]},
        capacity=8,
        group_size=2,
        **kw,
    )


def put_objects(dock: Dock, codec: ObjectCodec, values: list) -> np.ndarray:
    flat, lengths = codec.encode(values, "prompt")  # raises before the dock is touched
    return dock.put({"prompt": (flat, offsets_of(lengths))})


def test_objects_through_the_local_dock_and_unpicklable_writes_nothing():
    dock = object_dock()
    codec = ObjectCodec.new(allow_pickle=True)
    values = [CHAT, "", b"\0" * 1000, {7}]
    rows = put_objects(dock, codec, values)
    with pytest.raises(InvalidArgument, match="cannot be pickled"):
        put_objects(dock, codec, ["ok", Unpicklable()])
    assert dock.stats()["allocated_rows"] == 4  # the failed put allocated nothing
    batch = dock.take("score", max_rows=8)
    got = codec.decode(batch["prompt"].values, batch["prompt"].offsets, "prompt")
    by_row = dict(zip(batch.rows.tolist(), got))
    for r, v in zip(rows.tolist(), values):
        assert same(by_row[r], v)


@pytest.mark.slow  # one local Ray instance: 10-25 s on the shared 2-core machine
def test_crafted_object_runs_nothing_in_any_ray_actor(tmp_path):
    """Two ways in, one Ray dock (2 warehouse actors, controller actors): rows an attacker without the
    secret could write (raw bytes in a uint8 column), and a value of an object column that runs code
    when unpickled, pickled by a writer of the job. No actor decodes either; readers refuse what is not
    signed with their dock's secret."""
    ray = pytest.importorskip("ray")
    from dock_util import init_local_ray

    started = not ray.is_initialized()
    if started:
        init_local_ray(100)
    try:
        marker = str(tmp_path / "ran")
        writer = ObjectCodec.new(allow_pickle=True)
        dock = Dock(
            columns={"prompt": Column("uint8", ragged=True, max_len=256), "obj": Column("object")},
            stages={"score": ["prompt", "obj"]},
            capacity=8,
            group_size=2,
            backend="ray",
            warehouses=2,
            object_codec=writer,
        )
        forged = forged_rows(marker)
        signed = writer.encode_one(RunsCode(marker))  # a writer of the job signs it: still only bytes
        rows_in = [*forged, signed, signed, writer.encode_one("plain"), writer.encode_one([CHAT])]
        lengths = np.array([len(r) for r in rows_in], np.int64)
        flat = np.frombuffer(b"".join(rows_in), np.uint8)
        objs = [RunsCode(marker), "plain", CHAT, RunsCode(marker), b"", None, {1, 2}, RunsCode(marker)]
        rows = dock.put({"prompt": (flat, offsets_of(lengths)), "obj": objs})
        assert not os.path.exists(marker)  # the writer pickled, nobody unpickled
        expect = dict(zip(rows.tolist(), rows_in))
        for batch in (dock.take("score", max_rows=8, columns=["prompt"]), dock.fetch(rows, ["prompt"])):
            assert sorted(batch.rows.tolist()) == sorted(expect)
            for k, r in enumerate(batch.rows.tolist()):
                assert bytes(batch["prompt"][k]) == expect[r]  # stored and returned as bytes, untouched
        assert not os.path.exists(marker)  # no warehouse, controller or client unpickled anything
        # A reader of another dock (another secret) and a reader without the opt-in refuse the rows.
        for reader, match in (
            (ObjectCodec.new(allow_pickle=True), "MAC does not verify"),
            (None, "allow_pickle"),
        ):
            dock.object_codec = reader
            with pytest.raises(InvalidArgument, match=match):
                dock.fetch(rows, ["obj"])
            for row in [*forged, signed]:
                with pytest.raises(InvalidArgument):
                    (reader or ObjectCodec.new()).decode_one(row)
        assert not os.path.exists(marker)
        dock.object_codec = writer  # this job's reader: the safe values come back exactly
        safe = rows[[1, 2, 4, 5, 6]]
        got = dict(zip(safe.tolist(), dock.fetch(safe, ["obj"])["obj"]))
        assert got == {
            int(rows[1]): "plain",
            int(rows[2]): CHAT,
            int(rows[4]): b"",
            int(rows[5]): None,
            int(rows[6]): {1, 2},
        }
        assert not os.path.exists(marker)
        dock.reset()
        dock.shutdown()
        # The keyed store on Ray: a run-time object column, by keys, in a partition.
        keyed = Dock(capacity=8, backend="ray", warehouses=2, object_codec=writer)
        keyed.put(
            {"extras": [RunsCode(marker), CHAT, "", b"\0" * 1000]}, partition="p", keys=["a", "b", "c", "d"]
        )
        keyed.object_codec = ObjectCodec.new(allow_pickle=True)
        with pytest.raises(InvalidArgument, match="MAC does not verify"):
            keyed.get(["a"], ["extras"], partition="p")
        keyed.object_codec = writer
        assert keyed.get(["d", "b", "c"], ["extras"], partition="p")["extras"] == [b"\0" * 1000, CHAT, ""]
        keyed.shutdown()
        assert not os.path.exists(marker)
    finally:
        if started:
            ray.shutdown()


# ---- through the keyed Dock (object columns declared by Column("object") or by a first put) -------


def test_object_columns_round_trip_exactly_through_the_keyed_dock():
    dock = Dock(capacity=64)
    keys = [f"k{i}" for i in range(len(VALUES))]
    big = os.urandom(1 << 20)
    dock.put({"extras": VALUES}, partition="train", keys=keys)
    dock.put({"blob": [big, b"", "", CHAT]}, partition="val", keys=[0, 1, 2, 3])
    assert dock.columns["extras"].is_object and dock.columns["blob"].is_object
    got = dock.get(keys[::-1], ["extras"], partition="train")["extras"]
    assert all(same(a, b) for a, b in zip(VALUES[::-1], got))
    blob = dock.get([3, 0, 1, 2], ["blob"], partition="val")["blob"]
    assert blob[0] == CHAT and blob[1] == big and blob[2] == b"" and blob[3] == ""
    padded = dock.get(keys, ["extras"], partition="train", layout="padded")["extras"]  # any layout
    assert all(same(a, b) for a, b in zip(VALUES, padded))


def test_decode_takes_padded_rows():
    from msrl_core.dock import _objects

    flat, lengths = _objects.encode(["ab", CHAT, "", b"\x01"])
    width = int(lengths.max())
    padded = np.zeros((4, width), np.uint8)
    padded[np.arange(width)[None, :] < lengths[:, None]] = flat
    assert same(_objects.decode(padded, lengths), ["ab", CHAT, "", b"\x01"])
    with pytest.raises(InvalidArgument, match="padded values"):
        _objects.decode(padded[:, :2], lengths)
    assert same(_objects.encode(np.array(["x", None], dtype=object))[1].tolist(), [4, 5])  # an object array


def test_unpicklable_or_unsafe_object_changes_nothing_in_the_dock():
    dock = Dock(capacity=8, object_codec=ObjectCodec.new(allow_pickle=True))
    dock.put({"obj": ["a", "b"]}, partition="p", keys=["x", "y"])
    before = (dock.keys(partition="p"), dock.stats()["allocated_rows"], dict(dock.columns))
    with pytest.raises(InvalidArgument, match=r"object column 'obj' row 1: a Unpicklable cannot be pickled"):
        dock.put({"obj": ["c", Unpicklable()]}, partition="p", keys=["z", "w"])
    with pytest.raises(InvalidArgument, match=r"row 0: a Unpicklable cannot be pickled"):
        dock.put({"fresh": [Unpicklable(), 1]}, partition="p", keys=["z", "w"])  # a run-time column
    assert (dock.keys(partition="p"), dock.stats()["allocated_rows"], dict(dock.columns)) == before
    assert "fresh" not in dock.columns  # the failed first put declared nothing
    safe_only = Dock(capacity=8)  # no codec: safe types only
    with pytest.raises(InvalidArgument, match=r"builtins\.set .*allow_pickle=True"):
        safe_only.put({"obj": [{1}, "a"]}, partition="p", keys=[1, 2])
    assert safe_only.partitions() == []  # not even the partition was created
    assert safe_only.stats()["allocated_rows"] == 0


def _safe_values():
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(),
        st.binary(max_size=64),
    )
    keys = st.one_of(st.text(max_size=8), st.integers(), st.none(), st.booleans(), st.binary(max_size=4))
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=5),
            st.lists(inner, max_size=5).map(tuple),
            st.dictionaries(keys, inner, max_size=5),
        ),
        max_leaves=30,
    )


def test_any_safe_value_round_trips_exactly_property():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    codec = ObjectCodec.new()

    @settings(max_examples=120, deadline=None)
    @given(st.lists(_safe_values(), max_size=6))
    def check(values):
        out = round_trip(codec, values)
        assert len(out) == len(values) and all(same(a, b) for a, b in zip(values, out))

    check()
