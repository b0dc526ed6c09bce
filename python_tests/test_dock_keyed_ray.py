"""The keyed store across Ray worker processes: two partitions in flight at once (no row crosses
partitions, a max_staleness claim never returns an older row), and DP dispatch with 2 replicas x 2 TP
ranks in 4 processes (the ranks of a replica get the same rows, replicas never share one, token counts
per replica differ by at most one group's tokens). Loopback Ray, 100 MB object store, fractional CPUs."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dock_util import init_local_ray
from msrl_core import Column, Dock

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def ray_up():
    init_local_ray(100)
    yield
    ray.shutdown()


def _remote(fn):
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])  # workers import this module
    return ray.remote(num_cpus=0.25, runtime_env={"env_vars": {"PYTHONPATH": path}})(fn)


def produce(dock: Dock, partition: str, n: int, version: int, old: int) -> int:
    """n keys of this partition at `version`, and `old` more at version - 1 (stale for a strict claim)."""
    keys = [f"{partition}/{i}" for i in range(n + old)]
    versions = [version] * n + [version - 1] * old
    tokens = [np.full(1 + i % 3, version, np.int64) for i in range(n + old)]
    for i in range(0, n + old, 4):  # several puts, interleaved with the other partition's
        dock.put(
            {"tokens": tokens[i : i + 4]},
            partition=partition,
            keys=keys[i : i + 4],
            version=versions[i : i + 4],
        )
    return n + old


def consume(dock: Dock, partition: str, version: int, want: int) -> list:
    """Claims this partition's rows with max_staleness=0 until `want` arrived; returns (key, token values)."""
    got: list = []
    while len(got) < want:
        claim = dock.claim("train", 4, timeout=30.0, partition=partition, max_staleness=0, version=version)
        batch = dock.fetch(claim, ["tokens"])
        keys = dock.keys_of(claim, partition=partition)
        got += [(k, batch["tokens"][i].tolist()) for i, k in enumerate(keys)]
        dock.complete(claim)
    return got


def test_two_partitions_in_flight_across_workers():
    dock = Dock(
        columns={"tokens": Column("int64", ragged=True, max_len=4)},
        stages={"train": ["tokens"]},
        capacity=64,
        warehouses=2,
        backend="ray",
    )
    try:
        prod, cons = _remote(produce), _remote(consume)
        consumers = [cons.remote(dock, "step1", 1, 12), cons.remote(dock, "step2", 2, 12)]
        producers = [prod.remote(dock, "step1", 12, 1, 4), prod.remote(dock, "step2", 12, 2, 4)]
        assert ray.get(producers, timeout=300) == [16, 16]
        got1, got2 = ray.get(consumers, timeout=300)
        for part, version, got in (("step1", 1, got1), ("step2", 2, got2)):
            keys = [k for k, _ in got]
            assert len(keys) == len(set(keys)) == 12
            assert all(k.startswith(part + "/") for k in keys)  # no row crossed partitions
            assert all(int(k.split("/")[1]) < 12 for k in keys)  # never an older-version row
            assert all(set(v) == {version} for _, v in got)  # the bytes are this partition's
        # The stale rows are still there for a claim without the filter, and only in their partition.
        rest = dock.claim("train", 64, partition="step2")
        assert sorted(dock.keys_of(rest, partition="step2")) == [f"step2/{i}" for i in range(12, 16)]
    finally:
        dock.shutdown()


def dp_rank_worker(dock: Dock, dp_rank: int, tp_rank: int, rounds: int) -> list:
    """One TP rank of a DP replica: its share of every round (rows, tokens per row)."""
    out = []
    for b in range(rounds):
        claim = dock.claim(
            "update",
            8,
            timeout=60.0,
            partition="train",
            dp_rank=dp_rank,
            dp_size=2,
            batch=b,
            ranks_per_replica=2,
        )
        batch = dock.fetch(claim, ["responses"])
        out.append((claim.rows.tolist(), [len(r) for r in batch["responses"]], tp_rank))
    return out


def test_dp_dispatch_two_replicas_two_tp_ranks_four_processes():
    group, rounds = 2, 3
    dock = Dock(
        columns={"responses": Column("int64", ragged=True, max_len=16)},
        stages={"update": ["responses"]},
        capacity=64,
        group_size=group,
        warehouses=2,
        backend="ray",
        balance_by="responses",
    )
    try:
        rng = np.random.default_rng(0)
        lens = rng.integers(1, 16, size=rounds * 16 // group).repeat(group)  # one length per group
        dock.put(
            {"responses": [np.zeros(n, np.int64) for n in lens]},
            partition="train",
            keys=list(range(len(lens))),
        )
        worker = _remote(dp_rank_worker)
        refs = {(r, t): worker.remote(dock, r, t, rounds) for r in range(2) for t in range(2)}
        got = {k: ray.get(ref, timeout=300) for k, ref in refs.items()}
        seen: set[int] = set()
        for b in range(rounds):
            shares = []
            for r in range(2):
                rows0, lens0, _ = got[(r, 0)][b]
                rows1, _, _ = got[(r, 1)][b]
                assert rows0 == rows1 and rows0  # every rank of a replica gets the same rows
                shares.append((set(rows0), sum(lens0)))
            assert not shares[0][0] & shares[1][0]  # replicas never share a row
            assert not (shares[0][0] | shares[1][0]) & seen
            seen |= shares[0][0] | shares[1][0]
            assert abs(shares[0][1] - shares[1][1]) <= group * int(lens.max())  # at most one group's tokens
        assert len(seen) == len(lens)
    finally:
        dock.shutdown()


def test_a_partition_dropped_by_another_handle_is_looked_up_again_by_tags_and_list():
    """Handles cache partition ids; after another handle drops and re-creates a partition the stale id is
    refused once (NotFound "was dropped") and forgotten — also on tags/list/tag, which before used Ray
    calls that kept the stale id forever."""
    import pickle

    from msrl_core.errors import NotFound

    dock = Dock(columns={"x": Column("int64")}, stages={"s": ["x"]}, capacity=8, warehouses=1, backend="ray")
    other = pickle.loads(pickle.dumps(dock))  # a second client, with its own cache
    dock.put({"x": np.arange(1)}, partition="p", keys=["a"])
    assert other.tags(partition="p") == {"a": {}}
    dock.drop_partition("p")
    dock.put({"x": np.arange(1)}, partition="p", keys=["b"], tags={"s": 1})
    with pytest.raises(NotFound, match="was dropped"):
        other.tags(partition="p")
    assert other.tags(partition="p") == {"b": {"s": 1}}
    other.tag(["b"], {"t": 2}, partition="p")
    assert dock.tags(partition="p") == {"b": {"s": 1, "t": 2}} and other.partitions() == ["p"]
    dock.shutdown()


def test_a_shut_down_handle_refuses_every_call():
    from msrl_core.errors import Unavailable

    dock = Dock(columns={"x": Column("int64")}, stages={"s": ["x"]}, capacity=8, warehouses=1, backend="ray")
    rows = dock.put({"x": np.arange(2)}, partition="p", keys=["a", "b"])
    dock.shutdown()  # ray.kill does not wait: the actors may still answer a socket for a moment
    for call in (
        lambda: dock.keys(partition="p"),
        lambda: dock.tags(partition="p"),
        lambda: dock.rows_of(["a"], partition="p"),
        lambda: dock.fetch(rows, ["x"]),
    ):
        with pytest.raises(Unavailable):
            call()
