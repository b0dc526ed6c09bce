"""Ragged arenas that grow instead of failing mid-step, and give memory back (docs/dock.md, "The keyed
store"). Local backend only: the Ray backend's warehouse arenas are shared-memory mappings of a fixed size
that do not grow yet (their size is the stated upper bound), so these cases are not parametrized over Ray."""

from __future__ import annotations

import numpy as np
import pytest

from dock_util import keyed_dock_args
from msrl_core import Column, Dock
from msrl_core.errors import OutOfMemory


def make_dock(**kw) -> Dock:
    return Dock(**keyed_dock_args(**kw))


def test_erase_frees_rows_and_bytes_for_reuse():
    dock = make_dock(capacity=4)
    dock.put({"prompts": [np.arange(100)] * 4}, partition="p", keys=list(range(4)))
    with pytest.raises(OutOfMemory):
        dock.put({"prompts": [np.arange(1)]}, partition="p", keys=["more"])
    grown = sum(w["arena_bytes"] for w in dock.column_stats("prompts"))
    assert grown >= 400 * 8  # the 4 x max_len arena grew to hold 100-item rows
    dock.erase([0, 1, 2, 3], partition="p")
    assert dock.stats()["allocated_rows"] == 0 and dock.keys(partition="p") == []
    stats = dock.column_stats("prompts")
    assert sum(w["bytes_used"] for w in stats) == 0
    assert sum(w["arena_bytes"] for w in stats) == 4 * 4 * 8  # back to the configured arena
    rows = dock.put({"prompts": [np.arange(3)] * 4}, partition="p", keys=list("abcd"))
    assert sorted(rows.tolist()) == [0, 1, 2, 3]
    assert dock.get(["c"], ["prompts"], partition="p")["prompts"].values.tolist() == [0, 1, 2]


def test_growth_completes_a_step_four_times_max_len_and_reset_gives_memory_back():
    dock = Dock(
        columns={"responses": Column("int64", ragged=True, max_len=16)},
        stages={"s": ["responses"]},
        capacity=32,
    )
    base = sum(w["arena_bytes"] for w in dock.column_stats("responses"))
    rows = dock.put({"responses": [np.arange(64)] * 32})  # 4x max_len per row
    got = dock.fetch(rows, ["responses"])["responses"]
    assert all(r.tolist() == list(range(64)) for r in got)
    assert sum(w["arena_bytes"] for w in dock.column_stats("responses")) >= 4 * base
    dock.reset()
    assert sum(w["arena_bytes"] for w in dock.column_stats("responses")) == base
