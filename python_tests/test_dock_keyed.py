"""The keyed store (docs/dock.md, "The keyed store"): partitions, keys, field updates, overwrite, erase and
reuse, run-time columns, tags, staleness, drops, DP claims, growth and checkpoints — every case on both
backends (Ray: one local instance for the module, loopback, 200 MB object store, fractional CPUs)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dock_util import init_local_ray, keyed_dock_args
from msrl_core import Column, Dock
from msrl_core.errors import InvalidArgument, NotFound, OutOfMemory

_DOCKS: list[Dock] = []
_BACKEND = {"name": "local"}


@pytest.fixture(scope="module", params=["local", "ray"], autouse=True)
def backend(request):
    if request.param == "ray":
        ray = pytest.importorskip("ray")
        init_local_ray(200)
    _BACKEND["name"] = request.param
    yield request.param
    _BACKEND["name"] = "local"
    if request.param == "ray":
        ray.shutdown()


@pytest.fixture(autouse=True)
def _shutdown_docks():
    yield
    while _DOCKS:
        _DOCKS.pop().shutdown()


def new_dock(**kw) -> Dock:
    """A dock on the module's backend (Ray: two warehouses), shut down after the test."""
    if _BACKEND["name"] == "ray":
        kw.setdefault("backend", "ray")
        kw.setdefault("warehouses", 2)
    dock = Dock(**kw)
    _DOCKS.append(dock)
    return dock


def make_dock(**kw) -> Dock:
    return new_dock(**keyed_dock_args(**kw))


def observable(dock: Dock, partition: str) -> tuple:
    """Everything a caller can see of a partition: keys, tags, written cells, stage progress, rows."""
    keys = dock.keys(partition=partition)
    cols = sorted(dock.columns)
    written = dock.written(keys, cols, partition=partition).tolist() if keys else []
    return (
        keys,
        repr(dock.tags(partition=partition)),
        written,
        repr(dock.progress(partition)),
        dock.stats()["allocated_rows"],
        tuple(dock.columns),
    )


def test_keys_partitions_and_field_updates():
    dock = make_dock()
    a = dock.put({"prompts": [np.arange(3), np.arange(2)]}, partition="step1", keys=["u0", 7])
    b = dock.put({"prompts": [np.arange(4)]}, partition="step2", keys=["u0"])  # same key, other partition
    assert set(a.tolist()).isdisjoint(b.tolist())
    assert dock.rows_of(["u0", 7], partition="step1").tolist() == a.tolist()
    assert dock.keys_of(a, partition="step1") == ["u0", 7]
    assert dock.partitions() == ["step1", "step2"]
    with pytest.raises(NotFound, match="unknown key '7' in partition 'step1'"):
        dock.rows_of(["7"], partition="step1")  # "7" is not 7
    # Fields added later, by key, in any order: the row becomes ready for the stage reading them.
    assert dock.progress("step1")["reward"]["ready_rows"] == 0
    dock.put({"responses": [np.arange(5)]}, partition="step1", keys=[7])
    assert dock.progress("step1")["reward"]["ready_rows"] == 1
    dock.put({"responses": [np.arange(1)]}, partition="step1", keys=["u0"])
    assert dock.progress("step1")["reward"]["ready_rows"] == 2
    assert dock.progress("step2")["reward"]["ready_rows"] == 0  # readiness is per partition
    c = dock.claim("reward", 8, partition="step1")
    assert sorted(c.rows.tolist()) == sorted(a.tolist()) and c.partition == "step1"
    got = dock.fetch(c, ["prompts", "responses"])
    by_key = dict(zip(dock.keys_of(c, partition="step1"), (len(x) for x in got["prompts"])))
    assert by_key == {"u0": 3, 7: 2}
    dock.put({"rewards": np.array([1.0, 2.0], np.float32)}, rows=c)  # a claim's put completes it
    assert dock.claim("reward", 8, partition="step1").rows.size == 0  # exactly once per stage
    got = dock.get([7, "u0"], ["rewards"], partition="step1")
    given = dict(zip(dock.keys_of(c, partition="step1"), [1.0, 2.0]))  # in the claim's row order
    assert got["rewards"].tolist() == [given[7], given["u0"]] and got.row_keys == [7, "u0"]


def test_overwrite_needs_the_flag_and_keeps_readiness_and_claims():
    dock = make_dock()
    dock.put({"prompts": [np.arange(2)], "rewards": np.ones(1, np.float32)}, partition="p", keys=["k"])
    before = observable(dock, "p")
    with pytest.raises(
        InvalidArgument, match="key 'k' of partition 'p' has column 'rewards' written already"
    ):
        dock.put({"rewards": np.zeros(1, np.float32)}, partition="p", keys=["k"])
    assert observable(dock, "p") == before
    assert dock.get(["k"], ["rewards"], partition="p")["rewards"].tolist() == [1.0]
    claim = dock.claim("update", 1, partition="p")
    # Rewritten with the flag (ragged and fixed): readiness unchanged, the open claim reads the new bytes.
    dock.put(
        {"rewards": np.full(1, 5, np.float32), "prompts": [np.arange(9)]},
        partition="p",
        keys=["k"],
        overwrite=True,
    )
    assert observable(dock, "p") == before[:3] + (observable(dock, "p")[3],) + before[4:]
    got = dock.fetch(claim, ["prompts", "rewards"])
    assert got["rewards"].tolist() == [5.0] and got["prompts"].values.tolist() == list(range(9))
    assert dock.claim("update", 1, partition="p").rows.size == 0  # not offered twice


def test_bad_input_is_refused_and_changes_nothing():
    dock = make_dock()
    dock.put({"prompts": [np.arange(2)], "rewards": np.ones(1, np.float32)}, partition="p", keys=["k"])
    before = observable(dock, "p")
    cases = [
        (
            lambda: dock.put({"prompts": [np.arange(1)] * 2}, partition="p", keys=["n", "n"]),
            InvalidArgument,
            "listed twice",
        ),
        (
            lambda: dock.put({"rewards": np.ones(1, np.float32)}, partition="p", keys=["k"]),
            InvalidArgument,
            "overwrite=True",
        ),
        (
            lambda: dock.put({"rewards": np.ones(2, np.int64)}, partition="p", keys=["x", "y"]),
            InvalidArgument,
            "expected dtype float32",
        ),
        (
            lambda: dock.put({"prompts": [np.ones((1, 2), np.int64)]}, partition="p", keys=["x"]),
            InvalidArgument,
            "inner shape",
        ),
        (lambda: dock.get(["k"], ["rewards"], partition="nope"), NotFound, "unknown partition 'nope'"),
        (lambda: dock.get(["zz"], ["rewards"], partition="p"), NotFound, "unknown key 'zz'"),
        (lambda: dock.get(["k"], ["responses"], partition="p"), NotFound, "unknown column 'responses'"),
        (lambda: dock.erase(["k", "zz"], partition="p"), NotFound, "zz"),
        (lambda: dock.put({"x": [object()]}, partition="p", keys=["k"]), InvalidArgument, "object"),
        (
            lambda: dock.put({"prompts": [np.arange(1)] * 9}, partition="p", keys=list(range(9))),
            OutOfMemory,
            "overflows",
        ),
        (lambda: dock.tag(["k"], {"t": object()}, partition="p"), InvalidArgument, "JSON"),
        (
            lambda: dock.put({"prompts": [np.arange(1)]}, partition="p", keys=[True]),
            InvalidArgument,
            "str or int",
        ),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
        assert observable(dock, "p") == before, match
    dock.put({"responses": [np.arange(1)]}, partition="p", keys=["k2"])
    with pytest.raises(InvalidArgument, match="key 'k' of partition 'p' has no column 'responses' written"):
        dock.get(["k", "k2"], ["responses"], partition="p")


def test_clear_makes_claims_stale_and_partitions_stay_apart():
    dock = make_dock()
    dock.put({"prompts": [np.arange(1)] * 2, "rewards": np.ones(2, np.float32)}, partition="a", keys=[1, 2])
    dock.put({"prompts": [np.arange(1)] * 2, "rewards": np.ones(2, np.float32)}, partition="b", keys=[1, 2])
    claim = dock.claim("update", 8, partition="a")
    dock.clear("a")
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.complete(claim)
    assert dock.keys(partition="a") == [] and dock.keys(partition="b") == [1, 2]
    assert len(dock.claim("update", 8, partition="b")) == 2
    dock.drop_partition("a")
    assert dock.partitions() == ["b"]


def test_fetch_with_a_claim_from_before_a_clear_is_refused_even_when_its_rows_are_reused():
    dock = make_dock()
    old = {"prompts": [np.array([1, 1]), np.array([2])], "rewards": np.array([1.0, 2.0], np.float32)}
    dock.put(old, partition="a", keys=["x", "y"])
    claim = dock.claim("update", 8, partition="a")
    assert dock.fetch(claim)["rewards"].tolist() == [1.0, 2.0]
    dock.clear("a")
    new = {"prompts": [np.array([7]), np.array([8, 8, 8])], "rewards": np.array([7.0, 8.0], np.float32)}
    rows = dock.put(new, partition="a", keys=["x2", "y2"])
    assert sorted(rows.tolist()) == sorted(claim.rows.tolist())  # the cleared rows hold new data now
    for copy in (True, False):
        with pytest.raises(InvalidArgument, match="stale claim.*partition 'a'.*cleared or reset"):
            dock.fetch(claim, copy=copy)
    assert dock.get(["x2", "y2"], ["rewards"], partition="a")["rewards"].tolist() == [7.0, 8.0]


def test_tags_upsert_with_and_without_data_and_list():
    dock = make_dock()
    dock.tag(["k1", "k2"], [{"status": "running"}, {"status": "new", "len": 3}], partition="train")
    dock.put({"prompts": [np.arange(2)]}, partition="train", keys=["k1"], tags={"status": "done", "step": 4})
    assert dock.tags(partition="train") == {
        "k1": {"status": "done", "step": 4},
        "k2": {"status": "new", "len": 3},
    }
    assert dock.list() == {"train": dock.tags(partition="train")}
    dock.erase(["k1"], partition="train")
    assert dock.list("train") == {"train": {"k2": {"status": "new", "len": 3}}}


def test_max_staleness_skips_old_rows_and_drop_removes_rows():
    dock = make_dock(group_size=2)
    dock.put(
        {"prompts": [np.arange(1)] * 4, "rewards": np.ones(4, np.float32)},
        partition="p",
        keys=list(range(4)),
        version=[1, 1, 3, 3],
    )
    got = dock.claim("update", 8, partition="p", max_staleness=1, version=4)
    assert sorted(dock.keys_of(got, partition="p")) == [2, 3]
    dock.drop([0, 1], partition="p")  # the old group: no stage sees it
    assert dock.claim("update", 8, partition="p").rows.size == 0
    assert dock.keys(partition="p") == [2, 3]


def test_dp_claims_split_balanced_shares_identical_across_ranks():
    dock = new_dock(
        columns={"responses": Column("int64", ragged=True, max_len=8)},
        stages={"update": ["responses"]},
        capacity=16,
        group_size=2,
        balance_by="responses",
    )
    lens = [9, 1, 4, 4, 2, 2, 7, 3]
    dock.put(
        {"responses": [np.arange(n) for n in lens for _ in range(2)]}, partition="p", keys=list(range(16))
    )
    shares = {}
    for rank in range(2):
        for tp in range(2):
            shares[(rank, tp)] = dock.claim(
                "update", 8, partition="p", dp_rank=rank, dp_size=2, batch=0, ranks_per_replica=2
            )
    for rank in range(2):
        assert shares[(rank, 0)].rows.tolist() == shares[(rank, 1)].rows.tolist()
    r0, r1 = set(shares[(0, 0)].rows.tolist()), set(shares[(1, 0)].rows.tolist())
    assert not r0 & r1 and len(r0 | r1) == 16
    tokens = [sum(lens[r // 2] for r in s) for s in (r0, r1)]
    assert abs(tokens[0] - tokens[1]) <= 2 * max(lens)


def test_concurrent_first_puts_of_a_run_time_column_agree_on_one_type():
    dock = new_dock(capacity=64)
    errors, done = [], []

    def put(i: int, dtype) -> None:
        try:
            dock.put({"score": np.ones(1, dtype)}, partition="p", keys=[i])
            done.append(np.dtype(dtype).name)
        except InvalidArgument as e:
            errors.append(str(e))

    threads = [threading.Thread(target=put, args=(i, np.float32 if i % 2 else np.int64)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    winner = dock.columns["score"].dtype
    assert set(done) == {winner} and len(done) + len(errors) == 16 and errors
    assert len(dock.keys(partition="p")) == len(done)


def test_objects_round_trip_and_nested_out():
    torch = pytest.importorskip("torch")
    # Ray's shared arenas do not grow: the object column is declared big enough there; locally it is
    # declared by the put and its arena grows.
    ray_cols = {"obj": Column("object", max_len=1 << 19)} if _BACKEND["name"] == "ray" else {}
    dock = new_dock(capacity=8, columns=ray_cols)
    values = ["", "héllo ✓", b"\x00" * (1 << 20), [{"role": "user", "content": "hi"}]]
    dock.put({"obj": values, "ids": [np.arange(n) for n in (1, 2, 3, 0)]}, partition="p", keys=list(range(4)))
    got = dock.get(list(range(4)), ["obj", "ids"], partition="p", layout="nested", output="torch")
    assert got["obj"] == values
    assert got["ids"].is_nested and [len(r) for r in got["ids"].unbind()] == [1, 2, 3, 0]
    assert torch.equal(got["ids"].values(), torch.tensor([0, 0, 1, 0, 1, 2]))


def test_checkpoint_round_trip_is_exact(tmp_path):
    dock = make_dock()
    dock.put(
        {"prompts": [np.arange(3), np.arange(1)], "msg": ["a", {"b": 1}]},
        partition="p",
        keys=["x", 5],
        tags=[{"s": 1}, {"s": 2}],
    )
    dock.put({"rewards": np.array([0.5], np.float32)}, partition="p", keys=[5])
    dock.save("p", tmp_path / "ck")
    other = make_dock()
    other.load("q", tmp_path / "ck")
    assert other.keys(partition="q") == ["x", 5] and other.tags(partition="q") == dock.tags(partition="p")
    cols = ["prompts", "msg", "rewards"]
    assert (
        other.written(["x", 5], cols, partition="q").tolist()
        == dock.written(["x", 5], cols, partition="p").tolist()
    )
    a = other.get([5], cols, partition="q")
    assert a["rewards"].tolist() == [0.5] and a["msg"] == [{"b": 1}] and a["prompts"].values.tolist() == [0]
    with pytest.raises(InvalidArgument, match="holds keys"):
        other.load("q", tmp_path / "ck")


# ---- growth: ragged arenas grow instead of failing mid-step, and give memory back (both backends: Ray's
# shared-memory arenas are extended and cut back by the warehouse actors) ----


def arena_file_bytes(dock: Dock, column: str) -> int | None:
    """Ray: bytes of the column's shared-memory files in the warehouse actors (what the OS holds for
    them, measured there with fstat); local: None."""
    if _BACKEND["name"] != "ray":
        return None
    import os

    import ray

    cid = dock._column_ids[column]
    calls = [
        h.__ray_call__.remote(lambda self: os.fstat(self.fds[cid]).st_size) for h in dock._backend.warehouses
    ]
    return sum(ray.get(calls, timeout=60))


def test_erase_frees_rows_and_bytes_for_reuse():
    dock = make_dock(capacity=4)
    dock.put({"prompts": [np.arange(100)] * 4}, partition="p", keys=list(range(4)))
    with pytest.raises(OutOfMemory):
        dock.put({"prompts": [np.arange(1)]}, partition="p", keys=["more"])
    grown = sum(w["arena_bytes"] for w in dock.column_stats("prompts"))
    assert grown >= 400 * 8  # the 4 x max_len arena grew to hold 100-item rows
    assert arena_file_bytes(dock, "prompts") in (None, grown)
    dock.erase([0, 1, 2, 3], partition="p")
    assert dock.stats()["allocated_rows"] == 0 and dock.keys(partition="p") == []
    stats = dock.column_stats("prompts")
    assert sum(w["bytes_used"] for w in stats) == 0
    assert sum(w["arena_bytes"] for w in stats) == 4 * 4 * 8  # back to the configured arena
    assert arena_file_bytes(dock, "prompts") in (None, 4 * 4 * 8)  # Ray: the files were cut back
    rows = dock.put({"prompts": [np.arange(3)] * 4}, partition="p", keys=list("abcd"))
    assert sorted(rows.tolist()) == [0, 1, 2, 3]
    assert dock.get(["c"], ["prompts"], partition="p")["prompts"].values.tolist() == [0, 1, 2]


def test_growth_completes_a_step_four_times_max_len_and_reset_gives_memory_back():
    dock = new_dock(
        columns={"responses": Column("int64", ragged=True, max_len=16)},
        stages={"s": ["responses"]},
        capacity=32,
    )
    base = sum(w["arena_bytes"] for w in dock.column_stats("responses"))
    first = dock.put({"responses": [np.arange(16)] * 16})
    before = dock.fetch(first, ["responses"], copy=False)  # views (Ray: of one warehouse) from before
    rows = dock.put({"responses": [np.arange(64)] * 16})  # 4x max_len per row: the arenas grow
    got = dock.fetch(rows, ["responses"])["responses"]
    assert all(r.tolist() == list(range(64)) for r in got)
    assert all(r.tolist() == list(range(16)) for r in before["responses"])  # still valid after growth
    stats = dock.column_stats("responses")
    held = 16 * 16 * 8 + 16 * 64 * 8  # both puts' bytes, the second 4x what max_len provisions
    grown = sum(w["arena_bytes"] for w in stats)
    assert sum(w["bytes_used"] for w in stats) == held and grown >= held > base
    assert arena_file_bytes(dock, "responses") in (None, grown)
    del before
    dock.reset()
    assert sum(w["arena_bytes"] for w in dock.column_stats("responses")) == base
    assert arena_file_bytes(dock, "responses") in (None, base)
