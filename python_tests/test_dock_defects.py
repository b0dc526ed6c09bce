"""Defects found when the dock was tried as a new user would; each test runs on both backends (Ray: one
local instance for the module, loopback, small object store, fractional CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dock_util import init_local_ray
from msrl_core import Claim, Column, Dock
from msrl_core.errors import Closed, InvalidArgument, MsrlError, NotFound, Unavailable

G = 2


@pytest.fixture(scope="module")
def ray_up():
    ray = pytest.importorskip("ray")
    init_local_ray(100)
    yield ray
    ray.shutdown()


@pytest.fixture(params=["local", "ray"])
def make(request):
    docks: list[Dock] = []
    if request.param == "ray":
        request.getfixturevalue("ray_up")

    def make_dock(**kw) -> Dock:
        args = dict(
            columns={
                "prompts": Column("int64", ragged=True, max_len=8),
                "responses": Column("int64", ragged=True, max_len=8),
                "rewards": Column("float32"),
            },
            stages={
                "gen": ["prompts"],
                "score": ["prompts", "responses"],
                "update": ["responses", "rewards"],
            },
            capacity=8,
            group_size=G,
            warehouses=2,
            backend=request.param,
        )
        args.update(kw)
        dock = Dock(**args)
        docks.append(dock)
        return dock

    yield make_dock
    for d in docks:
        d.shutdown()


def test_take_validates_before_claiming_and_releases_on_a_later_error(make):
    dock = make()
    rows = dock.put({"prompts": [np.arange(2)] * 4})
    bad = [
        (dict(columns=["nope"]), NotFound),
        (dict(layout="ragged"), InvalidArgument),
        (dict(output="pandas"), InvalidArgument),
        (dict(columns=["responses"]), InvalidArgument),  # known column, not written: fails after the claim
    ]
    for kw, exc in bad:
        with pytest.raises(exc):
            dock.take("gen", max_rows=4, **kw)
        assert dock.progress()["gen"] == {"ready_rows": 4, "consumed_rows": 0, "waiting_claims": 0}, kw
    batch = dock.take("gen", max_rows=4)
    assert sorted(batch.rows.tolist()) == sorted(rows.tolist())


def test_a_claim_released_or_completed_cannot_release_its_rows_again(make):
    dock = make()
    dock.put({"prompts": [np.arange(2)] * 2})
    a = dock.claim("gen", max_rows=2)
    dock.release(a)
    b = dock.claim("gen", max_rows=2)  # another worker gets the same rows
    assert b.rows.tolist() == a.rows.tolist() and b.claim_id != a.claim_id
    with pytest.raises(InvalidArgument, match="no longer holds"):
        dock.release(a)
    with pytest.raises(InvalidArgument, match="no longer holds"):
        dock.put({"responses": [np.arange(1)] * 2}, rows=a)  # nothing written with the stale claim
    assert dock.progress()["score"]["ready_rows"] == 0
    assert dock.claim("gen", max_rows=2).rows.size == 0  # not re-delivered
    dock.put({"responses": [np.arange(1)] * 2}, rows=b)  # completes b
    with pytest.raises(InvalidArgument, match="completed"):
        dock.release(b)
    assert dock.claim("gen", max_rows=2).rows.size == 0
    assert dock.progress()["gen"]["consumed_rows"] == 2


def test_a_put_with_plain_row_ids_completes_the_claim(make):
    dock = make()
    dock.put({"prompts": [np.arange(2)] * 2})
    meta = dock.claim("gen", max_rows=2)
    dock.put({"responses": [np.arange(1)] * 2}, rows=meta.rows)  # plain ids, not the Claim
    with pytest.raises(InvalidArgument, match="completed"):
        dock.release(meta)


def test_partial_reset_keeps_a_group_until_every_stage_completed_it(make):
    dock = make()
    rows = dock.put({"prompts": [np.arange(2)] * 4})
    gen = dock.claim("gen", max_rows=4)
    dock.put({"responses": [np.arange(1)] * 4}, rows=gen.rows)  # plain ids: completes gen's claim
    score = dock.claim("score", max_rows=4)
    dock.put({"rewards": np.ones(4, np.float32)}, rows=score)
    upd = dock.claim("update", max_rows=4)
    dock.complete(Claim(upd.stage, upd.rows[:G], None, upd.epoch, upd.claim_id))  # its first group only
    # Finished = completed by every stage: the group update claimed but did not complete is kept.
    kept = dock.reset(keep_unfinished=True)
    assert sorted(kept.tolist()) == sorted(upd.rows[G:].tolist())
    assert set(kept.tolist()) <= set(rows.tolist())
    # gen's work survived (completed by the plain-id put): the kept group does not go back to gen.
    assert dock.claim("gen", max_rows=4).rows.size == 0
    assert sorted(dock.claim("update", max_rows=4).rows.tolist()) == sorted(upd.rows[G:].tolist())
    b = dock.fetch(kept, ["prompts", "responses", "rewards"])  # kept bytes intact (arenas compacted)
    assert b["prompts"].lengths.tolist() == [2] * G and b["rewards"].tolist() == [1.0] * G
    assert dock.stats()["allocated_rows"] == G
    fresh = dock.put({"prompts": [np.arange(3)] * 6})  # the freed rows are reused, the kept ones skipped
    assert not set(fresh.tolist()) & set(kept.tolist())


def test_huge_claim_timeouts_are_clamped(make):
    dock = make()
    out: dict = {}

    def waiter():
        try:
            out["meta"] = dock.claim("gen", max_rows=2, timeout=1e10)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + 60
    while dock.progress()["gen"]["waiting_claims"] == 0 and "error" not in out:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rows = dock.put({"prompts": [np.arange(1)] * 2})
    t.join(60)
    assert "error" not in out, out
    assert sorted(out["meta"].rows.tolist()) == sorted(rows.tolist())
    # A blocked claim with a huge timeout is woken by close() with Closed, an MsrlError.
    t = threading.Thread(target=waiter)
    out.clear()
    t.start()
    while dock.progress()["gen"]["waiting_claims"] == 0 and "error" not in out:
        time.sleep(0.01)
    dock.close()
    t.join(60)
    assert isinstance(out.get("error"), Closed), out


def test_error_messages_name_the_problem_once_and_no_source_location(make):
    dock = make()
    dock.put({"prompts": [np.arange(2)] * 2})
    for fn in (lambda: dock.claim("gen", max_rows=1), lambda: dock.put({"rewards": np.ones(2)}, rows=[6, 7])):
        with pytest.raises(MsrlError) as e:
            fn()
        msg = str(e.value)
        assert not msg.startswith(type(e.value).__name__), msg
        assert "csrc/" not in msg and ".cpp:" not in msg, msg


def test_debug_mode_adds_the_source_location():
    code = (
        "from msrl_core import _core\n"
        "d = _core.DockCore([('p', 'int64', False, [], 0, False, 'int64')], [('s', ['p'], '')], 4, 2, 1)\n"
        "try:\n    d.claim(0, 1, 0, 0.0)\n"
        "except _core.InvalidArgument as e:\n    print(e)\n"
    )
    env = dict(os.environ, MSRL_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "csrc/dock/controller.cpp:" in out.stdout and out.stdout.startswith("InvalidArgument: ")


def test_stats_reports_a_dead_warehouse_per_warehouse(make):
    dock = make()
    rows = dock.put({"prompts": [np.arange(2)] * 8})
    s = dock.stats()
    assert (s["ops"]["put"]["count"], s["ops"]["put"]["rows"]) == (1, 8)  # dock-wide counters, both backends
    assert s["ops"]["claim"]["count"] == 0 and s["ops"]["put"]["p50_us"] > 0
    if dock.backend == "local":
        assert [w["error"] for w in s["warehouses"]] == [None, None] and sum(s["warehouse_bytes"]) == 8 * 16
        return
    from test_dock_ray import kill_and_wait

    dead = int(dock.warehouse_of(rows[:1])[0])
    kill_and_wait(dock._backend.warehouses[dead])
    s = dock.stats()
    assert s["warehouse_bytes"][dead] is None and "warehouse" in s["warehouses"][dead]["error"]
    alive = 1 - dead
    assert s["warehouse_bytes"][alive] == int((dock.warehouse_of(rows) == alive).sum()) * 16
    assert s["warehouses"][alive]["error"] is None
    assert s["allocated_rows"] == 8
    with pytest.raises(Unavailable):
        dock.fetch(rows, ["prompts"])


@pytest.mark.parametrize("make", ["ray"], indirect=True)  # the local backend has no connections
def test_short_lived_threads_leave_no_threads_or_fds_behind(make):
    dock = make(capacity=16)
    import ray

    b = dock._backend
    actors = [b.controller, *b.warehouses]

    def one_round():
        dock.put({"prompts": [np.arange(2)] * 2})
        meta = dock.claim("gen", max_rows=2)
        dock.fetch(meta)
        dock.put({"responses": [np.arange(1)] * 2}, rows=meta)

    def run_threads(n: int) -> None:
        for k in range(0, n, 8):  # at most 8 at a time; every thread is new
            threads = [threading.Thread(target=one_round) for _ in range(min(8, n - k))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            dock.reset()

    def counts():
        return [
            (d["threads"], d["fds"], d["wire"]["open"])
            for d in ray.get([a.diagnostics.remote() for a in actors])
        ]

    def settled(base):
        deadline = time.monotonic() + 60  # closed connections end their server threads shortly after
        now = counts()
        while time.monotonic() < deadline and any(n[2] > b_[2] for n, b_ in zip(now, base)):
            time.sleep(0.1)
            now = counts()
        return now

    run_threads(8)  # warm-up: pools, arenas mapped
    base = settled(counts())
    client_fds = len(os.listdir("/proc/self/fd"))
    run_threads(200)
    after = settled(base)
    for (t0, f0, o0), (t1, f1, o1) in zip(base, after):
        assert o1 <= o0, (base, after)  # connections of ended threads are closed
        # Flat: a leak was +200 threads and fds; Ray's own pools may add a few threads under load.
        assert t1 <= t0 + 8 and f1 <= f0 + 4, (base, after)
    assert len(os.listdir("/proc/self/fd")) <= client_fds + 8  # a leak was 3 per thread


def test_shutdown_and_context_manager(make):
    with make() as dock:
        dock.put({"prompts": [np.arange(2)] * 2})
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("r", _claim_error(dock)))
        t.start()
        while dock.progress()["score"]["waiting_claims"] == 0:
            time.sleep(0.01)
    t.join(60)
    # Ray: the actors may be gone before the woken claim's answer is read.
    assert isinstance(out["r"], Closed if dock.backend == "local" else (Closed, Unavailable)), out
    dock.shutdown()  # again: nothing happens


def _claim_error(dock: Dock) -> BaseException | None:
    try:
        dock.claim("score", max_rows=2, timeout=60.0)
    except MsrlError as e:
        return e
    return None
