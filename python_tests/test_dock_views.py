"""Zero-copy fetch views (fetch(copy=False), take(copy=False)) on both backends: values, no copy,
lifetime pinning. On Ray the views are of the warehouses' shared-memory arenas (same-node path), pinned in
the warehouse until their last array goes."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from msrl_core import Column, Dock, Ragged
from msrl_core.errors import InvalidArgument, Unsupported

BACKENDS = ["local", "ray"]


@pytest.fixture(scope="module")
def ray_once():
    """Starts one local Ray for this module's Ray cases (only when one runs)."""
    ray = pytest.importorskip("ray")
    from dock_util import init_local_ray

    init_local_ray(100)
    yield
    ray.shutdown()


@pytest.fixture(params=BACKENDS)
def views_dock(request):
    """views_dock(warehouses=2) -> a dock of the parametrized backend, shut down after the test."""
    made: list[Dock] = []
    if request.param == "ray":
        request.getfixturevalue("ray_once")

    def make(warehouses: int = 2) -> Dock:
        made.append(_views_dock(request.param, warehouses))
        return made[-1]

    yield make
    for d in made:
        d.shutdown()


def _views_dock(backend: str, warehouses: int) -> Dock:
    extra = {"backend": "ray", "actor_cpus": 0.01} if backend == "ray" else {}
    return Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_len=16),
            "rewards": Column("float32"),
            "hidden": Column("bfloat16", shape=(3,)),
        },
        stages={"score": ["prompts"], "update": ["prompts", "rewards", "hidden"]},
        capacity=8,
        group_size=2,
        warehouses=warehouses,
        **extra,
    )


def fill(dock: Dock) -> tuple[np.ndarray, list[np.ndarray]]:
    prompts = [np.arange(n, dtype=np.int64) + 10 * n for n in (2, 3, 4, 5)]
    rows = dock.put(
        {
            "prompts": prompts,
            "rewards": np.arange(4, dtype=np.float32),
            "hidden": np.arange(12, dtype=np.int16).reshape(4, 3),  # bf16 bits
        }
    )
    return rows, prompts


def test_one_group_comes_back_as_views_of_the_arena_with_the_right_values(views_dock):
    dock = views_dock()
    rows, prompts = fill(dock)
    group = rows[:2]  # one group: one warehouse, rows back to back
    a = dock.fetch(group, ["prompts", "rewards", "hidden"], copy=False)
    b = dock.fetch(group, ["prompts", "rewards", "hidden"], copy=False)
    assert a.views == {"prompts", "rewards", "hidden"}
    assert isinstance(a["prompts"], Ragged)
    np.testing.assert_array_equal(a["prompts"].values, np.concatenate(prompts[:2]))
    assert a["prompts"].offsets.tolist() == [0, 2, 5]
    np.testing.assert_array_equal(a["rewards"], [0.0, 1.0])
    np.testing.assert_array_equal(a["hidden"], np.arange(6, dtype=np.int16).reshape(2, 3))
    assert a["hidden"].shape == (2, 3)
    for name in ("rewards", "hidden"):
        assert np.shares_memory(a[name], b[name])  # both are the arena: nothing was copied
        assert not a[name].flags.writeable
    assert np.shares_memory(a["prompts"].values, b["prompts"].values)
    copied = dock.fetch(group, ["rewards"])
    assert copied.views == frozenset()
    assert not np.shares_memory(copied["rewards"], a["rewards"])
    # Pins alive: the local backend counts views (2 fetches x 3 columns), Ray fetches with views.
    assert dock._backend.live_views() == (6 if dock.backend == "local" else 2)


def test_torch_output_shares_the_arena(views_dock):
    torch = pytest.importorskip("torch")
    dock = views_dock()
    rows, prompts = fill(dock)
    a = dock.fetch(rows[:2], ["prompts", "hidden"], output="torch", copy=False)
    b = dock.fetch(rows[:2], ["hidden"], copy=False)
    assert a["hidden"].dtype == torch.bfloat16
    assert a["hidden"].data_ptr() == b["hidden"].__array_interface__["data"][0]
    assert a["prompts"].values.tolist() == np.concatenate(prompts[:2]).tolist()


def test_rows_in_two_warehouses_fall_back_to_one_packed_copy(views_dock):
    dock = views_dock(warehouses=2)
    rows, prompts = fill(dock)
    assert len(set(dock.warehouse_of(rows).tolist())) == 2
    batch = dock.fetch(rows, ["prompts", "rewards"], copy=False)
    assert batch.views == frozenset()
    np.testing.assert_array_equal(batch["prompts"].values, np.concatenate(prompts))
    np.testing.assert_array_equal(batch["rewards"], np.arange(4, dtype=np.float32))
    assert dock._backend.live_views() == 0
    dock.reset()  # a copy pins nothing


def test_reset_refuses_while_views_are_alive_and_works_after_they_are_dropped(views_dock):
    dock = views_dock()
    rows, _ = fill(dock)
    meta = dock.claim("update", max_rows=2)
    batch = dock.fetch(meta, copy=False)
    values = batch["prompts"].values
    del batch
    gc.collect()
    with pytest.raises(InvalidArgument, match=r"zero-copy fetch view"):  # `values` still pins
        dock.reset()
    with pytest.raises(InvalidArgument, match=r"zero-copy"):
        dock.reset(keep_unfinished=True)  # compaction would move viewed bytes
    assert dock.stats()["allocated_rows"] == 4  # nothing was reset
    assert dock.progress()["update"]["consumed_rows"] == 2
    np.testing.assert_array_equal(values, [20, 21, 30, 31, 32])
    del values
    gc.collect()
    assert dock._backend.live_views() == 0
    dock.reset()
    assert dock.stats()["allocated_rows"] == 0


def test_bad_input_is_refused_and_pins_nothing(views_dock):
    dock = views_dock()
    rows, _ = fill(dock)
    with pytest.raises(InvalidArgument, match="layout='packed'"):
        dock.fetch(rows[:2], ["prompts"], layout="padded", copy=False)
    with pytest.raises(InvalidArgument, match="layout='packed'"):
        dock.fetch(rows[:2], ["rewards"], output="tensordict", copy=False)
    meta = dock.claim("update", max_rows=2)
    dock.reset()
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.fetch(meta, copy=False)
    fresh = dock.put({"prompts": [np.arange(2), np.arange(3)]})  # no rewards written
    with pytest.raises(InvalidArgument, match="not ready"):
        dock.fetch(fresh, ["prompts", "rewards"], copy=False)
    assert dock._backend.live_views() == 0  # the prompts view was built, then dropped with the error
    dock.reset()
    assert len(dock.fetch(np.empty(0, np.int64), ["rewards"], copy=False)["rewards"]) == 0


def test_a_backend_without_views_refuses_them_clearly():
    dock = _views_dock("local", 2)
    dock._backend.views = False  # a backend without views; checked in Dock.fetch before any backend call
    with pytest.raises(Unsupported, match="not built for this dock"):
        dock.fetch(np.arange(2), ["rewards"], copy=False)


def test_a_batch_of_views_is_a_context_manager_that_unpins_them(views_dock):
    dock = views_dock()
    rows = dock.put({"prompts": [np.arange(3)] * 2})
    with dock.fetch(rows, ["prompts"], copy=False) as batch:
        assert batch.views == {"prompts"} and batch["prompts"].lengths.tolist() == [3, 3]
        assert dock._backend.live_views() == 1
        with pytest.raises(InvalidArgument, match="view"):
            dock.reset()
    assert dock._backend.live_views() == 0 and len(batch) == 0
    dock.reset()


def test_take_without_copy_returns_views_and_a_failed_take_claims_nothing(views_dock):
    dock = views_dock()
    rows, prompts = fill(dock)
    batch = dock.take("score", max_rows=2, copy=False)
    assert batch.views == {"prompts"} and len(batch.rows) == 2
    first = {int(r): prompts[i] for i, r in enumerate(rows)}
    np.testing.assert_array_equal(
        batch["prompts"].values, np.concatenate([first[int(r)] for r in batch.rows])
    )
    with pytest.raises(InvalidArgument, match="reset"):
        dock.reset()
    with pytest.raises(InvalidArgument, match="layout='packed'"):  # checked before claiming
        dock.take("score", max_rows=2, layout="padded", copy=False)
    dock.put({"prompts": [np.arange(2), np.arange(3)]})  # a group without rewards
    with pytest.raises(InvalidArgument, match="not ready"):  # the claim is released
        dock.take("score", max_rows=4, columns=["prompts", "rewards"], copy=False)
    assert dock.progress()["score"]["consumed_rows"] == 2
    assert dock.progress()["score"]["ready_rows"] == 4
    assert dock._backend.live_views() == 1  # only `batch` pins
    batch.drop()
    dock.reset()
    assert dock.stats()["allocated_rows"] == 0


def test_ray_views_in_another_process_pin_the_iteration_until_dropped(ray_once):
    import ray

    class ViewHolder:  # defined here: Ray ships it by value
        """A reader in another process that keeps zero-copy views of a Ray dock."""

        def __init__(self, dock: Dock):
            self.dock, self.batch = dock, None

        def take(self) -> tuple[list[str], list[int]]:
            self.batch = self.dock.take("update", max_rows=2, columns=["rewards", "hidden"], copy=False)
            return sorted(self.batch.views), self.batch["rewards"].tolist()

        def drop(self) -> int:
            self.batch = None
            return self.dock._backend.live_views()  # flushes this process's unpins before answering

    dock = _views_dock("ray", 2)
    try:
        fill(dock)
        holder = ray.remote(ViewHolder).options(num_cpus=0.01).remote(dock)
        views, rewards = ray.get(holder.take.remote(), timeout=120)
        assert views == ["hidden", "rewards"] and rewards == [0.0, 1.0]
        with pytest.raises(InvalidArgument, match="zero-copy fetch views of 1 fetch"):
            dock.reset()
        assert dock.stats()["allocated_rows"] == 4  # nothing was reset
        assert ray.get(holder.drop.remote(), timeout=120) == 0
        dock.reset()
        assert dock.stats()["allocated_rows"] == 0
        ray.kill(holder)
    finally:
        dock.shutdown()


def test_ray_without_the_same_node_path_copies(ray_once):
    dock = Dock(
        columns={"rewards": Column("float32")},
        stages={"update": ["rewards"]},
        capacity=4,
        group_size=2,
        warehouses=1,
        backend="ray",
        fast_path=False,
        actor_cpus=0.01,
    )
    try:
        rows = dock.put({"rewards": np.arange(4, dtype=np.float32)})
        batch = dock.fetch(rows, ["rewards"], copy=False)
        assert batch.views == frozenset() and batch["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]
        dock.reset()
    finally:
        dock.shutdown()
