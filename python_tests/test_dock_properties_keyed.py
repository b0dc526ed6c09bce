"""The keyed store against a model, over random schedules (hypothesis), on both backends: two partitions,
new keys, fields added later, rewrites with and without the flag, erase and reuse of rows, drops, tags,
policy versions with max_staleness claims, clear. Exactly once per stage within every partition; no row
crosses partitions; every refused call changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from dock_util import init_local_ray
from msrl_core import Column, Dock
from msrl_core.errors import InvalidArgument, OutOfMemory

CAPACITY = 12
PARTS = ("p0", "p1")
COLUMNS = ("a", "b")
STAGES = {"s_a": ["a"], "s_ab": ["a", "b"]}
KEYS = st.one_of(st.integers(0, 9), st.sampled_from(["k0", "k1", "k2", "k3", "é"]))


def cell(key, col: str, stamp: int) -> np.ndarray:
    """The deterministic value of a cell, so reads can be checked against the model."""
    seed = (hash(str(key)) % 97 + ord(col) + stamp) % 5
    return np.arange(seed, dtype=np.int64) + stamp * 100


def make_dock(**kw) -> Dock:
    return Dock(
        columns={c: Column("int64", ragged=True, max_len=8) for c in COLUMNS},
        stages=STAGES,
        capacity=CAPACITY,
        **kw,
    )


class KeyedMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dock = self.make_dock()
        self.stamp = 0
        # partition -> key -> {"cells": {col: stamp}, "tags": {}, "version": int}
        self.model: dict[str, dict] = {p: {} for p in PARTS}
        self.consumed: dict[tuple[str, str], set] = {(p, s): set() for p in PARTS for s in STAGES}

    def make_dock(self) -> Dock:
        return make_dock()

    def live(self) -> int:
        return sum(len(m) for m in self.model.values())

    def ready(self, p: str, stage: str, min_version: int | None = None) -> set:
        return {
            k
            for k, e in self.model[p].items()
            if all(c in e["cells"] for c in STAGES[stage])
            and k not in self.consumed[(p, stage)]
            and (min_version is None or e["version"] >= min_version)
        }

    def snapshot(self) -> tuple:
        out = []
        for p in PARTS:
            keys = self.dock.keys(partition=p) if p in self.dock.partitions() else []
            out.append(
                (
                    sorted(map(str, keys)),
                    repr(sorted(self.dock.tags(partition=p).items(), key=str)) if keys else "",
                    repr(self.dock.progress(p)) if p in self.dock.partitions() else "",
                )
            )
        return tuple(out), self.dock.stats()["allocated_rows"]

    # ---- rules ----

    @rule(
        p=st.sampled_from(PARTS),
        keys=st.lists(KEYS, min_size=1, max_size=3, unique_by=str),
        cols=st.sets(st.sampled_from(COLUMNS), min_size=1),
        version=st.integers(0, 4),
    )
    def put(self, p, keys, cols, version):
        keys = list(dict.fromkeys(keys))  # 1 and "1" are different keys; str() uniqueness covers both
        self.stamp += 1
        data = {c: [cell(k, c, self.stamp) for k in keys] for c in sorted(cols)}
        have = self.model[p]
        rewrite = any(c in have[k]["cells"] for k in keys if k in have for c in cols)
        new = [k for k in keys if k not in have]
        if rewrite:
            before = self.snapshot()
            with pytest.raises(InvalidArgument, match="overwrite=True"):
                self.dock.put(data, partition=p, keys=keys, version=version)
            assert self.snapshot() == before
            return
        if self.live() + len(new) > CAPACITY:
            before = self.snapshot()
            with pytest.raises(OutOfMemory):
                self.dock.put(data, partition=p, keys=keys, version=version)
            assert self.snapshot() == before
            return
        self.dock.put(data, partition=p, keys=keys, version=version)
        for k in keys:
            e = have.setdefault(k, {"cells": {}, "tags": {}, "version": 0})
            e["version"] = version
            for c in cols:
                e["cells"][c] = self.stamp

    @rule(p=st.sampled_from(PARTS), data=st.data(), col=st.sampled_from(COLUMNS))
    def overwrite(self, p, data, col):
        if not self.model[p]:
            return
        key = data.draw(st.sampled_from(sorted(self.model[p], key=str)))
        self.stamp += 1
        self.dock.put({col: [cell(key, col, self.stamp)]}, partition=p, keys=[key], overwrite=True)
        self.model[p][key]["cells"][col] = self.stamp  # readiness and consumption unchanged

    @rule(p=st.sampled_from(PARTS), data=st.data())
    def erase(self, p, data):
        if not self.model[p]:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model[p], key=str)), min_size=1, unique=True))
        self.dock.erase(keys, partition=p)
        for k in keys:
            del self.model[p][k]
            for s in STAGES:
                self.consumed[(p, s)].discard(k)

    @rule(p=st.sampled_from(PARTS), key=KEYS, value=st.integers(-3, 3))
    def tag(self, p, key, value):
        if key not in self.model[p] and self.live() >= CAPACITY:
            return
        self.dock.tag([key], {"v": value}, partition=p)
        e = self.model[p].setdefault(key, {"cells": {}, "tags": {}, "version": 0})
        e["tags"]["v"] = value

    @rule(
        p=st.sampled_from(PARTS),
        stage=st.sampled_from(sorted(STAGES)),
        stale=st.none() | st.integers(0, 2),
        drop=st.booleans(),
    )
    def claim(self, p, stage, stale, drop):
        if p not in self.dock.partitions():
            return
        kw = {} if stale is None else {"max_staleness": stale, "version": 4}
        want = self.ready(p, stage, None if stale is None else 4 - stale)
        got = self.dock.claim(stage, CAPACITY, partition=p, **kw)
        keys = self.dock.keys_of(got, partition=p)
        assert {str(k) for k in keys} == {str(k) for k in want} and len(keys) == len(want)
        batch = self.dock.fetch(got, STAGES[stage])
        for i, k in enumerate(keys):
            for c in STAGES[stage]:
                assert batch[c][i].tolist() == cell(k, c, self.model[p][k]["cells"][c]).tolist()
        if drop and keys:  # e.g. DAPO's filter: the rows go, no stage sees them again
            self.dock.drop(got)
            for k in keys:
                del self.model[p][k]
                for s in STAGES:
                    self.consumed[(p, s)].discard(k)
            return
        self.consumed[(p, stage)] |= set(keys)

    @rule(p=st.sampled_from(PARTS))
    def clear(self, p):
        if p not in self.dock.partitions():
            return
        self.dock.clear(p)
        self.model[p] = {}
        for s in STAGES:
            self.consumed[(p, s)] = set()

    # ---- invariants ----

    @invariant()
    def matches_the_model(self):
        rows: set[int] = set()
        for p in PARTS:
            if p not in self.dock.partitions():
                assert not self.model[p]
                continue
            keys = self.dock.keys(partition=p)
            assert sorted(map(str, keys)) == sorted(map(str, self.model[p]))
            got_rows = set(self.dock.rows_of(keys, partition=p).tolist()) if keys else set()
            assert not rows & got_rows  # no row is in two partitions
            rows |= got_rows
            tags = self.dock.tags(partition=p)
            assert {str(k): v for k, v in tags.items()} == {
                str(k): e["tags"] for k, e in self.model[p].items()
            }
        assert self.dock.stats()["allocated_rows"] == self.live()


TestKeyedMachineLocal = KeyedMachine.TestCase
TestKeyedMachineLocal.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def ray_up():
    ray = pytest.importorskip("ray")
    init_local_ray(100)
    yield
    ray.shutdown()


def test_keyed_machine_over_ray(ray_up):
    dock = make_dock(backend="ray", warehouses=2)

    class RayKeyedMachine(KeyedMachine):
        def make_dock(self) -> Dock:
            dock.reset(force=True)  # one set of actors for every example: each starts empty
            return dock

    try:
        run_state_machine_as_test(
            RayKeyedMachine,
            settings=settings(
                max_examples=6,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        dock.shutdown()
