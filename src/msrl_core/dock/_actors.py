"""The Ray backend's actors: S warehouse actors (bytes) and one controller actor (metadata).

Plain classes, made remote lazily by the client, so importing this module never needs ray. Both serve
the same-node fast path on a :class:`msrl_core.dock._wire.Server` (same uid only, no pickle).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from msrl_core import _core
from msrl_core.dock._types import _STORAGE
from msrl_core.dock._wire import Server
from msrl_core.errors import InvalidArgument, MsrlError, OutOfMemory, Timeout, Unavailable

try:
    import ray
except ImportError:  # pragma: no cover - optional dependency
    ray = None  # type: ignore[assignment]


# A put that starts while a reset() is in flight waits this long for it to end (a reset takes ms).
RESET_WAIT_S = 30.0


def ray_get(refs: Any, what: str, timeout: float) -> Any:
    """ray.get with the dock's errors: Timeout, Unavailable (dead actor), the actor's own MsrlError."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise Timeout(f"{what} did not answer within {timeout} s") from None
    except ray.exceptions.RayActorError as e:
        raise Unavailable(f"{what} actor died: {e}") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
        if isinstance(cause, MsrlError):
            raise cause from None
        raise MsrlError(f"{what} failed: {type(cause or e).__name__}: {cause or e}") from None


def wire_options() -> dict[str, Any]:
    """Server limits, overridable through the environment (tests shorten the idle timeout)."""
    opts: dict[str, Any] = {}
    if "MSRL_DOCK_IDLE_TIMEOUT" in os.environ:
        opts["idle_timeout"] = float(os.environ["MSRL_DOCK_IDLE_TIMEOUT"])
    if "MSRL_DOCK_MAX_CONNS" in os.environ:
        opts["max_conns"] = int(os.environ["MSRL_DOCK_MAX_CONNS"])
    return opts


def _pss_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def process_diagnostics(server: Server | None) -> dict[str, Any]:
    """Threads, open fds, PSS of this actor process and its wire server's counters (soak checks)."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
        threads = len(os.listdir("/proc/self/task"))  # OS threads (Ray's pool threads included)
    except OSError:
        fds, threads = -1, threading.active_count()
    return {
        "pid": os.getpid(),
        "threads": threads,
        "fds": fds,
        "pss_bytes": _pss_bytes(),
        "wire": server.stats() if server is not None else {},
    }


class ControllerState:
    """Per-stage native controllers and the row allocator; lives in the controller actor.

    It also serialises reset() against puts: every put is registered from its allocate/check_put to its
    mark_ready (or free/end_put), reset() refuses while one is registered and holds new ones back while
    it resets the warehouses and the controllers, so a row is either wholly before or wholly after it."""

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
        self.order = np.array(order, dtype=np.int64)  # every group, interleaved over the warehouses
        self.free_order = self.order  # less the groups a partial reset kept
        self.lock = threading.Lock()
        self.allocated = np.zeros(groups, dtype=bool)
        self.next_free = 0
        self.returned: list[int] = []
        self.in_flight = 0
        self.sock_path = ""
        self.closed = False
        # Dock-wide operation counters (every client's), as DockCore's op_stats: count and rows.
        self.ops = {op: {"count": 0, "rows": 0} for op in ("put", "claim")}
        self.gate = threading.Condition()  # guards puts, next_put, resetting
        self.puts: set[int] = set()  # ids of the puts in flight
        self.next_put = 0
        self.resetting = False

    # puts in flight
    def _begin_put(self) -> int:
        with self.gate:
            deadline = time.monotonic() + RESET_WAIT_S
            while self.resetting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"put waited {RESET_WAIT_S:g} s for a reset() in flight; nothing stored")
                self.gate.wait(left)
            self.next_put += 1
            self.puts.add(self.next_put)
            return self.next_put

    def _check_put_id(self, put_id: int) -> None:
        with self.gate:
            if put_id not in self.puts:
                raise InvalidArgument(
                    "this put was abandoned by reset(force=True) before it was published; nothing was "
                    "published (put again)"
                )

    def end_put(self, put_id: int) -> None:
        with self.gate:
            self.puts.discard(put_id)

    # allocation
    def allocate(self, n: int) -> tuple[np.ndarray, int]:
        """Rows for a put of n new rows and the put's id (pass it to mark_ready, or free on failure)."""
        g = self.group_size
        if n <= 0 or n % g:
            raise InvalidArgument(f"a put of new rows must hold whole groups of {g} rows, got {n} rows")
        put_id = self._begin_put()
        try:
            return self._allocate(n // g), put_id
        except BaseException:
            self.end_put(put_id)
            raise

    def _allocate(self, want: int) -> np.ndarray:
        g, n = self.group_size, want * self.group_size
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

    def free(self, rows: np.ndarray, put_id: int = 0) -> None:
        """Gives back the rows of a failed put of new rows (unless a forced reset freed them already)."""
        with self.gate:
            live = put_id in self.puts
            self.puts.discard(put_id)
        if not live:
            return
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

    def check_put(self, rows: np.ndarray, epoch: int = -1, stage: int = -1, claim_id: int = 0) -> int:
        """Before a put into rows: current iteration, allocated, and still held by the claim if any.
        Returns the put's id (pass it to mark_ready, or end_put on failure)."""
        put_id = self._begin_put()
        try:
            self.check_allocated(rows, epoch)
            if stage >= 0 and claim_id:
                self.controllers[stage].check_held(rows, claim_id)
        except BaseException:
            self.end_put(put_id)
            raise
        return put_id

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

    def mark_ready(
        self,
        columns: list[int],
        rows: np.ndarray,
        lengths: np.ndarray | None = None,
        stage: int = -1,
        claim_id: int = 0,
        put_id: int = 0,
    ) -> None:
        """Publishes a put: lengths are the row lengths of the length column, when it is among
        `columns`; then completes the putting claim (stage, claim_id) or, for plain row ids, the claims
        of the stages that wrote the columns (Controller.complete_by_put: the one rule)."""
        self._check_put_id(put_id)  # registered: no reset can start before end_put below
        try:
            self._publish(columns, rows, lengths, stage, claim_id)
        finally:
            self.end_put(put_id)

    def _publish(
        self, columns: list[int], rows: np.ndarray, lengths: np.ndarray | None, stage: int, claim_id: int
    ) -> None:
        for c in columns:
            lens = lengths if c == self.length_column else None
            for ctl in self.controllers:
                ctl.mark_ready(c, rows, lens)
        self._count("put", len(rows))
        if stage >= 0:
            self.controllers[stage].complete(rows, claim_id)
            return
        for ctl in self.controllers:
            ctl.complete_by_put(list(columns), rows)

    def claim(
        self, stage: int, max_rows: int, min_rows: int, timeout: float, max_items: int = 0
    ) -> tuple[np.ndarray, int, int]:
        got = self.controllers[stage].claim(max_rows, min_rows, timeout, max_items)
        self._count("claim", len(got[0]))
        return got

    def _count(self, op: str, rows: int) -> None:
        with self.lock:
            self.ops[op]["count"] += 1
            self.ops[op]["rows"] += rows

    def op_stats(self) -> dict:
        with self.lock:
            return {op: dict(c) for op, c in self.ops.items()}

    def release(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self.check_epoch(epoch)
        self.controllers[stage].release(rows, claim_id)

    def complete(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self.check_epoch(epoch)
        self.controllers[stage].complete(rows, claim_id)

    def progress(self, stage: int) -> dict:
        return self.controllers[stage].progress()

    def reset(
        self,
        keep_unfinished: bool = False,
        force: bool = False,
        warehouses: list[Any] | None = None,
        op_timeout: float = 60.0,
    ) -> np.ndarray:
        """The dock's reset, atomic against puts: refuses (nothing changed) while a put is in flight
        (force: abandons them) or another reset runs; holds new puts back while it prepares every
        warehouse (each refuses while fetches, puts or views are in flight there, and then refuses new
        ones: all or none), resets the controllers and then the warehouses (the client's handles; each
        answer within op_timeout). Returns the kept rows."""
        handles = list(warehouses or [])
        with self.gate:
            if self.resetting:
                raise InvalidArgument("reset() while another reset is in flight; nothing was reset")
            if self.puts and not force:
                n = len(self.puts)
                raise InvalidArgument(f"reset() while {n} put(s) are in flight; nothing was reset")
            self.resetting = True
            self.puts.clear()  # (force) abandoned: their mark_ready refuses, their free does nothing
        try:
            refs = [h.prepare_reset.remote(force) for h in handles]
            failed: BaseException | None = None
            for w, ref in enumerate(refs):  # every answer: all warehouses prepared, or none stays so
                try:
                    ray_get(ref, f"warehouse {w}", op_timeout)
                except BaseException as e:  # noqa: BLE001 - the first is raised below
                    failed = failed or e
            if failed is not None:
                for w, h in enumerate(handles):  # before answering: no put or fetch sees a freeze
                    with contextlib.suppress(MsrlError):
                        ray_get(h.cancel_reset.remote(), f"warehouse {w}", op_timeout)
                raise failed
            epoch, kept = self._reset_controllers(keep_unfinished)
            wh = self.group_warehouse[kept // self.group_size]
            refs = [h.reset.remote(epoch, kept[wh == w]) for w, h in enumerate(handles)]
            ray_get(refs, "warehouses", op_timeout)
            return kept
        finally:
            with self.gate:
                self.resetting = False
                self.gate.notify_all()

    def _reset_controllers(self, keep_unfinished: bool) -> tuple[int, np.ndarray]:
        """Next iteration; blocked claims keep waiting. Returns the new epoch and the kept rows.
        keep_unfinished: groups not *finished* (completed by every stage: Controller.group_completed,
        the rule DockCore applies too) keep their readiness and completed claims; new puts skip them."""
        g = self.group_size
        with self.lock:
            keep = np.zeros(len(self.allocated), dtype=np.uint8)
            if keep_unfinished:
                for grp in np.flatnonzero(self.allocated).tolist():
                    keep[grp] = not all(c.group_completed(grp) for c in self.controllers)
            for c in self.controllers:
                c.reset(keep if keep.any() else None)
            self.allocated[:] = keep.astype(bool)
            self.free_order = self.order[keep[self.order] == 0]
            self.next_free = 0
            self.returned = []
        kept = np.flatnonzero(keep)
        rows = (kept[:, None] * g + np.arange(g)[None, :]).reshape(-1).astype(np.int64)
        return int(self.controllers[0].epoch), rows

    def close(self) -> None:
        self.closed = True
        for c in self.controllers:
            c.close()

    def serve(self) -> Server:
        """Starts the same-node fast path."""
        ops: dict[str, Any] = {
            "claim": self.claim,
            "mark_ready": self.mark_ready,
            "allocate": self.allocate,
            "free": self.free,
            "check_allocated": self.check_allocated,
            "check_put": self.check_put,
            "end_put": self.end_put,
            "complete": self.complete,
            "release": self.release,
        }
        return Server(ops, "ctl", **wire_options())


class ControllerActor:
    def __init__(self, *args: Any):
        self.state = ControllerState(*args)
        self.server = self.state.serve()

    def endpoint(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), self.server.path

    def diagnostics(self) -> dict[str, Any]:
        return process_diagnostics(self.server)

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
        self.wid = wid
        self.epoch = 0
        self.lock = threading.Lock()
        self.pending: dict[int, Any] = {}  # reservation id -> reservations of a client put
        self.leases: dict[int, int] = {}  # lease id -> epoch, fetches copying out of the arenas now
        self.pins: set[int] = set()  # lease ids of fetches whose zero-copy views are alive in a client
        self.frozen = False  # between prepare_reset and reset: new puts and fetches are refused
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
        self.server: Server | None = None
        if self.shared:
            ops: dict[str, Any] = {
                "reserve": self.reserve,
                "commit": self.commit,
                "abort": self.abort,
                "locate": self.locate,
                "unlease": self.unlease,
            }
            self.server = Server(ops, f"wh{wid}", {"arena_fds": self.arena_fds}, **wire_options())

    def endpoint(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), self.server.path if self.server else ""

    def diagnostics(self) -> dict[str, Any]:
        return process_diagnostics(self.server)

    def _check_epoch(self, epoch: int) -> None:
        if self.frozen:
            raise InvalidArgument(
                f"warehouse {self.wid}: the dock is being reset; nothing was read or stored (retry after it)"
            )
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

    def locate(
        self, cids: list[int], rows: np.ndarray, epoch: int, pin: bool = False
    ) -> tuple[int, list[tuple]]:
        """Byte offsets and item counts of the rows in each column's arena, under a lease that keeps
        reset() out until unlease(lid). pin: the client keeps zero-copy views of these bytes (the lease
        lives as long as they do; reset() names them)."""
        with self.lock:
            self._check_epoch(epoch)
            out = [self.wh.locate(c, rows) for c in cids]
            self.next_id += 1
            if pin:
                self.pins.add(self.next_id)
            else:
                self.leases[self.next_id] = self.epoch
            return self.next_id, out

    def unlease(self, lid: int) -> None:
        with self.lock:
            self.leases.pop(lid, None)
            self.pins.discard(lid)

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

    # -- reset, in two phases driven by the controller (ControllerState.reset) --

    def prepare_reset(self, force: bool = False) -> None:
        """Refuses while puts, fetches or zero-copy views are in flight here (force: abandons them);
        then refuses new ones until reset() or cancel_reset()."""
        with self.lock:
            if force:  # puts and fetches of clients that died (or are still running) are abandoned
                for res in self.pending.values():
                    self.wh.abort(res)
                self.pending.clear()
                self.leases.clear()
                self.pins.clear()  # views of a reader that died; live ones would see the next iteration
            self._check_idle()
            self.frozen = True

    def cancel_reset(self) -> None:
        with self.lock:
            self.frozen = False

    def reset(self, epoch: int, keep_rows: np.ndarray | None = None) -> None:
        """keep_rows (partial reset): rows of this warehouse that stay, their bytes compacted."""
        with self.lock:
            self.wh.reset(None if keep_rows is None or not len(keep_rows) else keep_rows)
            self.epoch = epoch
            self.frozen = False

    def _check_idle(self) -> None:
        if self.pins:
            raise InvalidArgument(
                f"reset() while zero-copy fetch views of {len(self.pins)} fetch(es) are alive (arrays "
                "from fetch(copy=False) or take(copy=False)); drop them first; nothing was reset"
            )
        if self.leases or self.pending:
            raise InvalidArgument(
                f"reset() while {len(self.leases)} fetch(es) and {len(self.pending)} put(s) are in "
                "flight; nothing was reset"
            )
