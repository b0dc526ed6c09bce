"""Exactly-once, no lost or duplicated rows: hypothesis over random schedules, plus a threaded stress test."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from msrl_core import Claim, Column, Dock, Ragged
from msrl_core.errors import InvalidArgument, OutOfMemory

G = 2
CAPACITY = 16
COLUMNS = ("a", "b", "c")
STAGES = {"s_a": ["a"], "s_ab": ["a", "b"], "s_abc": ["a", "b", "c"], "s_c": ["c"]}


def row_values(row: int, col: str, it: int) -> np.ndarray:
    """Deterministic content of a cell, so fetches can be checked against the model."""
    n = (row * 7 + ord(col) + it) % 5
    return np.arange(n, dtype=np.int64) + row * 1000 + ord(col) * 10 + it


def make_dock(**kw) -> Dock:
    return Dock(
        columns={c: Column("int64", ragged=True, max_len=8) for c in COLUMNS},
        stages=STAGES,
        capacity=CAPACITY,
        group_size=G,
        warehouses=3,
        **kw,
    )


class DockMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dock = self.make_dock()
        self.it = 0
        self.allocated: list[int] = []
        self.written: dict[str, set[int]] = {c: set() for c in COLUMNS}
        self.consumed: dict[str, set[int]] = {s: set() for s in STAGES}
        self.claims: dict[str, list[Claim]] = {s: [] for s in STAGES}
        self.released: list[Claim] = []  # claims given back: releasing them again must be refused
        self.placeholder: set[tuple[str, int]] = set()  # cells written by put_new with -1 values
        self.cell_it: dict[tuple[str, int], int] = {}  # iteration a cell was written in
        self.completed: dict[str, set[int]] = {s: set() for s in STAGES}  # claims completed

    def make_dock(self) -> Dock:
        return make_dock()

    def ready(self, stage: str) -> set[int]:
        rows = set(self.allocated)
        for c in STAGES[stage]:
            rows &= self.written[c]
        rows -= self.consumed[stage]
        # Only whole groups are claimable.
        return {r for r in rows if all(q in rows for q in range(r - r % G, r - r % G + G))}

    @rule(groups=st.integers(1, 3), col=st.sampled_from(COLUMNS))
    def put_new(self, groups, col):
        n = groups * G
        free = CAPACITY - len(self.allocated)
        # Values are written for the rows allocated, which we learn from the result.
        if n > free:
            with pytest.raises(OutOfMemory):
                self.dock.put({col: [np.arange(1)] * n})
            return
        probe = [row_values(0, col, self.it)] * n  # placeholder content, rewritten below per row id
        rows = self.dock.put({col: [np.full(len(p), -1) for p in probe]})
        assert len(rows) == n and len(set(rows.tolist())) == n
        assert not set(rows.tolist()) & set(self.allocated)
        for g in range(0, n, G):  # whole groups, aligned
            assert rows[g] % G == 0 and rows[g : g + G].tolist() == list(range(rows[g], rows[g] + G))
        self.allocated += rows.tolist()
        self.written[col] |= set(rows.tolist())
        self.placeholder |= {(col, int(r)) for r in rows}
        self.cell_it.update({(col, int(r)): self.it for r in rows})

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), col=st.sampled_from(COLUMNS))
    def put_rows(self, data, col):
        candidates = sorted(set(self.allocated) - self.written[col])
        if not candidates:
            row = data.draw(st.sampled_from(sorted(self.allocated)))
            with pytest.raises(InvalidArgument):
                self.dock.put({col: [row_values(row, col, self.it)]}, rows=[row])
            return
        rows = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=5, unique=True))
        self.dock.put({col: [row_values(r, col, self.it) for r in rows]}, rows=rows)
        self.written[col] |= set(rows)
        # A put with plain row ids completes the claims of the stages that hold the rows and do not read
        # the column (they wrote it).
        for s in STAGES:
            if col not in STAGES[s] and set(rows) <= self.consumed[s]:
                self.completed[s] |= set(rows)
        self.cell_it.update({(col, r): self.it for r in rows})

    @rule(stage=st.sampled_from(sorted(STAGES)), groups=st.integers(1, 4))
    def claim(self, stage, groups):
        expect_ready = self.ready(stage)
        meta = self.dock.claim(stage, max_rows=groups * G)
        got = meta.rows.tolist()
        assert len(got) == len(set(got))
        assert set(got) <= expect_ready, "claimed a row that is not ready or already consumed"
        assert len(got) == min(groups * G, len(expect_ready)), "left ready rows behind"
        for i in range(0, len(got), G):
            assert got[i] % G == 0 and got[i : i + G] == list(range(got[i], got[i] + G))
        self.consumed[stage] |= set(got)
        if got:
            self.claims[stage].append(meta)
            batch = self.dock.fetch(meta)
            for col in STAGES[stage]:
                for k, r in enumerate(got):
                    if (col, r) in self.placeholder:
                        assert (batch[col][k] == -1).all()
                    else:
                        np.testing.assert_array_equal(
                            batch[col][k], row_values(r, col, self.cell_it[(col, r)])
                        )

    @precondition(lambda self: any(self.claims.values()))
    @rule(data=st.data())
    def release(self, data):
        stage = data.draw(st.sampled_from(sorted(s for s, c in self.claims.items() if c)))
        k = data.draw(st.integers(0, len(self.claims[stage]) - 1))
        meta = self.claims[stage][k]
        rows = set(meta.rows.tolist())
        if rows & self.completed[stage]:  # a completed claim cannot be released: nothing changes
            with pytest.raises(InvalidArgument, match="completed"):
                self.dock.release(meta)
            return
        self.dock.release(self.claims[stage].pop(k))
        self.released.append(meta)
        self.consumed[stage] -= rows
        self.completed[stage] -= rows

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def release_again(self, data):
        """A claim released before no longer holds its rows (maybe claimed again by another worker)."""
        meta = data.draw(st.sampled_from(self.released))
        with pytest.raises(InvalidArgument):
            self.dock.release(meta)

    @precondition(lambda self: any(self.claims.values()))
    @rule(data=st.data())
    def complete(self, data):
        stage = data.draw(st.sampled_from(sorted(s for s, c in self.claims.items() if c)))
        meta = self.claims[stage][data.draw(st.integers(0, len(self.claims[stage]) - 1))]
        self.dock.complete(meta)
        self.completed[stage] |= set(meta.rows.tolist()) & self.consumed[stage]

    @rule()
    def reset_keep_unfinished(self):
        # Finished: every row of the group claimed and completed by every stage.
        done = {r for r in self.allocated if all(r in self.consumed[s] & self.completed[s] for s in STAGES)}
        finished = {r for r in done if all(q in done for q in range(r - r % G, r - r % G + G))}
        kept = set(self.allocated) - finished
        got = self.dock.reset(keep_unfinished=True)
        assert sorted(got.tolist()) == sorted(kept)
        self.it += 1
        self.allocated = sorted(kept)
        self.written = {c: w & kept for c, w in self.written.items()}
        for s in STAGES:
            done = self.completed[s] & self.consumed[s] & kept
            # A group's claim survives only when every row of it was completed.
            self.consumed[s] = {r for r in done if all(q in done for q in range(r - r % G, r - r % G + G))}
            self.completed[s] = set(self.consumed[s])
        self.claims = {s: [] for s in STAGES}
        self.released = []  # stale now: refused by the epoch check
        self.placeholder = {(c, r) for c, r in self.placeholder if r in kept}

    @rule()
    def reset(self):
        self.dock.reset()
        self.it += 1
        self.allocated = []
        self.written = {c: set() for c in COLUMNS}
        self.consumed = {s: set() for s in STAGES}
        self.claims = {s: [] for s in STAGES}
        self.released = []
        self.placeholder = set()
        self.completed = {s: set() for s in STAGES}

    @invariant()
    def progress_matches_model(self):
        prog = self.dock.progress()
        for s in STAGES:
            assert prog[s]["consumed_rows"] == len(self.consumed[s])
            assert prog[s]["ready_rows"] == len(self.ready(s))
        assert self.dock.stats()["allocated_rows"] == len(self.allocated)


DockMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestDockSchedules = DockMachine.TestCase


def test_threaded_stress_every_stage_sees_every_row_exactly_once():
    """Producers put prompts, each stage's workers claim concurrently and put their outputs; checks
    exactly-once per stage and the content of every row."""
    groups, g = 256, 4
    capacity = groups * g
    dock = Dock(
        columns={
            "prompt": Column("int64", ragged=True, max_len=16),
            "response": Column("int64", ragged=True, max_len=16),
            "score": Column("float32"),
            "adv": Column("float32"),
        },
        stages={
            "gen": ["prompt"],
            "score": ["prompt", "response"],
            "adv": ["score"],
            "update": ["response", "adv"],
        },
        capacity=capacity,
        group_size=g,
        warehouses=4,
    )
    seen = {s: np.zeros(capacity, dtype=np.int64) for s in dock.stages}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def record(stage, rows):
        with lock:
            np.add.at(seen[stage], rows, 1)

    def producer(k):
        for _ in range(groups // 2 // 8):
            lens = np.random.default_rng(k).integers(1, 16, size=8 * g)
            vals = np.concatenate([np.full(n, n, dtype=np.int64) for n in lens])
            dock.put({"prompt": Ragged.from_lengths(vals, lens)})

    def worker(stage, out_col, make):
        try:
            while True:
                with lock:
                    if seen[stage].sum() >= capacity:
                        return
                try:
                    meta = dock.claim(stage, max_rows=4 * g, timeout=0.05)
                except TimeoutError:
                    continue
                b = dock.fetch(meta)
                record(stage, meta.rows)
                dock.put({out_col: make(b)}, rows=meta)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def check_prompts(b):
        p = b["prompt"]
        for k in range(len(p)):
            assert (p[k] == len(p[k])).all()
        return [np.full(7, len(p[k]), dtype=np.int64) for k in range(len(p))]

    def score(b):
        return np.array([float(len(r)) for r in b["response"]], dtype=np.float32)

    def adv(b):
        return b["score"] - 7.0

    def update_worker():
        try:
            while True:
                with lock:
                    if seen["update"].sum() >= capacity:
                        return
                try:
                    b = dock.take("update", max_rows=16 * g, timeout=0.05)
                except TimeoutError:
                    continue
                assert (b["adv"] == 0).all()
                record("update", b.rows)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(2)]
    threads += [threading.Thread(target=worker, args=("gen", "response", check_prompts)) for _ in range(2)]
    threads += [threading.Thread(target=worker, args=("score", "score", score)) for _ in range(2)]
    threads += [threading.Thread(target=worker, args=("adv", "adv", adv))]
    threads += [threading.Thread(target=update_worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for s, counts in seen.items():
        assert (counts == 1).all(), f"stage {s}: rows seen {np.bincount(counts)} times"
    assert all(p["consumed_rows"] == capacity for p in dock.progress().values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    group=st.sampled_from([1, 2, 4]),
    groups=st.integers(4, 48),
    warehouses=st.integers(1, 3),
    producers=st.lists(st.integers(1, 4), min_size=1, max_size=3),  # groups per put, one entry per thread
    consumers=st.lists(st.tuples(st.sampled_from(["a", "ab"]), st.integers(1, 5)), min_size=1, max_size=4),
    release_every=st.integers(0, 3),
)
def test_concurrent_random_schedules_are_exactly_once(
    group, groups, warehouses, producers, consumers, release_every
):
    """Random concurrent schedules: producer threads put rows (column a) in random chunk sizes, a
    relay thread adds column b to every row it claims from stage "a", and consumer threads of the
    stages claim random sizes, sometimes releasing a claim back. Every stage must end with every
    row claimed exactly once (releases excluded), with the right content."""
    capacity = groups * group
    dock = Dock(
        columns={"a": Column("int64", ragged=True, max_len=4), "b": Column("int64")},
        stages={"a": ["a"], "ab": ["a", "b"], "relay": ["a"]},
        capacity=capacity,
        group_size=group,
        warehouses=min(warehouses, groups),
    )
    kept = {s: np.zeros(capacity, dtype=np.int64) for s in ("a", "ab")}
    lock = threading.Lock()
    errors: list[BaseException] = []
    budget = [groups]  # groups left to produce

    def producer(chunk):
        while True:
            with lock:
                take = min(chunk, budget[0])
                budget[0] -= take
            if take == 0:
                return
            rows = np.arange(take * group)
            dock.put({"a": [np.full(1 + int(i) % 3, 7) for i in rows]})

    def relay():
        done = 0
        while done < capacity:
            meta = dock.claim("relay", max_rows=capacity, timeout=0.05)
            if len(meta):
                b = dock.fetch(meta, ["a"])
                dock.put({"b": np.array([len(x) for x in b["a"]], dtype=np.int64)}, rows=meta)
                done += len(meta)

    def consumer(stage, groups_per_claim, k):
        n = 0
        while True:
            with lock:
                if kept[stage].sum() >= capacity:
                    return
            meta = dock.claim(stage, max_rows=groups_per_claim * group, timeout=0.02, min_rows=0)
            if not len(meta):
                continue
            n += 1
            if release_every and n % (release_every + 1) == 0:  # at most every other claim goes back
                dock.release(meta)
                continue
            b = dock.fetch(meta)
            assert all((x == 7).all() for x in b["a"])
            if stage == "ab":
                assert b["b"].tolist() == [len(x) for x in b["a"]]
            with lock:
                np.add.at(kept[stage], meta.rows, 1)

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as e:
                errors.append(e)

        return threading.Thread(target=run, daemon=True)

    threads = [guarded(producer, c) for c in producers] + [guarded(relay)]
    threads += [guarded(consumer, s, g, k) for k, (s, g) in enumerate(consumers)]
    threads += [guarded(consumer, s, 2, 99) for s in ("a", "ab") if s not in {c[0] for c in consumers}]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    for s, counts in kept.items():
        assert (counts == 1).all(), f"stage {s}: claim counts {np.bincount(counts)}"
    prog = dock.progress()
    assert prog["a"]["consumed_rows"] == prog["ab"]["consumed_rows"] == capacity
