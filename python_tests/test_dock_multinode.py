"""Two Ray nodes simulated on this machine (ray.cluster_utils.Cluster: two raylets): warehouses on both
nodes, clients on each node; a client reaches its own node's warehouse through the shared arenas and the
other node's through the cross-node path (Ray actor calls and the object store), in one put or fetch.
Separate hosts have not been run."""

from __future__ import annotations

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.errors import InvalidArgument, NotFound, OutOfMemory

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20, "resources": {"node_a": 1}},
    )
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@ray.remote(num_cpus=0.05)
def worker(dock: Dock, total: int) -> tuple[str, list[int]]:
    """Claims gen until every row was consumed; puts responses with its claims."""
    b = dock._backend
    node = ray.get_runtime_context().get_node_id()
    assert [b._near(w) for w in range(2)] == [n == node for n, _ in b.wh_endpoints]  # one near, one far
    got: list[int] = []
    while dock.progress()["gen"]["consumed_rows"] < total:
        meta = dock.claim("gen", max_rows=4, timeout=0.2, min_rows=0)
        if len(meta):
            b = dock.fetch(meta)
            dock.put({"responses": [p * 2 for p in b["prompts"]]}, rows=meta)
            got += meta.rows.tolist()
    return ray.get_runtime_context().get_node_id(), got


@ray.remote(num_cpus=0.05)
def bad_inputs(dock: Dock) -> list[str]:
    """The bad-input suite from a client on one node: each call raises and changes nothing."""

    def state():
        s = dock.stats()
        return s["allocated_rows"], s["warehouse_bytes"], repr(dock.progress())

    before = state()
    out = []
    for fn, exc in [
        (lambda: dock.fetch(np.arange(2), ["nope"]), NotFound),
        (lambda: dock.claim("nope", 4), NotFound),
        (lambda: dock.put({"prompts": [np.arange(2, dtype=np.int32)] * 2}), InvalidArgument),
        (lambda: dock.put({"prompts": [np.arange(2)] * 2}, rows=[30, 31]), InvalidArgument),
        (lambda: dock.put({"prompts": [np.arange(2)] * 64}), OutOfMemory),
        (lambda: dock.fetch(np.arange(2), ["rewards"]), InvalidArgument),
        (lambda: dock.take("gen", 4, columns=["nope"]), NotFound),
    ]:
        try:
            fn()
            out.append("no error")
        except exc:
            out.append("ok" if state() == before else "state changed")
    return out


def test_two_nodes_exactly_once_and_bad_inputs(two_nodes):
    total = 32
    dock = Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_len=16),
            "responses": Column("int64", ragged=True, max_len=16),
            "rewards": Column("float32"),
        },
        stages={"gen": ["prompts"], "update": ["responses"]},
        capacity=total,
        group_size=2,
        warehouses=2,
        backend="ray",
        op_timeout=60.0,
    )
    b = dock._backend
    nodes = {n for n, _ in b.wh_endpoints}
    assert len(nodes) == 2  # one warehouse per node
    # The driver maps its own node's warehouse (near: shared arenas) and reaches the other one through
    # Ray calls (far); one put spans both.
    assert sorted(b._near(w) for w in range(2)) == [False, True] and not b._shared()
    rows = dock.put({"prompts": [np.arange(1 + i % 5) + 10 * i for i in range(total)]})
    assert set(dock.warehouse_of(rows).tolist()) == {0, 1}
    src = {int(r): np.arange(1 + i % 5) + 10 * i for i, r in enumerate(rows)}
    tasks = [
        worker.options(resources={name: 0.01}).remote(dock, total) for name in ("node_a", "node_b", "node_b")
    ]
    results = ray.get(tasks, timeout=180)
    assert len({n for n, _ in results}) == 2  # clients ran on both nodes
    seen = sorted(r for _, got in results for r in got)
    assert seen == sorted(rows.tolist())  # every row exactly once across nodes
    batch = dock.take("update", max_rows=total, columns=["prompts", "responses"])  # near + far pieces
    for k, r in enumerate(batch.rows.tolist()):
        np.testing.assert_array_equal(batch["responses"][k], src[r] * 2)
    padded = dock.fetch(batch, ["prompts"], layout="padded")["prompts"]
    for k, r in enumerate(batch.rows.tolist()):
        np.testing.assert_array_equal(padded.values[k, : len(src[r])], src[r])
        assert not padded.values[k, len(src[r]) :].any()
    for name in ("node_a", "node_b"):
        assert ray.get(bad_inputs.options(resources={name: 0.01}).remote(dock), timeout=120) == ["ok"] * 7
    dock.shutdown()
