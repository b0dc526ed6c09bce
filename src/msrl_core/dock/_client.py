"""Ray backend client: S warehouse actors (bytes) and one controller actor (metadata of every stage).

Data travels through Ray's object store: a put sends each warehouse its slice of the numpy values (one
call per warehouse, in parallel) and a fetch asks every involved warehouse for its rows at once.

Metadata and data calls from clients on the actors' node skip Ray's task path: each actor serves a Unix
socket (msrl_core.dock._wire: same uid only, fixed binary encoding) and each client thread keeps one
connection per actor, closed when the thread ends (a Ray actor round trip costs a few hundred
microseconds here; the socket round trip tens). Blocking claims wait inside the native controller on a
condition variable with the GIL released; nothing polls. Clients on other nodes use ordinary actor
calls.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import weakref
from typing import Any

import numpy as np

from msrl_core import _core
from msrl_core.dock._actors import ControllerActor, WarehouseActor, ray_get
from msrl_core.dock._backend import ClaimDP, ClaimIn
from msrl_core.dock._local import column_tuples
from msrl_core.dock._types import Column
from msrl_core.dock._wire import Connection
from msrl_core.errors import Closed, InvalidArgument, MsrlError, NotFound, Timeout, Unavailable

try:
    import ray
except ImportError:  # pragma: no cover - optional dependency
    ray = None  # type: ignore[assignment]

# A client reconnects before using a connection idle this long (the server closes idle ones later).
_IDLE_RECONNECT_S = float(os.environ.get("MSRL_DOCK_IDLE_TIMEOUT", 600.0)) / 2


class _ThreadConns:
    """One thread's connections to the actors; closed when the thread ends (its thread-local goes)."""

    def __init__(self) -> None:
        self.conns: dict[str, Connection] = {}

    def close(self) -> None:
        while self.conns:
            self.conns.popitem()[1].close()

    def __del__(self) -> None:
        self.close()


class _Pin:
    """One fetch's zero-copy views of a warehouse's shared arenas (held by their DockViews): keeps the
    client's arena mappings alive and, when the last view goes, asks the warehouse to drop its pin."""

    __slots__ = ("unpinner", "w", "lid", "arenas")

    def __init__(self, unpinner: _Unpinner, w: int, lid: int, arenas: dict[int, np.ndarray]):
        self.unpinner, self.w, self.lid, self.arenas = unpinner, w, lid, arenas

    def __del__(self) -> None:
        self.unpinner.unpin(self.w, self.lid)


class _Unpinner:
    """Sends the warehouses the unpins of dead views. A view dies in any thread (the GC's included,
    maybe in the middle of a call on that thread's connection), so `unpin` only queues (deque.append and
    SimpleQueue.put are reentrant); a daemon thread, and `flush` before a reset, send them. Popping and
    sending happen under one lock, so after `flush` every view dead before it is unpinned."""

    def __init__(self, backend: RayBackend):
        self.items: collections.deque[tuple[int, int]] = collections.deque()
        self.wake: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.backend = weakref.ref(backend)
        self.thread: threading.Thread | None = None
        self.live = 0  # pins made and not yet unpinned

    def pin(self, w: int, lid: int, arenas: dict[int, np.ndarray]) -> _Pin:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="msrl-dock-unpin", daemon=True)
                self.thread.start()
            self.live += 1
        return _Pin(self, w, lid, arenas)

    def unpin(self, w: int, lid: int) -> None:
        self.items.append((w, lid))
        self.wake.put(True)

    def flush(self) -> None:
        with self.lock:
            while self.items:
                w, lid = self.items.popleft()
                self.live -= 1
                backend = self.backend()
                if backend is not None:
                    with contextlib.suppress(MsrlError):  # a dead warehouse holds no pins any more
                        backend._wh(w, "unlease", lid)

    def _run(self) -> None:
        while self.wake.get():
            self.flush()

    def stop(self) -> None:
        self.wake.put(None)


class RayBackend:
    name = "ray"
    views = True  # zero-copy views of the shared arenas (same node; other columns come back copied)
    picklable = True

    def __init__(
        self,
        columns: dict[str, Column],
        stages: dict[str, list[str]],
        capacity: int,
        group_size: int,
        warehouses: int | None,
        ray_address: str | None = None,
        ray_init: dict | None = None,
        actor_cpus: float = 0.1,
        op_timeout: float = 60.0,
        fast_path: bool = True,
        balance_by: str | None = None,
        _handles: tuple | None = None,
    ):
        if ray is None:
            raise Unavailable("backend='ray' needs ray installed (pip install 'msrl_core[ray]')")
        self.columns = columns
        self.capacity, self.group_size = capacity, group_size
        self.op_timeout = op_timeout
        self.fast_path = fast_path
        self._cols_by_id: dict[int, Column] = dict(enumerate(columns.values()))
        self._pids: dict[str, int] = {}  # partition name -> id (see partition())
        self._local = threading.local()
        # Every thread's connections (weakly: a thread that ends closes its own), closed with the client.
        self._threads: weakref.WeakSet[_ThreadConns] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _close_all, self._threads)
        self._node: str | None = None
        self._arena_maps: dict[int, dict[int, np.ndarray]] = {}
        self._arena_lock = threading.Lock()
        self.balance_by = balance_by
        self.length_column = list(columns).index(balance_by) if balance_by else -1
        self._unpinner = _Unpinner(self)
        self._unpin_stop = weakref.finalize(self, self._unpinner.stop)
        if _handles is not None:  # unpickled in another process
            self.controller, self.warehouses, self.endpoint, self.wh_endpoints, self.group_warehouse = (
                _handles
            )
            self.num_warehouses = len(self.warehouses)
            return
        if not ray.is_initialized():
            kw = dict(ray_init or {})
            if ray_address is not None:
                kw["address"] = ray_address
            else:
                kw.setdefault("num_cpus", os.cpu_count())
                kw.setdefault("include_dashboard", False)
            ray.init(**kw)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        groups = capacity // group_size
        s = int(warehouses or max(1, len(nodes)))
        if not 1 <= s <= groups:
            raise InvalidArgument(f"warehouses must be in [1, {groups}] (one group at least each), got {s}")
        self.num_warehouses = s
        ctl_cls = ray.remote(ControllerActor)
        stage_specs = [(st, list(cols), balance_by or "") for st, cols in stages.items()]
        # The control plane (a metadata-only native DockCore) is the one allocator: it says which rows
        # each warehouse holds and where the client routes them.
        self.controller = ctl_cls.options(num_cpus=actor_cpus, max_concurrency=64).remote(
            column_tuples(columns, 0), stage_specs, capacity, group_size, s
        )
        self.group_warehouse, ranges = self._get(self.controller.call.remote("layout"), "controller")
        wh_cls = ray.remote(WarehouseActor)
        self.warehouses = []
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for w, (first, rows) in enumerate(ranges):
            node = nodes[w % len(nodes)]["NodeID"] if nodes else None
            opts: dict[str, Any] = {"num_cpus": actor_cpus, "max_concurrency": 8}
            if node is not None:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            self.warehouses.append(
                wh_cls.options(**opts).remote(w, first, rows, column_tuples(columns, rows))
            )
        self._get(self.controller.call.remote("attach_warehouses", self.warehouses), "controller")
        self.endpoint = self._get(self.controller.endpoint.remote(), "controller")
        self.wh_endpoints = [
            self._get(h.endpoint.remote(), f"warehouse {w}") for w, h in enumerate(self.warehouses)
        ]

    def __reduce__(self):
        # Handles are serializable: another process (a Ray task or actor) gets a client to the same dock.
        handles = (self.controller, self.warehouses, self.endpoint, self.wh_endpoints, self.group_warehouse)
        cols = self.columns
        return (
            _rebuild,
            (
                cols,
                self.capacity,
                self.group_size,
                self.op_timeout,
                self.fast_path,
                self.balance_by,
                handles,
                self._cols_by_id,
            ),
        )

    # -- plumbing --

    def _get(self, refs: Any, what: str, timeout: float | None = None) -> Any:
        return ray_get(refs, what, timeout if timeout is not None else self.op_timeout)

    def _node_id(self) -> str:
        if self._node is None:
            self._node = ray.get_runtime_context().get_node_id()
        return self._node

    def _conn(self, key: str, endpoint: tuple[str, str]) -> Connection | None:
        """This thread's connection to a same-node actor's socket, or None (use Ray calls)."""
        if not self.fast_path or not endpoint[1]:
            return None
        mine = getattr(self._local, "conns", None)
        if mine is None:
            mine = self._local.conns = _ThreadConns()
            self._threads.add(mine)
        conn = mine.conns.get(key)
        if conn is None:
            node, path = endpoint
            if node != self._node_id():
                return None
            conn = mine.conns[key] = Connection(path, key, _IDLE_RECONNECT_S)
        return conn

    def _rpc(self, conn: Connection, op: str, args: tuple, wait: float, fds: bool = False) -> Any:
        return conn.call(op, args, wait, fds, margin=self.op_timeout)  # op_timeout on every path

    def _ctl(self, op: str, *args: Any, wait: float = 0.0) -> Any:
        try:
            conn = self._conn("controller", self.endpoint)
            if conn is None:
                return self._get(self.controller.call.remote(op, *args), "controller", wait + self.op_timeout)
            return self._rpc(conn, op, args, wait)
        except NotFound as e:
            if "was dropped" in str(e):  # another process dropped a partition: look names up again
                self._pids = {}
            raise

    def _wh(self, w: int, op: str, *args: Any) -> Any:
        key = f"warehouse {w}"
        conn = self._conn(key, self.wh_endpoints[w])
        if conn is None:
            raise Unavailable(f"{key}: no same-node connection")
        return self._rpc(conn, op, args, 0.0)

    def _near(self, w: int) -> bool:
        """True when warehouse w shares its arenas with this process (same node, Linux): its data moves
        through the mapped arenas; a far warehouse's through Ray calls and the object store."""
        if not self.fast_path:
            return False
        node, path = self.wh_endpoints[w]
        return bool(path) and node == self._node_id()

    def _shared(self) -> bool:
        """True when every warehouse is near (see _near)."""
        return all(self._near(w) for w in range(self.num_warehouses))

    def _arenas(self, w: int, need: Any = (), ends: Any = ()) -> dict[int, np.ndarray]:
        """Column id -> this process's mapping of warehouse w's shared arena; mapped again when a column
        in `need` (declared at run time since) is missing, or shorter than its byte in `ends` (the column's
        arena grew since: its file is longer now)."""

        def stale(maps: dict[int, np.ndarray] | None) -> bool:
            return (
                maps is None
                or any(c not in maps for c in need)
                or any(len(maps[c]) < int(end) for c, end in zip(need, ends) if c in maps)
            )

        maps = self._arena_maps.get(w)
        if stale(maps):
            import mmap

            with self._arena_lock:
                maps = self._arena_maps.get(w)
                if stale(maps):
                    key = f"warehouse {w}"
                    conn = self._conn(key, self.wh_endpoints[w])
                    assert conn is not None
                    (cids, sizes), fds = self._rpc(conn, "arena_fds", (), 0.0, fds=True)
                    maps = dict(maps or {})
                    try:
                        if not len(cids) == len(sizes) == len(fds):
                            raise Unavailable(f"{key} sent {len(fds)} arena fds for {len(sizes)} arenas")
                        for c, size, fd in zip(cids, sizes, fds):
                            if int(c) not in maps or len(maps[int(c)]) < int(size):
                                maps[int(c)] = np.frombuffer(mmap.mmap(fd, int(size)), dtype=np.uint8)
                    finally:
                        for fd in fds:
                            os.close(fd)
                    self._arena_maps[w] = maps
        assert maps is not None  # stale(None) is True: mapped above
        return maps

    # -- backend interface --

    def warehouse_of(self, rows: np.ndarray) -> np.ndarray:
        return self.group_warehouse[rows // self.group_size]

    def _split(self, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(warehouse, positions into rows) for every warehouse holding some of the rows."""
        wh = self.warehouse_of(rows)
        order = np.argsort(wh, kind="stable")
        bounds = np.searchsorted(wh[order], np.arange(self.num_warehouses + 1))
        return [
            (w, order[bounds[w] : bounds[w + 1]])
            for w in range(self.num_warehouses)
            if bounds[w + 1] > bounds[w]
        ]

    def _reserve_near(
        self, inputs: list[tuple], rows: np.ndarray, parts: list[tuple[int, np.ndarray]], epoch: int
    ) -> list[tuple[int, int]]:
        """Reserves the rows of near warehouses and copies the values into their shared arenas; returns
        the reservations to commit (on error, those made are aborted)."""
        src = []  # source byte offsets of every row, per column
        for cid, vals, lengths in inputs:
            col = self._cols_by_id[cid]
            flat = vals.reshape(-1).view(np.uint8)
            if lengths is None:
                offs = np.arange(len(rows), dtype=np.int64) * col.item_bytes
            else:
                offs = np.zeros(len(lengths), dtype=np.int64)
                np.cumsum(lengths[:-1], out=offs[1:])
                offs *= col.item_bytes
            src.append((flat, offs))
        reserved: list[tuple[int, int]] = []
        try:
            for w, pos in parts:
                spec = [(cid, None if lengths is None else lengths[pos]) for cid, _, lengths in inputs]
                rid, dst = self._wh(w, "reserve", spec, rows[pos], epoch)
                reserved.append((w, rid))
                arenas = self._arenas(w, [cid for cid, _, _ in inputs], [_end(o, n) for o, n in dst])
                for (cid, _, _), (flat, offs), (dst_offs, nbytes) in zip(inputs, src, dst):
                    _core.dock_copy_rows(arenas[cid], dst_offs, flat, offs[pos], nbytes)
        except BaseException:
            self._abort_near(reserved)
            raise
        return reserved

    def _abort_near(self, reserved: list[tuple[int, int]]) -> None:
        for w, rid in reserved:
            with contextlib.suppress(MsrlError):
                self._wh(w, "abort", rid)

    def _store(self, inputs: list[tuple], rows: np.ndarray, epoch: int, overwrite: bool = False) -> None:
        """Stores a put's bytes, all or nothing: near warehouses get reserve -> copy into the shared
        arena -> commit, far ones a Ray call each (in parallel); a failure anywhere undoes the rest.
        A rewrite (overwrite) goes through the warehouse actors, which hold their reads back meanwhile."""
        parts = self._split(rows)
        near = [(w, pos) for w, pos in parts if self._near(w) and not overwrite]
        far = [(w, pos) for w, pos in parts if not self._near(w) or overwrite]
        reserved = self._reserve_near(inputs, rows, near, epoch)
        try:
            self._put_far(inputs, rows, far, epoch, overwrite)  # all or nothing among the far warehouses
        except BaseException:
            self._abort_near(reserved)
            raise
        done: list[tuple[int, np.ndarray]] = []
        try:
            for (w, rid), (_, pos) in zip(reserved, near):
                self._wh(w, "commit", rid)
                done.append((w, pos))
        except BaseException:
            # The failed commit may or may not have landed: abort it (and the rest) and erase it too.
            self._abort_near(reserved[len(done) :])
            self._erase(inputs, rows, near[: len(done) + 1] + far, epoch)
            raise

    def _erase(
        self, inputs: list[tuple], rows: np.ndarray, parts: list[tuple[int, np.ndarray]], epoch: int
    ) -> None:
        """Best effort: forgets the committed rows of a put (of iteration `epoch`) that failed elsewhere."""
        cids = [cid for cid, _, _ in inputs]
        for w, pos in parts:
            with contextlib.suppress(MsrlError):
                self._get(self.warehouses[w].erase.remote(cids, rows[pos], epoch), f"warehouse {w}")

    def _locate_near(
        self, cids: list[int], rows: np.ndarray, parts: list[tuple[int, np.ndarray]], epoch: int
    ) -> tuple[list[tuple[int, int]], list[list[tuple]]]:
        """Leases and locations (byte offsets, item counts per column) of rows in near warehouses; on
        error the leases taken are ended."""
        leases: list[tuple[int, int]] = []
        located: list[list[tuple]] = []
        try:
            for w, pos in parts:
                lid, locs = self._wh(w, "locate", cids, rows[pos], epoch)
                leases.append((w, lid))
                located.append(locs)
        except BaseException:
            self._unlease(leases)
            raise
        return leases, located

    def _unlease(self, leases: list[tuple[int, int]]) -> None:
        for w, lid in leases:
            with contextlib.suppress(MsrlError):
                self._wh(w, "unlease", lid)

    def fetch_views(self, cols: list[tuple[int, Column]], rows: np.ndarray, epoch: int = -1) -> list[tuple]:
        """Packed (values, lengths or None, is_view) per column. Same node, rows in one warehouse: a
        column whose rows' bytes lie back to back in the arena is a read-only view of the shared arena
        (no copy), pinned in the warehouse until its last array goes (reset() refuses meanwhile); other
        columns are copied out of the arena. Otherwise (rows in several warehouses, other nodes): copies."""
        wh = self.warehouse_of(rows)
        if not len(rows) or (wh != wh[0]).any() or not self._near(int(wh[0])):
            return [(a, lens, False) for a, lens in self.fetch_many(cols, rows, "packed", epoch)]
        w = int(wh[0])
        lid, located = self._wh(w, "locate", [cid for cid, _ in cols], rows, epoch, True)
        try:
            ends = [_end(offs, lens * col.item_bytes) for (_, col), (offs, lens) in zip(cols, located)]
            arenas = self._arenas(w, [cid for cid, _ in cols], ends)
        except BaseException:
            with contextlib.suppress(MsrlError):
                self._wh(w, "unlease", lid)
            raise
        pin: _Pin | None = None
        span: Any = None
        arr: Any = None
        out: list[tuple] = []
        try:
            for (cid, col), (offs, lengths) in zip(cols, located):
                nbytes = lengths * col.item_bytes
                total = int(nbytes.sum())
                if total and (offs[1:] == offs[:-1] + nbytes[:-1]).all():
                    if pin is None:
                        pin = self._unpinner.pin(w, lid, arenas)
                    span = _core.DockView(pin, arenas[cid].ctypes.data + int(offs[0]), total)
                    items = int(lengths.sum()) if col.ragged else len(rows)
                    arr = np.frombuffer(memoryview(span), dtype=col.storage_dtype).reshape(items, *col.shape)
                    out.append((arr, lengths if col.ragged else None, True))
                else:
                    arr, lens = _copy_out(col, len(rows), [(slice(None), arenas[cid], (offs, lengths))])
                    out.append((arr, lens, False))
            return out
        except BaseException:
            out.clear()  # the traceback keeps this frame: nothing may stay pinned through it
            pin = span = arr = None
            raise
        finally:
            if pin is None:  # nothing viewed: the lease ends now
                with contextlib.suppress(MsrlError):
                    self._wh(w, "unlease", lid)

    def live_views(self) -> int:
        """Fetches of this client whose zero-copy views are alive."""
        self._unpinner.flush()
        return self._unpinner.live

    def _put_rows(
        self,
        inputs: list[tuple],
        rows: np.ndarray,
        put_id: int,
        epoch: int,
        stage: int = -1,
        claim_id: int = 0,
        p: int = 0,
        publish: Any = None,
        overwrite: bool = False,
    ) -> None:
        """Stores and publishes a put the controller registered as put_id in iteration `epoch` (a reset
        waits for it; a forced one abandons it, and the warehouses then refuse its bytes). On failure the
        put is ended: when nothing was stored its new rows go back; when its bytes may be stored they are
        erased and its rows stay allocated until the next reset (a later put must not find them written)."""
        try:
            if inputs:
                self._store(inputs, rows, epoch, overwrite)
        except BaseException as e:  # all or nothing: stored nothing, unless an answer was lost (Timeout)
            with contextlib.suppress(MsrlError):
                self._ctl("end_put", put_id, not isinstance(e, Timeout))
            raise
        # Lengths travel only for the column a stage balances its claims by.
        marks = [(cid, lengths if cid == self.length_column else None) for cid, _, lengths in inputs]
        try:
            if publish is None:
                self._ctl("mark_ready", marks, rows, stage, claim_id, put_id, p)
            else:
                publish(marks)
        except BaseException as e:
            # An answered error: the controller ended the put (its rows stay until the next reset).
            answered = isinstance(e, MsrlError) and not isinstance(e, (Timeout, Unavailable))
            if answered or not self._settle(inputs, rows, put_id, epoch):
                raise

    def _settle(self, inputs: list[tuple], rows: np.ndarray, put_id: int, epoch: int) -> bool:
        """After a publish whose answer was lost: True when it was published (the put succeeded). Else the
        put is ended (a late publish is refused), what it stored is erased, and its rows stay allocated
        until the next reset."""
        try:
            in_flight, now = self._ctl("end_put", put_id, False)
        except MsrlError:
            return False  # the controller does not answer either
        if in_flight:
            self._erase(inputs, rows, self._split(rows), epoch)
            return False
        return int(now) == epoch  # ended by its publish; a forced reset (abandoned) moved the iteration

    def _put_far(
        self,
        inputs: list[tuple],
        rows: np.ndarray,
        parts: list[tuple[int, np.ndarray]],
        epoch: int,
        overwrite: bool = False,
    ) -> None:
        """One Ray call per far warehouse with its slice of the values, in parallel; all or nothing."""
        refs = []
        for w, pos in parts:
            sub = []
            for cid, vals, lengths in inputs:
                if lengths is None:
                    sub.append((cid, vals[pos], None))
                else:
                    offs = np.zeros(len(lengths) + 1, dtype=np.int64)
                    np.cumsum(lengths, out=offs[1:])
                    if len(pos) and (np.diff(pos) == 1).all():
                        piece = vals[offs[pos[0]] : offs[pos[-1] + 1]]
                    else:
                        piece = np.concatenate([vals[offs[p] : offs[p + 1]] for p in pos])
                    sub.append((cid, piece, lengths[pos]))
            refs.append(self.warehouses[w].put.remote(sub, rows[pos], epoch, overwrite))
        errors: list[BaseException] = []
        ok: list[tuple[int, np.ndarray]] = []
        for (w, pos), ref in zip(parts, refs):
            try:
                self._get(ref, f"warehouse {w}")
                ok.append((w, pos))
            except BaseException as e:
                errors.append(e)
        if errors:  # all-or-nothing: undo the warehouses that stored their part
            self._erase(inputs, rows, ok, epoch)
            raise errors[0]

    def put_new(self, inputs: list[tuple], n: int) -> np.ndarray:
        rows, put_id, epoch = self._ctl("allocate", n)
        self._put_rows(inputs, rows, put_id, epoch)  # on failure it ends the put
        return rows

    def put(
        self, inputs: list[tuple], rows: np.ndarray, epoch: int = -1, stage: int = -1, claim_id: int = 0
    ) -> None:
        put_id, put_epoch = self._ctl("check_put", rows, epoch, stage, claim_id)
        self._put_rows(inputs, rows, put_id, put_epoch, stage, claim_id)  # on failure it ends the put

    def claim(
        self, stage: int, max_rows: int, min_rows: int, timeout: float, max_items: int = 0
    ) -> tuple[np.ndarray, int, int]:
        rows, epoch, claim_id = self._ctl(
            "claim", stage, max_rows, min_rows, timeout, max_items, wait=timeout
        )
        # Order by warehouse (groups stay whole) so a fetch concatenates warehouse answers directly.
        return self._by_warehouse(rows), int(epoch), int(claim_id)

    def release(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._ctl("release", stage, rows, epoch, claim_id)

    def fetch_many(
        self, cols: list[tuple[int, Column]], rows: np.ndarray, layout: str, epoch: int = -1
    ) -> list[tuple]:
        """All columns of the rows: near warehouses are located (under a lease) and copied straight out of
        their shared arenas, far ones answer one Ray call each (in parallel); every piece lands in the
        caller's row order (padded) through the native copy engine."""
        parts = self._split(rows)
        near = [(w, pos) for w, pos in parts if self._near(w)]
        far = [(w, pos) for w, pos in parts if not self._near(w)]
        specs = [(cid, col.storage_dtype.str, col.shape, col.ragged) for cid, col in cols]
        refs = [self.warehouses[w].fetch.remote(specs, rows[pos], epoch) for w, pos in far]
        leases, located = self._locate_near([cid for cid, _ in cols], rows, near, epoch)
        try:
            got = [self._get(r, f"warehouse {w}") for (w, _), r in zip(far, refs)]
            results: list[tuple] = []
            for k, (cid, col) in enumerate(cols):
                if not near and len(got) == 1 and not (col.ragged and layout == "padded"):
                    results.append(got[0][k])  # one far warehouse's answer as is
                    continue
                pieces = []
                for (w, pos), locs in zip(near, located):
                    end = _end(locs[k][0], locs[k][1] * col.item_bytes)
                    pieces.append((pos, self._arenas(w, [cid], [end])[cid], locs[k]))
                for (_, pos), g in zip(far, got):
                    arr, lens = g[k]
                    lens = np.ones(len(pos), np.int64) if lens is None else lens
                    pieces.append((pos, arr.reshape(-1).view(np.uint8), _packed_offsets(col, lens)))
                results.append(_copy_out(col, len(rows), pieces, layout == "padded"))
            return results
        finally:
            self._unlease(leases)

    def progress(self, stage: int) -> dict:
        return self._get(self.controller.call.remote("progress", stage), "controller")

    def warehouse_status(self) -> list[dict[str, Any]]:
        """Per warehouse: bytes held, or None with the error when it does not answer (dead)."""
        refs = [h.bytes_held.remote() for h in self.warehouses]
        out: list[dict[str, Any]] = []
        for w, ref in enumerate(refs):
            try:
                out.append({"bytes": int(self._get(ref, f"warehouse {w}")), "error": None})
            except (Unavailable, Timeout) as e:
                out.append({"bytes": None, "error": str(e)})
        return out

    def op_stats(self) -> dict:
        """Dock-wide put/claim counts and rows (the controller's); latencies are this client's."""
        return self._get(self.controller.call.remote("op_stats"), "controller")

    def allocated_rows(self) -> int:
        return self._get(self.controller.call.remote("allocated_rows"), "controller")

    def complete(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._ctl("complete", stage, rows, epoch, claim_id)

    def reset(self, force: bool = False, keep_unfinished: bool = False) -> np.ndarray:
        # One controller call, atomic against puts (ControllerState.reset: DockCore's reset in steps); views
        # dropped here unpin first.
        self._unpinner.flush()
        ref = self.controller.call.remote("reset", keep_unfinished, force, self.op_timeout)
        return self._get(ref, "controller", 3 * self.op_timeout)  # it waits on the warehouses twice

    def close(self) -> None:
        with contextlib.suppress(Unavailable, Timeout, Closed):
            self._get(self.controller.call.remote("close"), "controller")

    # -- the keyed store: the controller's native DockCore keeps keys, tags, partitions --

    def partition(self, name: str, create: bool) -> int:
        """The partition's id, cached: ids stay valid until the partition is dropped (then the native calls
        refuse them with NotFound, and the next lookup asks the controller again)."""
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = int(self._ctl("partition", name, create))
        return pid

    def _forget_partition(self, p: int) -> None:
        self._pids = {n: q for n, q in self._pids.items() if q != p}

    def partition_names(self) -> list[str]:
        return self._ctl("partition_names")

    def column_info(self, name: str) -> tuple | None:
        return self._ctl("column_info", name)

    def declare_column(self, name: str, col: Column) -> int:
        from msrl_core.dock._local import column_tuple

        per_wh = [column_tuple(name, col, int(n)) for n in self._rows_per_warehouse()]
        cid = self._get(
            self.controller.call.remote("declare_column", column_tuple(name, col, 0), per_wh), "controller"
        )
        self.columns = {**self.columns, name: col}
        self._cols_by_id = {**self._cols_by_id, int(cid): col}
        return int(cid)

    def _rows_per_warehouse(self) -> np.ndarray:
        return np.bincount(self.group_warehouse, minlength=self.num_warehouses) * self.group_size

    def put_keys(
        self, p: int, keys: list, inputs: list[tuple], overwrite: bool, tags: list | None, versions: list[int]
    ) -> np.ndarray:
        cids = [cid for cid, _, _ in inputs]
        put_id, rows, _fresh, epoch, rewrites = self._ctl("begin_put_keys", p, keys, cids, overwrite)

        def publish(marks: list) -> None:
            self._ctl("publish_keys", put_id, rows, p, marks, tags, versions)

        self._put_rows(inputs, rows, put_id, epoch, p=p, publish=publish, overwrite=bool(rewrites))
        return rows

    def put_in(
        self,
        p: int,
        inputs: list[tuple],
        rows: np.ndarray,
        epoch: int = -1,
        stage: int = -1,
        claim_id: int = 0,
    ) -> None:
        put_id, put_epoch = self._ctl("check_put_in", p, rows, epoch, stage, claim_id)
        self._put_rows(inputs, rows, put_id, put_epoch, stage, claim_id, p)

    def rows_of(self, p: int, keys: list) -> np.ndarray:
        return self._ctl("rows_of", p, keys)

    def keys_of(self, p: int, rows: np.ndarray) -> list:
        return self._ctl("keys_of", p, rows)

    def list_keys(self, p: int) -> tuple[list, np.ndarray, list]:
        return self._ctl("list_keys", p)

    def written(self, p: int, keys: list, cids: list[int]) -> np.ndarray:
        flat = self._ctl("written", p, keys, cids)
        return np.asarray(flat, dtype=bool).reshape(len(keys), len(cids))

    def tag(self, p: int, keys: list, tags: list) -> None:
        self._ctl("tag", p, keys, tags)

    def _ctl_ray(self, op: str, *args: Any) -> Any:
        self._unpinner.flush()  # views dropped here unpin first
        return self._get(self.controller.call.remote(op, *args), "controller", 2 * self.op_timeout + 5.0)

    def erase_keys(self, p: int, keys: list) -> None:
        self._ctl_ray("erase_keys", p, keys)

    def erase_rows(self, p: int, rows: np.ndarray) -> None:
        self._ctl_ray("erase_rows", p, rows)

    def clear(self, p: int) -> None:
        self._ctl_ray("clear", p)

    def drop_partition(self, p: int) -> None:
        self._forget_partition(p)
        self._ctl_ray("drop_partition", p)

    def _by_warehouse(self, rows: np.ndarray) -> np.ndarray:
        """Rows ordered by warehouse (groups stay whole; stable, so every caller gets the same order)."""
        wh = self.warehouse_of(rows)
        if len(wh) and (np.diff(wh) < 0).any():
            rows = rows[np.argsort(wh, kind="stable")]
        return rows

    def claim_in(self, req: ClaimIn) -> tuple[np.ndarray, int, int]:
        rows, epoch, claim_id = self._ctl("claim_in", *req, wait=req.timeout)
        return self._by_warehouse(rows), int(epoch), int(claim_id)

    def claim_dp(self, req: ClaimDP) -> tuple[np.ndarray, int, int]:
        rows, epoch, claim_id = self._ctl("claim_dp", *req, wait=req.timeout)
        return self._by_warehouse(rows), int(epoch), int(claim_id)

    def release_in(self, p: int, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._ctl("release_in", p, stage, rows, epoch, claim_id)

    def complete_in(self, p: int, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._ctl("complete_in", p, stage, rows, epoch, claim_id)

    def check_claim_epoch(self, p: int, epoch: int) -> None:
        self._ctl("check_claim_epoch", p, epoch)

    def progress_in(self, p: int, stage: int) -> dict:
        return self._get(self.controller.call.remote("progress_in", p, stage), "controller")

    def column_stats(self, cid: int) -> list[dict]:
        return self._get([h.column_stats.remote(cid) for h in self.warehouses], "warehouses")

    def shutdown(self) -> None:
        """Kills the actors of this dock. Later calls of this handle go to the (dead) actor handles and
        raise Unavailable: no same-node connection is opened again to an actor that may not have died yet
        (ray.kill does not wait)."""
        self.fast_path = False
        self._unpin_stop()
        _close_all(self._threads)
        for h in [self.controller, *self.warehouses]:
            with contextlib.suppress(Exception):  # already dead, or Ray shutting down: nothing to kill
                ray.kill(h)


def _end(offsets: np.ndarray, nbytes: np.ndarray) -> int:
    """The arena byte after the last of the rows (0 for none): how much of the arena a copy needs mapped."""
    return int((np.asarray(offsets) + np.asarray(nbytes)).max()) if len(offsets) else 0


def _packed_offsets(col: Column, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(byte offsets, item counts) of the rows of a packed array of one column."""
    offs = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * col.item_bytes, out=offs[1:])
    return offs, lengths


def _copy_out(
    col: Column, n: int, pieces: list[tuple], padded: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Copy of n rows of one column out of byte arenas (the warehouses' shared ones, or a packed array),
    through the native copy engine: pieces are (positions among the n rows, arena, (byte offsets, item
    counts) of those rows). Packed, or (ragged, padded) [n, longest row, ...] with zeros after each row."""
    lengths = np.empty(n, dtype=np.int64)
    for pos, _, (_, lens) in pieces:
        lengths[pos] = lens
    row_bytes = lengths * col.item_bytes
    if padded and col.ragged:
        width = int(lengths.max()) if n else 0
        arr = np.zeros((n, width, *col.shape), dtype=col.storage_dtype)
        dst_offs = np.arange(n, dtype=np.int64) * (width * col.item_bytes)
    else:
        dst_offs = np.zeros(n, dtype=np.int64)
        np.cumsum(row_bytes[:-1], out=dst_offs[1:])
        items = int(lengths.sum()) if col.ragged else n
        arr = np.empty((items, *col.shape), dtype=col.storage_dtype)
    flat = arr.reshape(-1).view(np.uint8)
    for pos, arena, (offs, _) in pieces:
        _core.dock_copy_rows(flat, dst_offs[pos], arena, offs, row_bytes[pos])
    return arr, (lengths if col.ragged else None)


def _close_all(threads: weakref.WeakSet[_ThreadConns]) -> None:
    for t in list(threads):
        t.close()


def _rebuild(
    columns, capacity, group_size, op_timeout, fast_path, balance_by, handles, cols_by_id=None
) -> RayBackend:
    backend = RayBackend(
        columns,
        {},
        capacity,
        group_size,
        None,
        op_timeout=op_timeout,
        fast_path=fast_path,
        balance_by=balance_by,
        _handles=handles,
    )
    if cols_by_id is not None:  # run-time columns keep their native ids
        backend._cols_by_id = dict(cols_by_id)
    return backend
