"""Ray backend: S warehouse actors (bytes) and one controller actor (metadata of every stage).

Data travels through Ray's object store: a put sends each warehouse its slice of the numpy values (one
call per warehouse, in parallel) and a fetch asks every involved warehouse for its rows at once.

The controller actor hosts one native Controller per stage plus the row allocator. Metadata calls from
clients on the controller's node skip Ray's task path: the actor serves a Unix socket, and each client
thread keeps a connection to it (a Ray actor round trip costs a few hundred microseconds here; the
socket round trip tens). Blocking claims wait inside the native controller on a condition variable
with the GIL released; nothing polls. Clients on other nodes use ordinary actor calls.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import sys
import tempfile
import threading
import uuid
import weakref
from typing import Any

import numpy as np

from msrl_core import _core
from msrl_core.dock._local import column_tuples
from msrl_core.dock._types import _STORAGE, Column
from msrl_core.errors import (
    Closed,
    InvalidArgument,
    MsrlError,
    OutOfMemory,
    Timeout,
    Unavailable,
    Unsupported,
)

try:
    import ray
except ImportError:  # pragma: no cover - optional dependency
    ray = None  # type: ignore[assignment]

_HEADER = struct.Struct("!I")
_RPC_MARGIN_S = 30.0  # extra time allowed for an RPC beyond the wait it asks for


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_msg(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, n))


def _error_reply(e: BaseException) -> tuple:
    if isinstance(e, MsrlError):
        return ("err", type(e).__name__, str(e))
    return ("err", "MsrlError", f"{type(e).__name__}: {e}")


def _raise_reply(name: str, message: str) -> None:
    cls = getattr(_core, name, MsrlError)
    raise cls(message)


# ---- actors (plain classes; made remote lazily so importing this module never needs ray) ---------


class ControllerState:
    """Per-stage native controllers and the row allocator; lives in the controller actor."""

    def __init__(
        self,
        stages: list[tuple[str, list[int]]],
        capacity: int,
        group_size: int,
        warehouses: int,
        length_column: int = -1,
    ):
        self.capacity, self.group_size = capacity, group_size
        self.length_column = length_column
        self.controllers = [
            _core.Controller(name, capacity, group_size, cols, length_column) for name, cols in stages
        ]
        groups = capacity // group_size
        self.group_warehouse = np.empty(groups, dtype=np.int32)
        order: list[int] = []
        ranges = [(w * groups // warehouses, (w + 1) * groups // warehouses) for w in range(warehouses)]
        for w, (gb, ge) in enumerate(ranges):
            self.group_warehouse[gb:ge] = w
        nxt = [gb for gb, _ in ranges]
        while len(order) < groups:  # interleave the warehouses
            for w, (_, ge) in enumerate(ranges):
                if nxt[w] < ge:
                    order.append(nxt[w])
                    nxt[w] += 1
        self.free_order = np.array(order, dtype=np.int64)
        self.lock = threading.Lock()
        self.allocated = np.zeros(groups, dtype=bool)
        self.next_free = 0
        self.returned: list[int] = []
        self.in_flight = 0
        self.sock_path = ""
        self.closed = False

    # allocation
    def allocate(self, n: int) -> np.ndarray:
        g = self.group_size
        if n <= 0 or n % g:
            raise InvalidArgument(f"a put of new rows must hold whole groups of {g} rows, got {n} rows")
        want = n // g
        with self.lock:
            free = len(self.returned) + len(self.free_order) - self.next_free
            if want > free:
                raise OutOfMemory(
                    f"put of {n} new rows overflows the dock: {free * g} of {self.capacity} rows free "
                    "(capacity); reset() frees them"
                )
            take: list[int] = []
            while self.returned and len(take) < want:
                take.append(self.returned.pop())
            k = want - len(take)
            take += self.free_order[self.next_free : self.next_free + k].tolist()
            self.next_free += k
            groups = np.array(take, dtype=np.int64)
            self.allocated[groups] = True
        return (groups[:, None] * g + np.arange(g)[None, :]).reshape(-1)

    def free(self, rows: np.ndarray) -> None:
        groups = np.unique(rows // self.group_size)
        with self.lock:
            self.allocated[groups] = False
            self.returned += groups.tolist()

    def check_epoch(self, epoch: int) -> None:
        current = self.controllers[0].epoch
        if epoch >= 0 and epoch != current:
            raise InvalidArgument(
                f"stale claim: its rows are from iteration {epoch} but the dock was reset and is at "
                f"iteration {current}"
            )

    def check_allocated(self, rows: np.ndarray, epoch: int = -1) -> None:
        self.check_epoch(epoch)
        with self.lock:
            ok = self.allocated[rows // self.group_size]
        if not ok.all():
            bad = int(rows[~ok][0])
            raise InvalidArgument(f"row {bad} was never allocated (put new rows without rows= first)")

    def allocated_rows(self) -> int:
        with self.lock:
            return int(self.allocated.sum()) * self.group_size

    def mark_ready(self, columns: list[int], rows: np.ndarray, lengths: np.ndarray | None = None) -> None:
        """lengths: row lengths of the length column, when it is among `columns`."""
        for c in columns:
            lens = lengths if c == self.length_column else None
            for ctl in self.controllers:
                ctl.mark_ready(c, rows, lens)

    def claim(
        self, stage: int, max_rows: int, min_rows: int, timeout: float, max_items: int = 0
    ) -> tuple[np.ndarray, int]:
        return self.controllers[stage].claim(max_rows, min_rows, timeout, max_items)

    def release(self, stage: int, rows: np.ndarray, epoch: int = -1) -> None:
        self.check_epoch(epoch)
        self.controllers[stage].release(rows)

    def progress(self, stage: int) -> dict:
        return self.controllers[stage].progress()

    def reset(self) -> int:
        """Next iteration; blocked claims keep waiting. Returns the new epoch."""
        with self.lock:
            for c in self.controllers:
                c.reset()
            self.allocated[:] = False
            self.next_free = 0
            self.returned = []
        return int(self.controllers[0].epoch)

    def close(self) -> None:
        self.closed = True
        for c in self.controllers:
            c.close()

    def serve(self) -> str:
        """Starts the same-node fast path; returns the socket path."""
        ops: dict[str, Any] = {
            "claim": self.claim,
            "mark_ready": self.mark_ready,
            "allocate": self.allocate,
            "free": self.free,
            "check_allocated": self.check_allocated,
            "release": self.release,
        }
        self.sock_path = serve_unix(ops, "ctl")
        return self.sock_path


def serve_unix(ops: dict[str, Any], tag: str, fd_ops: dict[str, Any] | None = None) -> str:
    """Serves `ops` on a new Unix socket, one thread per connection (blocked in recv, never polling).
    `fd_ops` answer with file descriptors attached (SCM_RIGHTS)."""
    # Linux abstract namespace: no file to leak when the actor is killed; elsewhere a file in tmp.
    name = f"msrl-dock-{tag}-{uuid.uuid4().hex[:12]}"
    path = (
        "\0" + name
        if sys.platform.startswith("linux")
        else os.path.join(tempfile.gettempdir(), name + ".sock")
    )
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(256)
    fd_ops = fd_ops or {}

    def serve_conn(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    op, args = _recv_msg(conn)
                except (ConnectionError, OSError, EOFError):
                    return
                try:
                    if op in fd_ops:
                        payload, fds = fd_ops[op](*args)
                        data = pickle.dumps(("ok", payload))
                        socket.send_fds(conn, [_HEADER.pack(len(data)) + data], fds)
                        continue
                    reply: tuple = ("ok", ops[op](*args))
                except BaseException as e:  # every error goes back to the caller
                    reply = _error_reply(e)
                try:
                    _send_msg(conn, reply)
                except OSError:
                    return

    def accept_loop() -> None:
        while True:
            conn, _ = srv.accept()  # blocks; no polling
            threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    return path


class ControllerActor:
    def __init__(self, *args: Any):
        self.state = ControllerState(*args)
        self.path = self.state.serve()

    def endpoint(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), self.path

    def call(self, op: str, *args: Any) -> Any:
        return getattr(self.state, op)(*args)


def _arena_sizes(columns: list[tuple], num_rows: int) -> list[int]:
    """Bytes of each column arena, as the native Warehouse computes them."""
    sizes = []
    for _name, dtype, ragged, shape, arena_bytes in columns:
        item = _STORAGE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        sizes.append(int(arena_bytes) if ragged else num_rows * item)
    return sizes


class WarehouseActor:
    """Holds a native Warehouse. With shared memory (Linux), its arenas are memfd mappings that
    same-node clients map too: puts copy straight into the arena (reserve -> copy -> commit) and fetches
    copy straight out of it (locate -> copy -> unlease), with no Ray object-store copies."""

    def __init__(self, wid: int, row_begin: int, num_rows: int, columns: list[tuple], shared: bool = True):
        self.epoch = 0
        self.lock = threading.Lock()
        self.pending: dict[int, Any] = {}  # reservation id -> reservations of a client put
        self.leases: dict[int, int] = {}  # lease id -> epoch, fetches copying out of the arenas now
        self.next_id = 0
        self.fds: list[int] = []
        self.maps: list[Any] = []
        external: list[int] = []
        self.shared = shared and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
        if self.shared:
            import mmap

            for c, size in enumerate(_arena_sizes(columns, num_rows)):
                fd = os.memfd_create(f"msrl-dock-w{wid}-c{c}")
                os.ftruncate(fd, max(size, 1))
                mm = mmap.mmap(fd, max(size, 1))  # MAP_SHARED; pages are touched only when written
                self.fds.append(fd)
                self.maps.append(mm)
                external.append(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
        self.wh = _core.Warehouse(wid, row_begin, num_rows, columns, external)
        self.path = ""
        if self.shared:
            ops = {
                "reserve": self.reserve,
                "commit": self.commit,
                "abort": self.abort,
                "locate": self.locate,
                "unlease": self.unlease,
            }
            self.path = serve_unix(ops, f"wh{wid}", {"arena_fds": self.arena_fds})

    def endpoint(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), self.path

    def _check_epoch(self, epoch: int) -> None:
        if epoch >= 0 and epoch != self.epoch:
            raise InvalidArgument(
                f"stale claim: its rows are from iteration {epoch} but the dock was reset and is at "
                f"iteration {self.epoch}"
            )

    # -- same-node data path (served on the Unix socket) --

    def arena_fds(self) -> tuple[list[int], list[int]]:
        return [len(m) for m in self.maps], list(self.fds)

    def reserve(self, cols: list[tuple], rows: np.ndarray, epoch: int) -> tuple[int, list[tuple]]:
        with self.lock:
            self._check_epoch(epoch)
            res = self.wh.reserve(cols, rows)
            self.next_id += 1
            self.pending[self.next_id] = res
            return self.next_id, [(r.dst_offsets, r.nbytes) for r in res]

    def commit(self, rid: int) -> None:
        with self.lock:
            res = self.pending.pop(rid, None)
            if res is None:
                raise InvalidArgument(
                    f"put reservation {rid} was aborted by reset(force=True); nothing was stored"
                )
            self.wh.commit(res)

    def abort(self, rid: int) -> None:
        with self.lock:
            res = self.pending.pop(rid, None)
            if res is not None:
                self.wh.abort(res)

    def locate(self, cids: list[int], rows: np.ndarray, epoch: int) -> tuple[int, list[tuple]]:
        with self.lock:
            self._check_epoch(epoch)
            out = [self.wh.locate(c, rows) for c in cids]
            self.next_id += 1
            self.leases[self.next_id] = self.epoch
            return self.next_id, out

    def unlease(self, lid: int) -> None:
        with self.lock:
            self.leases.pop(lid, None)

    # -- Ray path (other nodes, or no shared memory) --

    def put(self, inputs: list[tuple], rows: np.ndarray, epoch: int = -1) -> int:
        self._check_epoch(epoch)
        self.wh.put(inputs, rows)
        return len(rows)

    def erase(self, columns: list[int], rows: np.ndarray) -> None:
        self.wh.erase(columns, rows)

    def fetch(self, specs: list[tuple], rows: np.ndarray, epoch: int = -1) -> list[tuple]:
        """Packed copies of the rows for each (column id, storage dtype, inner shape, ragged)."""
        self._check_epoch(epoch)
        out: list[tuple] = []
        for cid, storage, inner, ragged in specs:
            dtype = np.dtype(storage)
            if not ragged:
                arr = np.empty((len(rows), *inner), dtype=dtype)
                self.wh.gather(cid, rows, arr)
                out.append((arr, None))
                continue
            lengths = self.wh.lengths(cid, rows)
            arr = np.empty((int(lengths.sum()), *inner), dtype=dtype)
            self.wh.gather(cid, rows, arr)
            out.append((arr, lengths))
        return out

    def lengths(self, cid: int, rows: np.ndarray) -> np.ndarray:
        return self.wh.lengths(cid, rows)

    def bytes_held(self) -> int:
        return self.wh.bytes_held()

    def check_idle(self) -> None:
        with self.lock:
            self._check_idle()

    def reset(self, epoch: int, force: bool = False) -> None:
        with self.lock:
            if force:  # puts and fetches of clients that died (or are still running) are abandoned
                for res in self.pending.values():
                    self.wh.abort(res)
                self.pending.clear()
                self.leases.clear()
            self._check_idle()
            self.wh.reset()
            self.epoch = epoch

    def _check_idle(self) -> None:
        if self.leases or self.pending:
            raise InvalidArgument(
                f"reset() while {len(self.leases)} fetch(es) and {len(self.pending)} put(s) are in "
                "flight; nothing was reset"
            )


# ---- client ---------------------------------------------------------------------------------


class RayBackend:
    name = "ray"

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
        self._col_list = list(columns.values())
        self._local = threading.local()
        self._socks: list[socket.socket] = []  # every thread's connection, closed with the client
        self._finalizer = weakref.finalize(self, _close_all, self._socks)
        self._node: str | None = None
        self._arena_maps: dict[int, list[np.ndarray]] = {}
        self._arena_lock = threading.Lock()
        self.balance_by = balance_by
        self.length_column = list(columns).index(balance_by) if balance_by else -1
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
        names = list(columns)
        stage_cols = [(st, [names.index(c) for c in cols]) for st, cols in stages.items()]
        ctl_cls = ray.remote(ControllerActor)
        self.controller = ctl_cls.options(num_cpus=actor_cpus, max_concurrency=64).remote(
            stage_cols, capacity, group_size, s, self.length_column
        )
        wh_cls = ray.remote(WarehouseActor)
        self.warehouses = []
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for w in range(s):
            gb, ge = w * groups // s, (w + 1) * groups // s
            rows = (ge - gb) * group_size
            node = nodes[w % len(nodes)]["NodeID"] if nodes else None
            opts: dict[str, Any] = {"num_cpus": actor_cpus, "max_concurrency": 8}
            if node is not None:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            self.warehouses.append(
                wh_cls.options(**opts).remote(w, gb * group_size, rows, column_tuples(columns, rows))
            )
        self.endpoint = self._get(self.controller.endpoint.remote(), "controller")
        self.wh_endpoints = [
            self._get(h.endpoint.remote(), f"warehouse {w}") for w, h in enumerate(self.warehouses)
        ]
        gw = np.empty(groups, dtype=np.int32)
        for w in range(s):
            gw[w * groups // s : (w + 1) * groups // s] = w
        self.group_warehouse = gw

    def __reduce__(self):
        # Handles are serializable: another process (a Ray task or actor) gets a client to the same dock.
        handles = (self.controller, self.warehouses, self.endpoint, self.wh_endpoints, self.group_warehouse)
        cols = self.columns
        return (
            _rebuild,
            (cols, self.capacity, self.group_size, self.op_timeout, self.fast_path, self.balance_by, handles),
        )

    # -- plumbing --

    def _get(self, refs: Any, what: str, timeout: float | None = None) -> Any:
        try:
            return ray.get(refs, timeout=timeout if timeout is not None else self.op_timeout)
        except ray.exceptions.GetTimeoutError:
            raise Timeout(f"{what} did not answer within {timeout or self.op_timeout} s") from None
        except ray.exceptions.RayActorError as e:
            raise Unavailable(f"{what} actor died: {e}") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
            if isinstance(cause, MsrlError):
                raise cause from None
            raise

    def _node_id(self) -> str:
        if self._node is None:
            self._node = ray.get_runtime_context().get_node_id()
        return self._node

    def _conn(self, key: str, endpoint: tuple[str, str]) -> socket.socket | None:
        """This thread's connection to a same-node actor's socket, or None (use Ray calls)."""
        if not self.fast_path or not endpoint[1]:
            return None
        conns = self._local.__dict__.setdefault("conns", {})
        s = conns.get(key)
        if s is None:
            node, path = endpoint
            if node != self._node_id():
                return None
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
            except OSError as e:
                s.close()
                raise Unavailable(f"{key} endpoint {path} unreachable (actor died?): {e}") from None
            conns[key] = s
            self._socks.append(s)
        return s

    def _drop_conn(self, key: str, sock: socket.socket) -> None:
        self._local.__dict__.get("conns", {}).pop(key, None)
        if sock in self._socks:
            self._socks.remove(sock)
        sock.close()

    def _rpc(
        self, sock: socket.socket, key: str, op: str, args: tuple, wait: float, fds: bool = False
    ) -> Any:
        try:
            sock.settimeout(wait + _RPC_MARGIN_S)
            _send_msg(sock, (op, args))
            if fds:
                data, got_fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
                (n,) = _HEADER.unpack(data[: _HEADER.size])
                reply = pickle.loads(data[_HEADER.size : _HEADER.size + n])
                reply = (reply[0], (reply[1], got_fds)) if reply[0] == "ok" else reply
            else:
                reply = _recv_msg(sock)
        except TimeoutError:
            self._drop_conn(key, sock)
            raise Timeout(f"{key} did not answer {op} within {wait + _RPC_MARGIN_S} s") from None
        except (ConnectionError, OSError, EOFError) as e:
            self._drop_conn(key, sock)
            raise Unavailable(f"{key} connection lost during {op} (actor died?): {e}") from None
        if reply[0] == "ok":
            return reply[1]
        _raise_reply(reply[1], reply[2])

    def _ctl(self, op: str, *args: Any, wait: float = 0.0) -> Any:
        sock = self._conn("controller", self.endpoint)
        if sock is None:
            return self._get(self.controller.call.remote(op, *args), "controller", wait + _RPC_MARGIN_S)
        return self._rpc(sock, "controller", op, args, wait)

    def _wh(self, w: int, op: str, *args: Any) -> Any:
        key = f"warehouse {w}"
        sock = self._conn(key, self.wh_endpoints[w])
        if sock is None:
            raise Unavailable(f"{key}: no same-node connection")
        return self._rpc(sock, key, op, args, 0.0)

    def _shared(self) -> bool:
        """True when every warehouse shares its arenas with this process (same node, Linux)."""
        if not self.fast_path:
            return False
        node = self._node_id()
        return all(path and n == node for n, path in self.wh_endpoints)

    def _arenas(self, w: int) -> list[np.ndarray]:
        maps = self._arena_maps.get(w)
        if maps is None:
            import mmap

            with self._arena_lock:
                maps = self._arena_maps.get(w)
                if maps is None:
                    key = f"warehouse {w}"
                    sock = self._conn(key, self.wh_endpoints[w])
                    assert sock is not None
                    sizes, fds = self._rpc(sock, key, "arena_fds", (), 0.0, fds=True)
                    maps = []
                    for size, fd in zip(sizes, fds):
                        mm = mmap.mmap(fd, size)
                        os.close(fd)
                        maps.append(np.frombuffer(mm, dtype=np.uint8))
                    self._arena_maps[w] = maps
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

    def _put_shared(self, inputs: list[tuple], rows: np.ndarray, epoch: int) -> None:
        """Same-node put: reserve in every warehouse, copy into the shared arenas, commit, publish."""
        parts = self._split(rows)
        # Source byte offsets of every row, per column.
        src = []
        for cid, vals, lengths in inputs:
            col = self._col_list[cid]
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
                arenas = self._arenas(w)
                for (cid, _, _), (flat, offs), (dst_offs, nbytes) in zip(inputs, src, dst):
                    _core.dock_copy_rows(arenas[cid], dst_offs, flat, offs[pos], nbytes)
        except BaseException:
            for w, rid in reserved:
                with contextlib.suppress(MsrlError):
                    self._wh(w, "abort", rid)
            raise
        for w, rid in reserved:
            self._wh(w, "commit", rid)
        self._ctl("mark_ready", [cid for cid, _, _ in inputs], rows, _lengths_of(inputs, self.length_column))

    def _fetch_shared(self, cols: list[tuple[int, Column]], rows: np.ndarray, epoch: int) -> list[tuple]:
        """Same-node fetch: locate rows in every warehouse, copy out of the shared arenas in caller order."""
        parts = self._split(rows)
        cids = [cid for cid, _ in cols]
        leases: list[tuple[int, int]] = []
        try:
            located = []
            for w, pos in parts:
                lid, locs = self._wh(w, "locate", cids, rows[pos], epoch)
                leases.append((w, lid))
                located.append(locs)
            out = []
            for k, (cid, col) in enumerate(cols):
                lengths = np.empty(len(rows), dtype=np.int64)
                for (_, pos), locs in zip(parts, located):
                    lengths[pos] = locs[k][1]
                item = col.item_bytes
                row_bytes = lengths * item
                dst_offs = np.zeros(len(rows), dtype=np.int64)
                np.cumsum(row_bytes[:-1], out=dst_offs[1:])
                total = int(lengths.sum())
                if col.ragged:
                    arr = np.empty((total, *col.shape), dtype=col.storage_dtype)
                else:
                    arr = np.empty((len(rows), *col.shape), dtype=col.storage_dtype)
                flat = arr.reshape(-1).view(np.uint8)
                for (w, pos), locs in zip(parts, located):
                    _core.dock_copy_rows(
                        flat, dst_offs[pos], self._arenas(w)[cid], locs[k][0], row_bytes[pos]
                    )
                out.append((arr, lengths if col.ragged else None))
            return out
        finally:
            for w, lid in leases:
                with contextlib.suppress(MsrlError):
                    self._wh(w, "unlease", lid)

    def _put_rows(self, inputs: list[tuple], rows: np.ndarray, epoch: int = -1) -> None:
        if self._shared():
            self._put_shared(inputs, rows, epoch)
            return
        parts = self._split(rows)
        refs, used = [], []
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
            refs.append(self.warehouses[w].put.remote(sub, rows[pos], epoch))
            used.append((w, pos))
        errors: list[BaseException] = []
        ok: list[tuple[int, np.ndarray]] = []
        for (w, pos), ref in zip(used, refs):
            try:
                self._get(ref, f"warehouse {w}")
                ok.append((w, pos))
            except BaseException as e:
                errors.append(e)
        if errors:  # all-or-nothing: undo the warehouses that stored their part
            cids = [cid for cid, _, _ in inputs]
            for w, pos in ok:
                self._get(self.warehouses[w].erase.remote(cids, rows[pos]), f"warehouse {w}")
            raise errors[0]
        self._ctl("mark_ready", [cid for cid, _, _ in inputs], rows, _lengths_of(inputs, self.length_column))

    def put_new(self, inputs: list[tuple], n: int) -> np.ndarray:
        rows = self._ctl("allocate", n)
        try:
            self._put_rows(inputs, rows)
        except BaseException:
            self._ctl("free", rows)
            raise
        return rows

    def put(self, inputs: list[tuple], rows: np.ndarray, epoch: int = -1, stage: int = -1) -> None:
        # stage (claim completion) only matters for a partial reset, which this backend refuses.
        self._ctl("check_allocated", rows, epoch)
        self._put_rows(inputs, rows, epoch)

    def claim(
        self, stage: int, max_rows: int, min_rows: int, timeout: float, max_items: int = 0
    ) -> tuple[np.ndarray, int]:
        rows, epoch = self._ctl("claim", stage, max_rows, min_rows, timeout, max_items, wait=timeout)
        # Order by warehouse (groups stay whole) so a fetch concatenates warehouse answers directly.
        wh = self.warehouse_of(rows)
        if len(wh) and (np.diff(wh) < 0).any():
            rows = rows[np.argsort(wh, kind="stable")]
        return rows, int(epoch)

    def release(self, stage: int, rows: np.ndarray, epoch: int = -1) -> None:
        self._ctl("release", stage, rows, epoch)

    def fetch_many(
        self, cols: list[tuple[int, Column]], rows: np.ndarray, layout: str, epoch: int = -1
    ) -> list[tuple]:
        """One request per involved warehouse for all columns; answers are concatenated in row order."""
        if self._shared():
            shared = self._fetch_shared(cols, rows, epoch)
            return [self._pad(arr, lengths, col, layout) for (arr, lengths), (_, col) in zip(shared, cols)]
        parts = self._split(rows)
        specs = [(cid, col.storage_dtype.str, col.shape, col.ragged) for cid, col in cols]
        refs = [self.warehouses[w].fetch.remote(specs, rows[pos], epoch) for w, pos in parts]
        got = [self._get(r, f"warehouse {w}") for (w, _), r in zip(parts, refs)]
        order = np.concatenate([pos for _, pos in parts]) if parts else np.empty(0, np.int64)
        inv = None
        if (np.diff(order) < 0).any():  # rows were not grouped by warehouse: restore the caller's order
            inv = np.empty_like(order)
            inv[order] = np.arange(len(order))
        results: list[tuple] = []
        for k, (_, col) in enumerate(cols):
            pieces = [g[k] for g in got]
            lengths: Any
            if not pieces:
                arr = np.empty((0, *col.shape), dtype=col.storage_dtype)
                lengths = np.empty(0, np.int64) if col.ragged else None
            elif len(pieces) == 1:
                arr, lengths = pieces[0]
            else:
                arr = np.concatenate([a for a, _ in pieces])
                lengths = np.concatenate([x for _, x in pieces]) if col.ragged else None
            if inv is not None:
                if col.ragged:
                    offs = np.zeros(len(lengths) + 1, dtype=np.int64)
                    np.cumsum(lengths, out=offs[1:])
                    arr = np.concatenate([arr[offs[i] : offs[i + 1]] for i in inv])
                    lengths = lengths[inv]
                else:
                    arr = arr[inv]
            results.append(self._pad(arr, lengths, col, layout))
        return results

    @staticmethod
    def _pad(arr: np.ndarray, lengths: Any, col: Column, layout: str) -> tuple:
        if col.ragged and layout == "padded":
            width = int(lengths.max()) if len(lengths) else 0
            mask = np.arange(width)[None, :] < lengths[:, None]
            padded = np.zeros((len(lengths), width, *col.shape), dtype=col.storage_dtype)
            padded[mask] = arr
            arr = padded
        return arr, lengths

    def progress(self, stage: int) -> dict:
        return self._get(self.controller.call.remote("progress", stage), "controller")

    def warehouse_bytes(self) -> list[int]:
        return self._get([h.bytes_held.remote() for h in self.warehouses], "warehouses")

    def op_stats(self) -> dict:
        return {}  # native counters live in the actors; stats() reports this client's latencies

    def allocated_rows(self) -> int:
        return self._get(self.controller.call.remote("allocated_rows"), "controller")

    def complete(self, stage: int, rows: np.ndarray, epoch: int = -1) -> None:
        raise Unsupported(
            "complete(): claim completion is tracked for reset(keep_unfinished=True), which "
            "the ray backend does not support yet; use backend='local'"
        )

    def reset(self, force: bool = False, keep_unfinished: bool = False) -> None:
        if keep_unfinished:
            raise Unsupported(
                "reset(keep_unfinished=True) (partial rollout) is not supported by the ray "
                "backend yet; use backend='local'. Nothing was reset"
            )
        # Refuse before touching anything while a same-node put or fetch is in flight (a put or fetch
        # starting between this check and the warehouse resets can still make one of them refuse).
        if not force:
            self._get([h.check_idle.remote() for h in self.warehouses], "warehouses")
        epoch = self._get(self.controller.call.remote("reset"), "controller")
        self._get([h.reset.remote(epoch, force) for h in self.warehouses], "warehouses")

    def close(self) -> None:
        with contextlib.suppress(Unavailable, Timeout, Closed):
            self._get(self.controller.call.remote("close"), "controller")

    def shutdown(self) -> None:
        """Kills the actors of this dock."""
        _close_all(self._socks)
        for h in [self.controller, *self.warehouses]:
            ray.kill(h)


def _lengths_of(inputs: list[tuple], column: int) -> np.ndarray | None:
    for cid, _, lengths in inputs:
        if cid == column:
            return lengths
    return None


def _close_all(socks: list[socket.socket]) -> None:
    while socks:
        socks.pop().close()


def _rebuild(columns, capacity, group_size, op_timeout, fast_path, balance_by, handles) -> RayBackend:
    return RayBackend(
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
