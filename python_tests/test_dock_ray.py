"""The Ray backend: same API and semantics as the local one, across processes, with clear errors when an
actor dies. One local Ray instance per module (loopback only, 200 MB object store, fractional CPUs)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dock_util import init_local_ray
from msrl_core import Column, Dock, Ragged
from msrl_core.errors import InvalidArgument, NotFound, OutOfMemory, Timeout, Unavailable

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    init_local_ray(200)
    yield
    ray.shutdown()


def make_dock(fast_path: bool = True, **kw) -> Dock:
    args = dict(
        columns={
            "prompts": Column("int64", ragged=True, max_len=32),
            "responses": Column("int64", ragged=True, max_len=32),
            "rewards": Column("float32"),
        },
        stages={"gen": ["prompts"], "score": ["prompts", "responses"], "update": ["responses", "rewards"]},
        capacity=64,
        group_size=4,
        warehouses=2,
        backend="ray",
        fast_path=fast_path,
    )
    args.update(kw)
    return Dock(**args)


@pytest.mark.parametrize("fast_path", [True, False], ids=["socket", "actor-calls"])
def test_stages_round_trip(fast_path):
    dock = make_dock(fast_path)
    prompts = [np.arange(n, dtype=np.int64) + 100 * n for n in (1, 5, 2, 7, 3, 3, 0, 9)]
    rows = dock.put({"prompts": prompts})
    assert len(rows) == 8 and set(dock.warehouse_of(rows).tolist()) == {0, 1}
    meta = dock.claim("gen", max_rows=8)
    assert sorted(meta.rows.tolist()) == sorted(rows.tolist())
    b = dock.fetch(meta)
    src = {int(r): prompts[i] for i, r in enumerate(rows)}
    for k, r in enumerate(meta.rows):
        np.testing.assert_array_equal(b["prompts"][k], src[int(r)])
    dock.put({"responses": [np.full(int(r) % 3 + 1, int(r)) for r in meta.rows]}, rows=meta)
    score = dock.take("score", max_rows=8, layout="padded")
    assert score["responses"].values.shape[0] == 8
    for k, r in enumerate(score.rows):
        n = int(r) % 3 + 1
        assert score["responses"].values[k, :n].tolist() == [int(r)] * n
        assert score["responses"].mask[k].sum() == n
    dock.put({"rewards": score.rows.astype(np.float32)}, rows=score)
    upd = dock.take("update", max_rows=8, output="torch")
    assert upd["rewards"].tolist() == upd.rows.astype(np.float32).tolist()
    prog = dock.progress()
    assert all(p["consumed_rows"] == 8 for p in prog.values())
    dock.reset()
    assert dock.stats()["allocated_rows"] == 0
    assert sum(dock.stats()["warehouse_bytes"]) == 0
    dock.shutdown()


def test_fetch_in_caller_order_across_warehouses():
    dock = make_dock()
    rows = dock.put({"prompts": [np.full(i % 4 + 1, i) for i in range(16)]})
    src = {int(r): i for i, r in enumerate(rows)}
    shuffled = np.random.default_rng(1).permutation(rows)
    b = dock.fetch(shuffled, ["prompts"])
    for k, r in enumerate(shuffled):
        i = src[int(r)]
        assert b["prompts"][k].tolist() == [i] * (i % 4 + 1)
    dock.shutdown()


def test_bad_input_raises_and_leaves_the_dock_unchanged():
    dock = make_dock(capacity=8, group_size=4)
    dock.put({"prompts": [np.arange(2)] * 4})

    def state():
        s = dock.stats()
        return s["allocated_rows"], s["warehouse_bytes"], repr(dock.progress())

    before = state()
    bad = [
        (lambda: dock.fetch(np.arange(4), ["nope"]), NotFound),
        (lambda: dock.claim("nope", 4), NotFound),
        (lambda: dock.put({"prompts": [np.arange(2, dtype=np.int32)] * 4}), InvalidArgument),
        (lambda: dock.put({"rewards": np.ones(4, np.float32)}, rows=[4, 5, 6, 7]), InvalidArgument),
        (lambda: dock.put({"prompts": [np.arange(2)] * 8}), OutOfMemory),
        (lambda: dock.put({"prompts": [np.arange(2)] * 4}, rows=[0, 1, 2, 3]), InvalidArgument),
        (lambda: dock.fetch(np.arange(4), ["rewards"]), InvalidArgument),
        (lambda: dock.claim("gen", 2), InvalidArgument),
        (lambda: dock.claim("score", 4, timeout=0.05, min_rows=4), Timeout),
    ]
    for fn, exc in bad:
        with pytest.raises(exc):
            fn()
        assert (
            dock.stats()["allocated_rows"],
            dock.stats()["warehouse_bytes"],
            repr(dock.progress()),
        ) == before
    dock.shutdown()


def test_failed_put_on_one_warehouse_is_undone_on_the_others():
    dock = Dock(
        columns={"v": Column("int64", ragged=True, max_bytes=8 * 8)},
        stages={"s": ["v"]},
        capacity=4,
        group_size=2,
        warehouses=2,
        backend="ray",
    )
    rows = dock.put({"v": [np.arange(1)] * 2})  # one group in warehouse 0 or 1
    other = [r for r in range(4) if dock.warehouse_of([r])[0] != dock.warehouse_of(rows[:1])[0]]
    # 2 more groups would go to both warehouses; the one already holding 2 items overflows (8 items max).
    with pytest.raises(OutOfMemory):
        dock.put({"v": Ragged.from_lengths(np.arange(14), [1, 1, 6, 6])}, rows=None)
    assert dock.stats()["allocated_rows"] == 2
    assert sorted(dock.stats()["warehouse_bytes"]) == [0, 16]
    assert len(other) == 2
    dock.shutdown()


def test_blocked_claim_wakes_on_the_completing_put():
    dock = make_dock()
    rows = dock.put({"prompts": [np.arange(2)] * 4})
    out = {}

    def waiter():
        out["meta"] = dock.claim("score", max_rows=4, timeout=20.0)
        out["t"] = time.perf_counter()

    t = threading.Thread(target=waiter)
    t.start()
    while dock.progress()["score"]["waiting_claims"] == 0:
        time.sleep(0.005)
    dock.put({"responses": [np.arange(1)] * 2}, rows=rows[:2])
    time.sleep(0.05)
    assert "meta" not in out  # half a group is not enough
    t_put = time.perf_counter()
    dock.put({"responses": [np.arange(1)] * 2}, rows=rows[2:])
    t.join(20)
    assert sorted(out["meta"].rows.tolist()) == sorted(rows.tolist())
    assert out["t"] >= t_put
    dock.shutdown()


@ray.remote(num_cpus=0.1)
def claim_worker(dock: Dock, stage: str, out_col: str | None, total: int) -> list[int]:
    """A worker process: claims until the stage has seen `total` rows, puts an output per row."""
    got: list[int] = []
    while dock.progress()[stage]["consumed_rows"] < total:
        try:
            meta = dock.claim(stage, max_rows=8, timeout=0.2)
        except TimeoutError:
            continue
        got += meta.rows.tolist()
        if out_col is not None:
            b = dock.fetch(meta, ["prompts"])
            dock.put({out_col: [p * 2 for p in b["prompts"]]}, rows=meta)
    return got


def test_exactly_once_across_processes_and_threads():
    total = 64
    dock = make_dock(capacity=total)
    gen = [claim_worker.remote(dock, "gen", "responses", total) for _ in range(2)]
    score = [claim_worker.remote(dock, "score", None, total) for _ in range(2)]
    local: list[int] = []

    def producer():
        for k in range(total // 8):
            dock.put({"prompts": [np.full(3, 8 * k + i) for i in range(8)]})

    threads = [threading.Thread(target=producer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gen_rows = sum(ray.get(gen, timeout=120), [])
    score_rows = sum(ray.get(score, timeout=120), []) + local
    assert sorted(gen_rows) == list(range(total))
    assert sorted(score_rows) == list(range(total))
    b = dock.fetch(np.arange(total), ["prompts", "responses"])
    for k in range(total):
        np.testing.assert_array_equal(b["responses"][k], b["prompts"][k] * 2)
    dock.shutdown()


def kill_and_wait(handle) -> None:
    """ray.kill is asynchronous, and Ray reports an actor dead before its process has exited (which
    could still answer on its socket): returns once the process is gone."""
    import os

    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(handle)
    wait_gone(pid)


def wait_gone(pid: int) -> None:
    import os

    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor process {pid} still alive 30 s after it was killed")


def test_dead_warehouse_or_controller_raises_unavailable_instead_of_hanging():
    dock = make_dock(op_timeout=10.0)
    rows = dock.put({"prompts": [np.arange(2)] * 8})
    kill_and_wait(dock._backend.warehouses[1])
    t0 = time.perf_counter()
    with pytest.raises(Unavailable, match="warehouse 1"):
        dock.fetch(rows, ["prompts"])
    assert time.perf_counter() - t0 < 10.0
    ray.kill(dock._backend.controller)
    t0 = time.perf_counter()  # not waited for: the blocked claim must notice the death by itself
    with pytest.raises(Unavailable):  # nothing is ready for "update": the claim blocks until the actor dies
        dock.claim("update", max_rows=4, timeout=20.0)
    assert time.perf_counter() - t0 < 20.0
    with pytest.raises(Unavailable):
        dock.progress()
    ray.kill(dock._backend.warehouses[0])


def test_stale_claims_and_reset_during_a_fetch_lease_on_the_shared_memory_path():
    dock = make_dock()
    assert dock._backend._shared()  # same node: data moves through the shared arenas
    rows = dock.put({"prompts": [np.arange(3)] * 8})
    old = dock.claim("gen", max_rows=8)
    dock.reset()
    new_rows = dock.put({"prompts": [np.arange(2)] * 8})
    assert sorted(new_rows.tolist()) == sorted(rows.tolist())
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.fetch(old)
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.put({"responses": [np.arange(1)] * 8}, rows=old)
    assert dock.fetch(new_rows, ["prompts"])["prompts"].lengths.tolist() == [2] * 8
    # A fetch copying out of a warehouse holds a lease; reset is refused until it ends.
    b = dock._backend
    lid, _ = b._wh(0, "locate", [0], new_rows[dock.warehouse_of(new_rows) == 0], -1)
    with pytest.raises(InvalidArgument, match="in flight"):
        dock.reset()
    assert dock.fetch(new_rows, ["prompts"])["prompts"].lengths.tolist() == [2] * 8  # nothing was reset
    assert dock.claim("gen", max_rows=8).epoch == old.epoch + 1
    b._wh(0, "unlease", lid)
    dock.reset()
    # A worker that reserved rows and died before committing would block reset forever: force it.
    rows = dock.put({"prompts": [np.arange(1)] * 4})
    rid, _ = b._wh(int(dock.warehouse_of(rows[:1])[0]), "reserve", [(1, np.ones(4, np.int64))], rows, -1)
    with pytest.raises(InvalidArgument, match="in flight"):
        dock.reset()
    dock.reset(force=True)
    with pytest.raises(InvalidArgument, match="aborted by reset"):
        b._wh(int(dock.warehouse_of(rows[:1])[0]), "commit", rid)
    assert dock.stats()["allocated_rows"] == 0
    dock.shutdown()


@pytest.mark.parametrize("fast_path", [True, False], ids=["shared-memory", "object-store"])
def test_length_balanced_claims(fast_path):
    dock = make_dock(fast_path, balance_by="responses", capacity=8, group_size=2)
    rows = dock.put({"prompts": [np.arange(1)] * 8})
    lens = {int(r): n for r, n in zip(rows, (20, 20, 2, 2, 2, 2, 30, 30))}
    dock.put({"responses": [np.zeros(lens[int(r)], np.int64) for r in rows]}, rows=rows)
    sizes = []
    for _ in range(3):
        meta = dock.claim("score", max_rows=8, max_items=45)
        sizes.append(sum(lens[int(r)] for r in meta.rows))
    assert sizes == [44, 4, 60]
    dock.shutdown()


def test_partial_reset_and_completion_on_ray():
    dock = make_dock()
    rows = dock.put({"prompts": [np.arange(3, dtype=np.int64)] * 8})
    meta = dock.claim("gen", max_rows=4)
    dock.put({"responses": [np.arange(2, dtype=np.int64)] * 4}, rows=meta)
    dock.complete(meta)  # completion is tracked (a completed claim cannot be released)
    with pytest.raises(InvalidArgument, match="completed"):
        dock.release(meta)
    kept = dock.reset(keep_unfinished=True)
    assert sorted(kept.tolist()) == sorted(rows.tolist())  # no group was completed by every stage
    rest = dock.claim("gen", max_rows=8)  # only the groups gen never claimed come back to gen
    assert sorted(rest.rows.tolist()) == sorted(set(rows.tolist()) - set(meta.rows.tolist()))
    score = dock.take("score", max_rows=8)
    assert sorted(score.rows.tolist()) == sorted(meta.rows.tolist())
    assert score["responses"].lengths.tolist() == [2] * 4
    dock.reset()


def test_tensordict_in_and_out():
    torch = pytest.importorskip("torch")
    td_mod = pytest.importorskip("tensordict")
    dock = make_dock()
    rows = dock.put({"prompts": [np.arange(n, dtype=np.int64) for n in (2, 1, 3, 2)]})
    dock.put({"responses": [np.arange(n, dtype=np.int64) for n in (1, 1, 2, 2)]}, rows=rows)
    dock.put(td_mod.TensorDict({"rewards": torch.tensor([1.0, 2.0, 3.0, 4.0])}, batch_size=[4]), rows=rows)
    meta = dock.claim("update", max_rows=4)
    td = dock.fetch(meta, output="tensordict")
    want = dict(zip(rows.tolist(), [1.0, 2.0, 3.0, 4.0]))
    assert td["rewards"].tolist() == [want[int(r)] for r in meta.rows]
    assert td["responses_mask"].sum(1).tolist() == [
        dict(zip(rows.tolist(), (1, 1, 2, 2)))[int(r)] for r in meta.rows
    ]
    dock.reset()


def test_actor_sockets_refuse_pickles_other_users_and_bad_frames(tmp_path):
    """The actors' same-node sockets: a pickled frame runs no code, another uid is refused without an
    fd, and malformed, truncated and 4 GiB frames close only their own connection."""
    import os
    import socket

    from msrl_core.dock import _wire
    from test_dock_wire import (
        can_switch_user,
        closed_by_peer,
        other_user_attack,
        pickled_frames,
        raw_connect,
    )

    dock = make_dock()
    b = dock._backend
    rows = dock.put({"prompts": [np.arange(3)] * 8})
    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)
    paths = [b.endpoint[1]] + [p for _, p in b.wh_endpoints]
    body = _wire.encode(["echo", [1]])
    bad = [
        b"GET / HTTP/1.1\r\n\r\n",
        _wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, len(body) + 10) + body,  # truncated
        _wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, 4 << 30),  # 4 GiB length header
        *pickled_frames(str(marker)),
    ]
    for path in paths:
        for frame in bad:
            s = raw_connect(path)
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
            assert closed_by_peer(s)
            s.close()
        if can_switch_user():
            got = other_user_attack(path, str(marker))
            assert all(got[k]["fds"] == 0 and got[k]["reply_bytes"] == 0 for k in ("fds", "pickle")), got
    assert not marker.exists()
    diags = ray.get([h.diagnostics.remote() for h in [b.controller, *b.warehouses]])
    for d in diags:
        assert d["wire"]["malformed"] == 4  # the truncated frame is a closed connection, not a bad frame
        if can_switch_user():
            assert d["wire"]["refused_uid"] == 2
    # Every actor still serves this client (same-node path): claim, fetch, put.
    meta = dock.claim("gen", max_rows=8)
    assert sorted(meta.rows.tolist()) == sorted(rows.tolist())
    assert dock.fetch(meta)["prompts"].lengths.tolist() == [3] * 8
    dock.put({"responses": [np.arange(1)] * 8}, rows=meta)
    assert dock.progress()["score"]["ready_rows"] == 8
    dock.shutdown()


@ray.remote(num_cpus=0.05, max_retries=0)
def reserve_and_die(dock: Dock, warehouse: int, rows: np.ndarray) -> None:
    """A client that reserved rows in a warehouse arena and died before committing."""
    import os

    dock._backend._wh(warehouse, "reserve", [(1, np.ones(len(rows), np.int64))], rows, -1)
    os._exit(1)


def test_faults_leave_the_others_served_and_committed_rows_intact():
    dock = make_dock(op_timeout=10.0)
    rows = dock.put({"prompts": [np.arange(3) + i for i in range(8)]})
    src = {int(r): np.arange(3) + i for i, r in enumerate(rows)}
    wh = dock.warehouse_of(rows)
    # A client killed between reserve and commit: nothing it reserved becomes readable, the others go on.
    with pytest.raises(ray.exceptions.RayError):
        ray.get(reserve_and_die.remote(dock, 0, rows[wh == 0]), timeout=60)
    assert dock.progress()["score"]["ready_rows"] == 0
    assert len(dock.claim("gen", max_rows=8)) == 8
    dock.put({"rewards": np.arange(8, dtype=np.float32)}, rows=rows)
    with pytest.raises(InvalidArgument, match="being written"):  # until reset(force=True) aborts it
        dock.put({"responses": [np.arange(1)] * 8}, rows=rows)
    with pytest.raises(InvalidArgument, match="in flight"):
        dock.reset()  # the dead client's reservation is still registered
    # A warehouse killed: calls that need it raise Unavailable within op_timeout; the survivor serves.
    kill_and_wait(dock._backend.warehouses[1])
    for fn in (
        lambda: dock.fetch(rows, ["prompts"]),
        lambda: dock.put({"responses": [np.arange(1)] * 4}, rows=rows[wh == 1]),
    ):
        t0 = time.perf_counter()
        with pytest.raises(Unavailable, match="warehouse 1"):
            fn()
        assert time.perf_counter() - t0 < 10.0
    alive = rows[wh == 0]
    b = dock.fetch(alive, ["prompts", "rewards"])
    for k, r in enumerate(alive.tolist()):
        assert b["prompts"][k].tolist() == src[r].tolist()
        assert b["rewards"][k] == float(rows.tolist().index(r))
    dock.shutdown()


def test_reset_is_atomic_against_racing_puts():
    """Puts race resets: every put succeeds; a row is wholly there (all columns, its own values) or
    wholly gone, puts that started after the last reset are there, puts done before it are gone."""
    dock = Dock(
        columns={"a": Column("int64"), "b": Column("int64", ragged=True, max_len=8)},
        stages={"read": ["a", "b"]},
        capacity=1024,
        group_size=4,
        warehouses=2,
        backend="ray",
        actor_cpus=0.01,
    )
    resets = [0]  # resets that returned
    done = threading.Event()
    puts: list[tuple[int, int, int]] = []  # (tag, resets before, resets after)
    errors: list[BaseException] = []

    def putter(first: int) -> None:
        try:
            for tag in range(first, first + 30):
                before = resets[0]
                dock.put({"a": np.full(4, tag), "b": [np.full(tag % 5 + 1, tag)] * 4})
                puts.append((tag, before, resets[0]))
                time.sleep(0.003 * (tag % 3))
                if tag % 10 == 9:  # let a reset in (one refuses while any put is in flight)
                    deadline = time.monotonic() + 60
                    while resets[0] == before and time.monotonic() < deadline:
                        time.sleep(0.005)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def resetter() -> None:
        while not done.is_set():
            try:
                dock.reset()
                resets[0] += 1
            except InvalidArgument as e:  # a put in flight: refused, nothing changed
                assert "in flight" in str(e)
            time.sleep(0.002)

    threads = [threading.Thread(target=putter, args=(k * 1000,)) for k in range(3)]
    rt = threading.Thread(target=resetter)
    rt.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    rt.join(120)
    assert not errors, errors
    assert resets[0] > 0
    final = resets[0]
    ready = dock.progress()["read"]["ready_rows"]
    assert ready == dock.stats()["allocated_rows"]
    batch = dock.take("read", max_rows=1024, min_rows=ready, timeout=30.0) if ready else None
    present: dict[int, int] = {}
    if batch is not None:
        for k in range(len(batch.rows)):
            tag = int(batch["a"][k])
            assert batch["b"][k].tolist() == [tag] * (tag % 5 + 1)  # its own values, every column
            present[tag] = present.get(tag, 0) + 1
    assert all(n == 4 for n in present.values())  # whole groups
    for tag, before, after in puts:
        if before == final:
            assert tag in present, (tag, before, after, final)
        if after < final:
            assert tag not in present, (tag, before, after, final)
    dock.shutdown()


@pytest.mark.parametrize("path", ["local", "socket", "actor-calls"])
def test_padded_and_packed_fetch_in_any_row_order(path):
    """Rows of two warehouses in an interleaved order: packed and padded (zeros after each row) come back
    in the caller's order, through the native copy on every path."""
    kw = {"backend": "local"} if path == "local" else {"backend": "ray", "fast_path": path == "socket"}
    dock = Dock(
        columns={"prompts": Column("int64", ragged=True, max_len=8), "rewards": Column("float32")},
        stages={"read": ["prompts", "rewards"]},
        capacity=16,
        group_size=2,
        warehouses=2,
        **kw,
    )
    prompts = [np.arange(n, dtype=np.int64) + 100 * n for n in (3, 1, 0, 5, 2, 4, 6, 1)]
    rows = dock.put({"prompts": prompts, "rewards": np.arange(8, dtype=np.float32)})
    src = {int(r): prompts[i] for i, r in enumerate(rows)}
    reward = {int(r): float(i) for i, r in enumerate(rows)}
    order = rows[[7, 0, 4, 3, 1, 6, 2, 5]]
    assert len(set(dock.warehouse_of(order[:3]).tolist())) == 2
    padded = dock.fetch(order, ["prompts", "rewards"], layout="padded")
    packed = dock.fetch(order, ["prompts"])
    assert padded["prompts"].values.shape == (8, 6)
    for k, r in enumerate(order.tolist()):
        n = len(src[r])
        assert padded["prompts"].values[k, :n].tolist() == src[r].tolist()
        assert (padded["prompts"].values[k, n:] == 0).all()
        assert packed["prompts"][k].tolist() == src[r].tolist()
        assert padded["rewards"][k] == reward[r]
    assert padded["prompts"].lengths.tolist() == [len(src[r]) for r in order.tolist()]
    empty = dock.fetch(rows[:0], ["prompts"], layout="padded")["prompts"]
    assert empty.values.shape == (0, 0) and empty.lengths.tolist() == []
    dock.shutdown()


def _kill_now(pid: int) -> None:
    """SIGKILL an actor process and wait until it is gone (from inside a dock operation)."""
    import os
    import signal

    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)


@pytest.mark.parametrize(
    "victim,during,path",
    [
        ("warehouse", "put", "socket"),
        ("warehouse", "fetch", "socket"),
        ("controller", "put", "socket"),
        ("controller", "fetch", "socket"),
        ("warehouse", "put", "actor-calls"),
        ("warehouse", "fetch", "actor-calls"),
    ],
)
def test_faults_timed_inside_a_put_or_a_fetch(monkeypatch, victim, during, path):
    """An actor killed inside a put or a fetch — same node: while it copies through the shared arenas
    (after the reserve or locate, before the commit or unlease); actor calls: while it waits for the
    actors' answers: the operation and every later call that needs the dead actor raise Unavailable or
    Timeout within op_timeout; rows committed on the surviving warehouse stay intact and readable."""
    import os

    from msrl_core import _core
    from msrl_core.dock import _client

    dock = make_dock(path == "socket", op_timeout=10.0)
    prompts = [np.arange(3) + i for i in range(8)]
    rows = dock.put({"prompts": prompts})
    wh = dock.warehouse_of(rows)
    handle = dock._backend.warehouses[1] if victim == "warehouse" else dock._backend.controller
    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
    module, name = (_core, "dock_copy_rows") if path == "socket" else (_client, "ray_get")
    original = getattr(module, name)
    fired = []

    def kill_then_go_on(*args):
        if not fired:
            fired.append(True)
            _kill_now(pid)
        return original(*args)

    monkeypatch.setattr(module, name, kill_then_go_on)
    t0 = time.perf_counter()
    if during == "put" or path == "actor-calls":
        with pytest.raises((Unavailable, Timeout)):
            if during == "put":
                dock.put({"prompts": [np.arange(2)] * 8})
            else:
                dock.fetch(rows, ["prompts"])
    else:  # the arenas stay mapped in this process: the copy completes; the unlease is lost
        got = dock.fetch(rows, ["prompts"])
        assert [got["prompts"][k].tolist() for k in range(8)] == [p.tolist() for p in prompts]
    assert fired and time.perf_counter() - t0 < 10.0
    monkeypatch.setattr(module, name, original)
    later = [lambda: dock.put({"prompts": [np.arange(1)] * 8})]
    if victim == "warehouse":
        later.append(lambda: dock.fetch(rows[wh == 1], ["prompts"]))
    else:
        later += [lambda: dock.claim("gen", max_rows=4, timeout=5.0), lambda: dock.progress()]
    for fn in later:
        t0 = time.perf_counter()
        with pytest.raises((Unavailable, Timeout)):
            fn()
        assert time.perf_counter() - t0 < 10.0 + 5.0
    alive = rows[wh == 0]
    b = dock.fetch(alive, ["prompts"])  # warehouse 0 survived: its committed rows are intact
    src = {int(r): prompts[i] for i, r in enumerate(rows)}
    assert [b["prompts"][k].tolist() for k in range(len(alive))] == [src[int(r)].tolist() for r in alive]
    dock.shutdown()


def test_lengths_that_do_not_match_the_rows_are_refused_by_the_actors():
    # A same-node peer's lengths array is checked against its rows before any arena offset is computed
    # from it (before the fix, a short array was read past its end inside the warehouse actor).
    dock = make_dock()
    be = dock._backend
    rows = dock.put({"prompts": [np.arange(3)] * 4})  # one group, one warehouse
    w = int(dock.warehouse_of(rows[:1])[0])
    new_rows, put_id, _ = be._ctl("allocate", 4)
    w_new = int(dock.warehouse_of(new_rows[:1])[0])
    with pytest.raises(InvalidArgument, match="1 lengths for 4 rows"):
        be._wh(w_new, "reserve", [(1, np.ones(1, np.int64))], new_rows, -1)
    with pytest.raises(InvalidArgument, match="1 lengths for 4 rows"):
        be._ctl("mark_ready", [(1, np.ones(1, np.int64))], new_rows, -1, 0, put_id)
    with pytest.raises(OutOfMemory, match="more than its arena holds"):  # 2**61 * 8 bytes wraps to 0
        be._wh(w_new, "reserve", [(1, np.array([2**61, 0, 0, 0], np.int64))], new_rows, -1)
    with pytest.raises(InvalidArgument, match="not those this put began with"):
        be._ctl("mark_ready", [(0, None)], rows, -1, 0, put_id)  # rows of another put
    be._ctl("end_put", put_id)  # the allocated rows go back
    with pytest.raises(InvalidArgument, match="1 lengths for 4 rows"):
        ray.get(be.warehouses[w].put.remote([(1, np.arange(3), np.ones(1, np.int64))], rows, -1))
    # Nothing changed and both actors still serve.
    assert dock.stats()["allocated_rows"] == 4
    claim = dock.claim("gen", max_rows=4, timeout=10)
    got = dock.fetch(claim, ["prompts"])["prompts"]
    assert list(got.lengths) == [3] * 4 and list(np.asarray(got.values)) == [0, 1, 2] * 4
    dock.shutdown()


def _inject(be, name: str, op: str, when: str):
    """Makes be.<name>(op, ...) fail once with Timeout, before sending the call or after its answer."""
    real = getattr(be, name)
    state = {"armed": True}

    def call(*args, **kw):
        hit = state["armed"] and op in args[:2]
        if hit:
            state["armed"] = False
            if when == "before":
                raise Timeout(f"injected: {op} did not answer")
        out = real(*args, **kw)
        if hit:
            raise Timeout(f"injected: the answer to {op} was lost")
        return out

    setattr(be, name, call)
    return lambda: setattr(be, name, real)


@pytest.mark.parametrize("fast_path", [True, False], ids=["socket", "actor-calls"])
def test_a_publish_whose_answer_is_lost_is_settled_with_the_controller(fast_path):
    # Before: the put's rows went back to the allocator while the warehouses kept its bytes, so every
    # later put got the same rows and failed with "already written" until a reset.
    dock = make_dock(fast_path=fast_path)
    be = dock._backend
    undo = _inject(be, "_ctl", "mark_ready", "before")  # never published
    with pytest.raises(Timeout):
        dock.put({"prompts": [np.arange(3)] * 4})
    undo()
    assert dock.progress()["gen"]["ready_rows"] == 0
    for k in range(3):  # later puts get other rows and succeed
        rows = dock.put({"prompts": [np.arange(2) + k] * 4})
        got = dock.fetch(rows, ["prompts"])["prompts"]
        assert list(np.asarray(got.values)) == [k, k + 1] * 4
    assert dock.stats()["allocated_rows"] == 16  # the unpublished put's rows stay until the reset
    undo = _inject(be, "_ctl", "mark_ready", "after")  # published; only the answer was lost
    rows = dock.put({"prompts": [np.arange(5)] * 4})  # the put succeeded: no error
    undo()
    assert len(rows) == 4 and dock.progress()["gen"]["ready_rows"] == 16
    dock.reset()
    assert dock.stats()["allocated_rows"] == 0
    rows = dock.put({"prompts": [np.arange(3)] * 64})  # the whole dock is usable again
    assert len(rows) == 64
    dock.shutdown()


def test_a_commit_that_fails_part_way_leaves_nothing_in_flight():
    # Before: the failed commit's own reservation was neither aborted nor erased, so every reset()
    # refused with "1 put(s) are in flight" and the rows stayed "being written".
    dock = make_dock()
    be = dock._backend
    undo = _inject(be, "_wh", "commit", "before")
    with pytest.raises(Timeout):
        dock.put({"prompts": [np.arange(3)] * 8})  # two groups, two warehouses
    undo()
    dock.reset()  # not refused
    rows = dock.put({"prompts": [np.arange(3)] * 64})
    got = dock.fetch(rows, ["prompts"])["prompts"]
    assert list(got.lengths) == [3] * 64
    dock.shutdown()


@pytest.mark.parametrize("fast_path", [True, False], ids=["socket", "actor-calls"])
def test_arenas_grow_on_both_data_paths_and_a_bound_stays_a_bound(fast_path):
    """Rows 8x max_len: same node the client copies into the grown shared file (mapped again), through
    actor calls the warehouse stores them itself; a column with max_bytes keeps refusing, nothing stored."""
    dock = make_dock(
        fast_path,
        columns={
            "prompts": Column("int64", ragged=True, max_len=2),
            "capped": Column("int64", ragged=True, max_bytes=64),
        },
        stages={"gen": ["prompts"]},
        capacity=16,
    )
    src = [np.arange(16) * k for k in range(16)]
    rows = dock.put({"prompts": src})
    got = dock.fetch(rows, ["prompts"])["prompts"]
    assert [got[k].tolist() for k in range(16)] == [s.tolist() for s in src]
    assert sum(w["arena_bytes"] for w in dock.column_stats("prompts")) >= 16 * 16 * 8
    with pytest.raises(OutOfMemory, match="capped"):
        dock.put({"capped": [np.arange(9)] * 4}, rows=rows[:4])
    assert sum(w["bytes_used"] for w in dock.column_stats("capped")) == 0
    dock.shutdown()
