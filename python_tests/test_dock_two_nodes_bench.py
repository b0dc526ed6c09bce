"""The measuring parts of bench/dock_two_nodes.py (issue 14's two-node figure), checked for what they claim:
the data verifier finds a wrong column or prompt, the cross-node byte count attributes a known TCP transfer
between two processes to its nodes, and on two raylets (ray.cluster_utils.Cluster, as in
test_dock_multinode.py) the dock and the centralized buffer run with the same clients on the same nodes,
verified, with the buffer's cross-node bytes covering every byte its other-node clients moved. No timing is
asserted: the figures are in bench/README.md."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

BENCH = str(Path(__file__).resolve().parents[1] / "bench")
sys.path.insert(0, BENCH)

import dock_two_nodes as dtn  # noqa: E402
from grpo_workload import DockClient, make_dock  # noqa: E402


def _filled(total: int, group: int, corrupt_values: bool, monkeypatch):
    """A local-backend dock with every stage's outputs written by dock_two_nodes' workers."""
    dock = make_dock(total, group, backend="local")
    client = DockClient(dock)
    prompts = dtn.make_prompts(total)
    client.put_prompts(prompts)
    for stage, seed in (("rollout", 1), ("reference", 3), ("reward", 4), ("critic", 5)):
        with monkeypatch.context() as m:
            if corrupt_values and stage == "critic":  # the critic writes 0.5 * responses instead of 0.25
                m.setitem(dtn.DERIVED, "values", dtn.DERIVED["ref_log_prob"])
            assert dtn.CheckedWorker(client, stage, 8, seed).run_rows(total) == total
    return dock, client, prompts


def test_verifier_accepts_the_workers_data_and_finds_a_wrong_column_or_prompt(monkeypatch):
    total = 32
    dock, client, prompts = _filled(total, 4, False, monkeypatch)
    lens = dtn.response_lengths(np.arange(total))
    assert lens.min() >= 16 and lens.max() <= 2048 and len(set(lens.tolist())) > total // 2
    vals, _ = dtn.responses_of(np.array([3]))
    np.testing.assert_array_equal(vals, 3 * dtn.ID_STRIDE + np.arange(lens[3]))
    assert dtn.CheckedWorker(client, "update", 8, 6).verify_rows(total, prompts) == {
        "rows_checked": total,
        "ids_exactly_once": True,
        "mismatched_columns": [],
    }
    client.reset()
    client.put_prompts(prompts)
    wrong = prompts.copy()
    wrong[5, 100] += 1
    for stage, seed in (("rollout", 1), ("reference", 3), ("reward", 4), ("critic", 5)):
        dtn.CheckedWorker(client, stage, 8, seed).run_rows(total)
    assert dtn.CheckedWorker(client, "update", 8, 6).verify_rows(total, wrong)["mismatched_columns"] == [
        "prompts"
    ]
    dock.shutdown()

    dock, client, prompts = _filled(total, 4, True, monkeypatch)
    got = dtn.CheckedWorker(client, "update", 8, 6).verify_rows(total, prompts)
    assert got["mismatched_columns"] == ["values"] and got["ids_exactly_once"]
    dock.shutdown()


def test_update_stage_records_the_ids_it_fetched(monkeypatch):
    total = 16
    dock, client, _ = _filled(total, 4, False, monkeypatch)
    upd = dtn.CheckedWorker(client, "update", 8, 6)
    assert upd.run_rows(total) == total
    ids = np.sort(np.concatenate(upd.seen_ids()))
    np.testing.assert_array_equal(ids, np.arange(total))
    assert upd.seen_ids() == []  # handed over once
    dock.shutdown()


def test_cross_node_bytes_attribute_a_known_transfer_to_its_nodes():
    n = 3_000_000
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    child_src = textwrap.dedent(f"""
        import socket
        c = socket.create_connection(("127.0.0.1", {port}))
        c.sendall(b"x" * {n})
        c.recv(1)  # keep the socket open until the parent's last sample
    """)
    with dtn.TcpTally(interval=0.05) as tally:
        child = subprocess.Popen([sys.executable, "-c", child_src])
        conn, _ = srv.accept()
        got = 0
        while got < n:
            got += len(conn.recv(1 << 20))
    conn.sendall(b"k")
    assert child.wait(timeout=30) == 0
    conn.close()
    srv.close()
    procs = {os.getpid(): ("node_a", "driver"), child.pid: ("node_b", "child")}
    out = dtn.cross_node_bytes(tally, procs)
    assert out["cross_node_top_pairs"]["node_b:child -> node_a:driver"] == n
    assert out["tcp_bytes_cross_node"] == n and out["tcp_bytes_peer_unknown"] == 0
    same = dtn.cross_node_bytes(tally, {os.getpid(): ("node_a", "driver"), child.pid: ("node_a", "child")})
    assert same["tcp_bytes_cross_node"] == 0 and same["tcp_bytes_all_cluster"] == n


@pytest.mark.slow
def test_two_raylets_same_clients_for_dock_and_central_verified(monkeypatch):
    from grpo_workload import _CLUSTERS, start_two_nodes, stop_ray

    # The workers unpickle grpo_workload's classes: the raylets (so every worker) get bench/ on their path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [BENCH, os.environ.get("PYTHONPATH")])))
    args = argparse.Namespace(prompts=16, group=4, steps=2, warmup=0, ss_interval=0.2, probe_rounds=1)
    start_two_nodes(1)
    try:
        rows = {s: dtn.run_once(s, args, _CLUSTERS[0], 0) for s in ("dock", "central")}
    finally:
        stop_ray()
    d, c = rows["dock"], rows["central"]
    for r in (d, c):
        assert r["verified"] == {
            "timed_steps_exactly_once": True,
            "rows_checked": 64,
            "ids_exactly_once": True,
            "mismatched_columns": [],
        }
        assert r["payload_bytes_by_client_node"]["node_b"] > 0
    assert d["placement"]["clients"] == c["placement"]["clients"]
    assert set(d["placement"]["clients"].values()) == {"node_a", "node_b"}
    assert d["placement"]["actors"]["WarehouseActor"] == ["node_a", "node_b"]
    assert c["placement"]["actors"] == {"CentralBuffer": ["node_a"]}
    assert d["payload_bytes_moved"] == c["payload_bytes_moved"]  # the same workload, byte for byte
    # Every byte that the buffer's node_b clients fetched or put crossed to node_a and back: the
    # measured cross-node TCP bytes cover them (plus Ray's framing and control traffic).
    assert c["tcp_bytes_cross_node"] >= c["payload_bytes_by_client_node"]["node_b"]
    assert d["tcp_bytes_cross_node"] > 0
    assert any("raylet -> node_" in k for k in c["cross_node_top_pairs"])


def test_a_socket_opened_after_an_empty_first_sample_counts_from_zero(monkeypatch):
    # A quiet machine (a fresh CI runner) has no established TCP socket when the tally starts; the socket
    # found by the next sample must count all its bytes, not start from what it had by then (which lost the
    # 3 MB of the test above in CI).
    snaps = iter([{}, {("a:1", "b:2"): (11, 700)}, {("a:1", "b:2"): (11, 1000)}])
    monkeypatch.setattr(dtn, "ss_snapshot", lambda: next(snaps))
    tally = dtn.TcpTally()
    for _ in range(3):
        tally._sample()
    assert tally.deltas() == [(-1, 11, 1000)]
