"""Partial rollout: ``reset(keep_unfinished=True)`` keeps unfinished groups across iterations."""

from __future__ import annotations

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.errors import InvalidArgument, OutOfMemory

G = 2  # group size


def make_dock(capacity: int = 12, warehouses: int = 2) -> Dock:
    return Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_len=16),
            "responses": Column("int64", ragged=True, max_len=16),
            "ref": Column("float32", ragged=True, max_len=16),
            "rewards": Column("float32"),
        },
        stages={
            "rollout": ["prompts"],
            "reference": ["prompts", "responses"],
            "update": ["responses", "ref", "rewards"],
        },
        capacity=capacity,
        group_size=G,
        warehouses=warehouses,
    )


def prompt(i: int) -> np.ndarray:
    return np.arange(1 + i % 5, dtype=np.int64) + 100 * i


def response(row: int, it: int) -> np.ndarray:
    return np.full(1 + row % 3, 1000 * it + row, dtype=np.int64)


def rows_of(dock: Dock, stage: str) -> list[int]:
    meta = dock.claim(stage, max_rows=dock.capacity)
    return meta.rows.tolist()


def test_unfinished_groups_survive_with_data_and_claims_intact():
    dock = make_dock()
    rows = dock.put({"prompts": [prompt(i) for i in range(8)]})  # 4 groups
    src = {int(r): prompt(i) for i, r in enumerate(rows)}
    groups = [rows[k : k + G] for k in range(0, 8, G)]

    # Rollout claims all four groups; finishes groups 0 and 1; 2 is in flight; 3 is finished too.
    roll = dock.claim("rollout", max_rows=8)
    assert sorted(roll.rows.tolist()) == sorted(rows.tolist())
    done = np.concatenate([groups[0], groups[1], groups[3]])
    resp = {int(r): response(int(r), 0) for r in done}
    for g in (0, 1, 3):  # one put per group, with a claim: completes it for "rollout"
        dock.put({"responses": [resp[int(r)] for r in groups[g]]}, rows=_sub(roll, groups[g]))
    # Reference takes groups 0, 1, 3; completes 0 and 3 (puts ref), 1 is claimed but not completed.
    ref = dock.take("reference", max_rows=8)
    assert sorted(ref.rows.tolist()) == sorted(done.tolist())
    for g in (0, 3):
        dock.put(
            {"ref": [np.full(len(resp[int(r)]), 0.5, np.float32) for r in groups[g]]},
            rows=_sub(ref, groups[g]),
        )
    dock.put(
        {"rewards": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}, rows=np.concatenate([groups[0], groups[3]])
    )
    upd = dock.take("update", max_rows=8)
    assert sorted(upd.rows.tolist()) == sorted(np.concatenate([groups[0], groups[3]]).tolist())
    dock.complete(upd)  # update writes nothing: it completes its claim explicitly

    kept = dock.reset(keep_unfinished=True)
    assert sorted(kept.tolist()) == sorted(np.concatenate([groups[1], groups[2]]).tolist())
    assert dock.stats()["allocated_rows"] == 4
    # Exactly once per stage across the reset: rollout gets back only the group it never completed,
    # reference only the group it claimed without completing; update has nothing ready yet.
    assert rows_of(dock, "rollout") == groups[2].tolist()
    again = dock.claim("reference", max_rows=12)
    assert again.rows.tolist() == groups[1].tolist()
    assert dock.claim("update", max_rows=12).rows.size == 0
    # Kept bytes are intact after the ragged arenas were compacted (groups 0 and 3 were freed).
    b = dock.fetch(again, ["prompts", "responses"])
    for k, r in enumerate(again.rows.tolist()):
        np.testing.assert_array_equal(b["prompts"][k], src[r])
        np.testing.assert_array_equal(b["responses"][k], resp[r])
    p2 = dock.fetch(groups[2], ["prompts"])["prompts"]
    for k, r in enumerate(groups[2].tolist()):
        np.testing.assert_array_equal(p2[k], src[r])
    # Group 2's rollout finishes in the new iteration; it flows through the rest of the pipeline.
    dock.put({"responses": [response(r, 1) for r in groups[2].tolist()]}, rows=groups[2])
    assert rows_of(dock, "reference") == groups[2].tolist()


def _sub(meta, rows):
    """The part of a Claim/Batch covering `rows` (same stage and epoch)."""
    from msrl_core.dock._types import Claim

    return Claim(meta.stage, np.asarray(rows, np.int64), None, meta.epoch)


def test_freed_rows_are_reused_and_kept_rows_are_skipped():
    dock = make_dock(capacity=8, warehouses=2)
    rows = dock.put({"prompts": [prompt(i) for i in range(8)]})  # full
    with pytest.raises(OutOfMemory):
        dock.put({"prompts": [prompt(0)] * G})
    # Every stage claims and completes the first two groups: they are finished; the others were never
    # claimed.
    first = rows[: 2 * G]
    dock.put({"responses": [response(int(r), 0) for r in first]}, rows=first)
    dock.put(
        {"ref": [np.zeros(2, np.float32)] * len(first), "rewards": np.zeros(len(first), np.float32)},
        rows=first,
    )
    for stage in ("rollout", "reference", "update"):
        meta = dock.claim(stage, max_rows=2 * G)
        assert sorted(meta.rows.tolist()) == sorted(first.tolist())
        dock.complete(meta)
    kept = dock.reset(keep_unfinished=True)
    assert sorted(kept.tolist()) == sorted(rows[2 * G :].tolist())
    fresh = dock.put({"prompts": [prompt(50 + i) for i in range(2 * G)]})
    assert sorted(fresh.tolist()) == sorted(first.tolist())
    with pytest.raises(OutOfMemory):
        dock.put({"prompts": [prompt(0)] * G})
    # Rollout sees the kept groups (never claimed) and the new ones, each once.
    got = rows_of(dock, "rollout")
    assert sorted(got) == list(range(8))
    assert dock.claim("rollout", max_rows=8).rows.size == 0
    out = dock.fetch(np.asarray(got), ["prompts"])["prompts"]
    want = {int(r): prompt(i) for i, r in enumerate(rows)} | {
        int(r): prompt(50 + i) for i, r in enumerate(fresh)
    }
    for k, r in enumerate(got):
        np.testing.assert_array_equal(out[k], want[r])


def test_arena_space_of_freed_rows_is_reclaimed():
    # A tiny ragged arena: after a partial reset only the kept rows' bytes count.
    dock = Dock(
        columns={"p": Column("int64", ragged=True, max_bytes=8 * 10)},
        stages={"a": ["p"], "b": ["p"]},
        capacity=4,
        group_size=G,
        warehouses=1,
    )
    rows = dock.put({"p": [np.arange(4), np.arange(4)]})  # 8 of 10 items
    kept_rows = dock.put({"p": [np.array([7]), np.array([8])]})  # 10 of 10
    with pytest.raises(OutOfMemory):
        dock.put({"p": [np.arange(1)] * G}, rows=None)
    for stage in ("a", "b"):
        meta = dock.claim(stage, max_rows=G)
        assert meta.rows.tolist() == rows.tolist()
        dock.complete(meta)
    assert dock.reset(keep_unfinished=True).tolist() == kept_rows.tolist()
    assert dock.stats()["warehouse_bytes"] == [16]
    new = dock.put({"p": [np.arange(4) + 10, np.arange(4) + 20]})  # fits only because bytes moved
    b = dock.fetch(np.concatenate([kept_rows, new]), ["p"])["p"]
    assert [x.tolist() for x in b] == [[7], [8], [10, 11, 12, 13], [20, 21, 22, 23]]


def test_stale_claims_and_bad_calls_after_a_partial_reset():
    dock = make_dock()
    rows = dock.put({"prompts": [prompt(i) for i in range(2)]})
    roll = dock.claim("rollout", max_rows=G)
    dock.reset(keep_unfinished=True)
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.put({"responses": [response(int(r), 0) for r in rows]}, rows=roll)
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.complete(roll)
    with pytest.raises(InvalidArgument):
        dock.complete(rows)  # plain row ids name no stage
    # Nothing landed; the dropped claim's rows are claimable again, with their prompts.
    again = dock.claim("rollout", max_rows=G)
    assert again.rows.tolist() == rows.tolist()
    assert dock.claim("reference", max_rows=G).rows.size == 0
    # A plain reset still clears everything, kept groups included.
    assert dock.reset().size == 0
    assert dock.stats()["allocated_rows"] == 0


def test_unclaimed_groups_survive_repeated_partial_resets_and_a_batch_completes_its_claim():
    dock = make_dock()
    rows = dock.put({"prompts": [prompt(i) for i in range(4)]})
    assert dock.reset(keep_unfinished=True).tolist() == sorted(rows.tolist())
    assert dock.reset(keep_unfinished=True).tolist() == sorted(rows.tolist())
    batch = dock.take("rollout", max_rows=G)  # put(rows=batch) completes the take's claim
    dock.put({"responses": [response(int(r), 0) for r in batch.rows]}, rows=batch)
    dock.reset(keep_unfinished=True)
    # The completed group is not offered to rollout again; the other one still is.
    assert rows_of(dock, "rollout") == [int(r) for r in rows if r not in batch.rows]
    assert rows_of(dock, "reference") == batch.rows.tolist()
