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
from msrl_core.dock._backend import ClaimDP, ClaimIn
from msrl_core.dock._types import _STORAGE
from msrl_core.dock._wire import Server
from msrl_core.errors import InvalidArgument, MsrlError, OutOfMemory, Timeout, Unavailable

try:
    import ray
except ImportError:  # pragma: no cover - optional dependency
    ray = None  # type: ignore[assignment]


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
    """The dock's control plane in the controller actor: a metadata-only native DockCore — the same row
    allocator, per-stage controllers, epochs, claim completion, ledger of puts in flight and reset as the
    local backend's — plus the two-phase reset of the warehouse actors around it.

    A client's put runs the DockCore put protocol: ``allocate`` / ``check_put`` (begin: registered in
    flight, a reset refuses or, forced, abandons it), then the client stores the bytes in the warehouses,
    then ``mark_ready`` (publish: readiness, completion, end) or ``end_put`` (abort: rows allocated for
    the put go back)."""

    def __init__(
        self,
        columns: list[tuple],
        stages: list[tuple[str, list[str], str]],
        capacity: int,
        group_size: int,
        warehouses: int,
    ):
        self.core = _core.DockCore(columns, stages, capacity, group_size, warehouses, store_bytes=False)
        self.capacity, self.group_size = capacity, group_size
        self.warehouses: list[Any] = []  # the warehouse actors' handles (attach_warehouses), for reset
        self.decl_lock = threading.Lock()  # a run-time column is visible once every warehouse has it
        self.op_timeout = 60.0

    def attach_warehouses(self, handles: list[Any]) -> None:
        """The warehouse actors, given once: passing actor handles with every reset() grows Ray's
        bookkeeping in this process (~0.5 KiB a call, measured by the soak)."""
        self.warehouses = list(handles)

    def layout(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(warehouse of every group, (first row, rows) of every warehouse): where the client routes rows
        and what each warehouse actor holds, from the one allocator."""
        first_rows = np.arange(0, self.capacity, self.group_size, dtype=np.int64)
        ranges = [self.core.warehouse_rows(w) for w in range(self.core.num_warehouses)]
        return self.core.warehouse_of(first_rows), ranges

    # the put protocol (DockCore: begin -> the client stores the bytes -> publish, or abort)
    def allocate(self, n: int) -> tuple[np.ndarray, int, int]:
        """Rows for a put of n new rows, the put's id (pass it to mark_ready, or end_put on failure) and
        its iteration (the warehouses refuse its bytes once reset)."""
        return self.core.begin_put_new(n)

    def check_put(
        self, rows: np.ndarray, epoch: int = -1, stage: int = -1, claim_id: int = 0
    ) -> tuple[int, int]:
        """Before a put into rows: current iteration, allocated, still held by the claim if any. Returns
        the put's id (pass it to mark_ready, or end_put on failure) and its iteration."""
        return self.core.begin_put(rows, epoch, stage, claim_id)

    def mark_ready(
        self,
        columns: list[tuple],
        rows: np.ndarray,
        stage: int = -1,
        claim_id: int = 0,
        put_id: int = 0,
        p: int = 0,
    ) -> None:
        """Publishes a put: columns are (column id, lengths or None) (lengths where a stage balances by
        the column); completes the putting claim (stage, claim_id) or, for plain row ids, the claims of
        the stages that wrote the columns; ends the put."""
        self.core.publish(put_id, columns, rows, stage, claim_id, p)

    def end_put(self, put_id: int, give_rows_back: bool = True) -> tuple[bool, int]:
        """Ends a put that was not published: (whether it was still in flight — then nothing of it is
        published, and now nothing will be —, the current iteration). give_rows_back: rows allocated for
        it go back (a put that stored nothing); else they stay allocated until the next reset (its bytes
        may be stored). Ids of ended or abandoned puts are ignored."""
        return self.core.abort_put(put_id, give_rows_back), int(self.core.epoch)

    def claim(
        self, stage: int, max_rows: int, min_rows: int, timeout: float, max_items: int = 0
    ) -> tuple[np.ndarray, int, int]:
        return self.core.claim(stage, max_rows, min_rows, timeout, max_items)

    def release(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self.core.release(stage, rows, epoch, claim_id)

    def complete(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self.core.complete(stage, rows, epoch, claim_id)

    def progress(self, stage: int) -> dict:
        return self.core.progress(stage)

    def op_stats(self) -> dict:
        """Dock-wide put/claim counts and rows (every client's), as the local backend's op_stats."""
        return self.core.op_stats()

    def allocated_rows(self) -> int:
        return self.core.allocated_rows()

    def reset(
        self,
        keep_unfinished: bool = False,
        force: bool = False,
        op_timeout: float = 60.0,
    ) -> np.ndarray:
        """The dock's reset, atomic against puts (DockCore.begin_reset: refuses, nothing changed, while a
        put is in flight — force abandons them — or another reset runs; holds new puts back until the
        end). Prepares every warehouse (each refuses while fetches, puts or views are in flight there,
        then refuses new ones: all or none), resets the control plane (DockCore.reset_metadata), then the
        warehouses with their kept rows (attach_warehouses; each answer within op_timeout). Returns the
        kept rows."""
        handles = self.warehouses
        deadline = time.monotonic() + op_timeout  # one deadline for the whole reset

        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        self.core.begin_reset(force)
        try:
            refs = [h.prepare_reset.remote(force) for h in handles]
            failed: BaseException | None = None
            for w, ref in enumerate(refs):  # every answer: all warehouses prepared, or none stays so
                try:
                    ray_get(ref, f"warehouse {w}", left())
                except BaseException as e:  # noqa: BLE001 - the first is raised below
                    failed = failed or e
            if failed is not None:
                refs = [h.cancel_reset.remote() for h in handles]  # no put or fetch keeps seeing a freeze
                for w, ref in enumerate(refs):
                    with contextlib.suppress(MsrlError):
                        ray_get(ref, f"warehouse {w}", left())
                raise failed
            kept = self.core.reset_metadata(keep_unfinished)
            epoch = int(self.core.epoch)
            wh = self.core.warehouse_of(kept)
            refs = [h.reset.remote(epoch, kept[wh == w], left()) for w, h in enumerate(handles)]
            ray_get(refs, "warehouses", left() + 1.0)
            return kept
        finally:
            self.core.end_reset()

    def close(self) -> None:
        self.core.close()

    # -- the keyed store: the native DockCore's rules; bytes of erased rows are erased in the warehouses --

    def partition(self, name: str, create: bool) -> int:
        return self.core.partition(name, create)

    def partition_names(self) -> list[str]:
        return self.core.partition_names()

    def column_info(self, name: str) -> tuple | None:
        with self.decl_lock:
            return self.core.column_info(name)

    def declare_column(self, column: tuple, per_warehouse: list[tuple]) -> int:
        """Declares a run-time column here (the native check) and in every warehouse (its arena there)."""
        with self.decl_lock:
            cid = self.core.declare_column(column)
            refs = [h.declare_column.remote(cid, t) for h, t in zip(self.warehouses, per_warehouse)]
            ray_get(refs, "warehouses", self.op_timeout)
            return cid

    def begin_put_keys(
        self, p: int, keys: list, cids: list[int], overwrite: bool
    ) -> tuple[int, np.ndarray, np.ndarray, int, bool]:
        put, rows, fresh, epoch, rewrites = self.core.begin_put_keys(p, keys, cids, overwrite)
        return put, rows, fresh.astype(np.uint8), epoch, rewrites

    def publish_keys(
        self, put: int, rows: np.ndarray, p: int, columns: list, tags: list | None, versions: list[int]
    ) -> None:
        self.core.publish_keys(put, rows, p, columns, tags, versions)

    def check_put_in(
        self, p: int, rows: np.ndarray, epoch: int = -1, stage: int = -1, claim_id: int = 0
    ) -> tuple[int, int]:
        return self.core.begin_put_in(p, rows, epoch, stage, claim_id)

    def rows_of(self, p: int, keys: list) -> np.ndarray:
        return self.core.rows_of(p, keys)

    def keys_of(self, p: int, rows: np.ndarray) -> list:
        return self.core.keys_of(p, rows)

    def list_keys(self, p: int) -> tuple[list, np.ndarray, list]:
        return self.core.list_keys(p)

    def written(self, p: int, keys: list, cids: list[int]) -> np.ndarray:
        return self.core.written(p, keys, cids).astype(np.uint8).reshape(-1)  # the wire carries 1-D arrays

    def tag(self, p: int, keys: list, tags: list) -> None:
        self.core.tag(p, keys, tags)

    def _erase_bytes(self, rows: np.ndarray) -> None:
        """The rows' bytes in every warehouse holding some (each waits for its reads in flight)."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        wh = self.core.warehouse_of(rows)
        refs = [
            (w, h.erase_rows.remote(rows[wh == w], self.op_timeout))
            for w, h in enumerate(self.warehouses)
            if (wh == w).any()
        ]
        ray_get([r for _, r in refs], "warehouses", self.op_timeout + 5.0)

    def _erase(self, rows: np.ndarray) -> None:
        # Rows whose bytes could not be erased stay unusable (begin_erase) until the next reset.
        self._erase_bytes(rows)
        self.core.end_erase(rows)

    def erase_keys(self, p: int, keys: list) -> None:
        self._erase(self.core.begin_erase_keys(p, keys))

    def erase_rows(self, p: int, rows: np.ndarray) -> None:
        self._erase(self.core.begin_erase_rows(p, rows))

    def clear(self, p: int) -> None:
        self._erase(self.core.begin_clear(p))

    def drop_partition(self, p: int) -> None:
        self._erase(self.core.begin_clear(p))
        self.core.drop_partition(p)

    def claim_in(self, *req: Any) -> tuple[np.ndarray, int, int]:
        return self.core.claim_in(*ClaimIn(*req))  # the fields of a ClaimIn, as the wire carries them

    def claim_dp(self, *req: Any) -> tuple[np.ndarray, int, int]:
        return self.core.claim_dp(*ClaimDP(*req))

    def release_in(self, p: int, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self.core.release_in(p, stage, rows, epoch, claim_id)

    def complete_in(self, p: int, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self.core.complete_in(p, stage, rows, epoch, claim_id)

    def progress_in(self, p: int, stage: int) -> dict:
        return self.core.progress(stage, p)

    def check_claim_epoch(self, p: int, epoch: int) -> None:
        self.core.check_claim_epoch(p, epoch)

    def serve(self) -> Server:
        """Starts the same-node fast path."""
        ops: dict[str, Any] = {
            "claim": self.claim,
            "mark_ready": self.mark_ready,
            "allocate": self.allocate,
            "check_put": self.check_put,
            "end_put": self.end_put,
            "complete": self.complete,
            "release": self.release,
            "partition": self.partition,
            "column_info": self.column_info,
            "begin_put_keys": self.begin_put_keys,
            "publish_keys": self.publish_keys,
            "check_put_in": self.check_put_in,
            "rows_of": self.rows_of,
            "keys_of": self.keys_of,
            "written": self.written,
            "claim_in": self.claim_in,
            "claim_dp": self.claim_dp,
            "release_in": self.release_in,
            "complete_in": self.complete_in,
            "check_claim_epoch": self.check_claim_epoch,
            "partition_names": self.partition_names,
            "list_keys": self.list_keys,
            "tag": self.tag,
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
    for _name, dtype, ragged, shape, arena_bytes, *_rest in columns:
        item = _STORAGE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        sizes.append(int(arena_bytes) if ragged else num_rows * item)
    return sizes


_MAX_ARENA_BYTES = 1 << 40  # one shared arena's bound (the native kMaxChunkBytes)


class WarehouseActor:
    """Holds a native Warehouse. With shared memory (Linux), its arenas are memfd mappings that
    same-node clients map too: puts copy straight into the arena (reserve -> copy -> commit) and fetches
    copy straight out of it (locate -> copy -> unlease), with no Ray object-store copies.

    A ragged column without max_bytes grows instead of failing a put: its memfd is extended (ftruncate;
    the bytes keep their offsets, so views and readers in flight stay valid), mapped again here and handed
    to the native warehouse (resize_external); clients map it again when an offset lies past their
    mapping. When the column is empty again (erase, reset) the file is cut back to the configured size,
    so its memory comes back."""

    def __init__(self, wid: int, row_begin: int, num_rows: int, columns: list[tuple], shared: bool = True):
        self.wid = wid
        self.epoch = 0
        self.lock = threading.Lock()
        self.pending: dict[int, Any] = {}  # reservation id -> reservations of a client put
        self.leases: dict[int, int] = {}  # lease id -> epoch, fetches copying out of the arenas now
        self.pins: set[int] = set()  # lease ids of fetches whose zero-copy views are alive in a client
        self.writing: set[int] = set()  # far puts (Ray calls) storing now
        self.abandoned: set[int] = set()  # far puts a forced reset abandoned, still storing: reset waits
        self.idle = threading.Condition(self.lock)  # notified when an abandoned far put ends
        self.frozen = False  # between prepare_reset and reset: new puts and fetches are refused
        self.next_id = 0
        self.num_rows = num_rows
        self.fds: dict[int, int] = {}  # column id -> memfd of its shared arena (declared columns only)
        self.maps: dict[int, Any] = {}
        self.sizes: dict[int, int] = {}  # column id -> bytes of its memfd now
        self.base_sizes: dict[int, int] = {}  # column id -> configured bytes (it shrinks back to them)
        self.growable: set[int] = set()  # ragged columns without max_bytes
        self.item_bytes: dict[int, int] = {}
        self.old_maps: list[Any] = []  # mappings replaced by a growth: readers in flight may still use them
        for c, col in enumerate(columns):
            self._describe(c, col)
        external: list[int] = []
        self.shared = shared and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
        if self.shared:
            for c, size in enumerate(_arena_sizes(columns, num_rows)):
                external.append(self._new_arena(c, size))
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

    def _describe(self, c: int, column: tuple) -> None:
        _name, dtype, ragged, shape, _arena, growable, *_rest = column
        self.item_bytes[c] = _STORAGE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        self.base_sizes[c] = _arena_sizes([column], self.num_rows)[0]
        if ragged and growable:
            self.growable.add(c)
        else:
            self.growable.discard(c)

    def _new_arena(self, c: int, size: int) -> int:
        """A shared (memfd) arena for column c; its address."""
        import mmap

        fd = os.memfd_create(f"msrl-dock-w{self.wid}-c{c}")
        os.ftruncate(fd, max(size, 1))
        mm = mmap.mmap(fd, max(size, 1))  # MAP_SHARED; pages are touched only when written
        self.fds[c] = fd
        self.maps[c] = mm
        self.sizes[c] = max(size, 1)
        return np.frombuffer(mm, dtype=np.uint8).ctypes.data

    def _resize(self, c: int, size: int) -> None:
        """Column c's memfd to `size` bytes (lock held): grown, it is mapped again (the old mapping stays
        for readers in flight); shrunk (only when empty), the file is cut (its pages are freed)."""
        import mmap

        if size > len(self.maps[c]):
            os.ftruncate(self.fds[c], size)
            mm = mmap.mmap(self.fds[c], size)
            self.wh.resize_external(c, np.frombuffer(mm, dtype=np.uint8).ctypes.data, size)
            self.old_maps.append(self.maps[c])
            self.maps[c] = mm
        else:
            self.wh.resize_external(c, np.frombuffer(self.maps[c], dtype=np.uint8).ctypes.data, size)
            os.ftruncate(self.fds[c], size)
        self.sizes[c] = size

    def _growing(self, store: Any, needs: list[tuple[int, Any]]) -> Any:
        """store() (a reserve or a put, lock held), and once more after growing the shared arenas of the
        growable columns it writes when it did not fit. needs: (column id, lengths or None)."""
        try:
            return store()
        except OutOfMemory:
            # Items in Python ints: a peer's absurd lengths must not wrap around to a small size.
            grow = [(c, sum(map(int, lens))) for c, lens in needs if c in self.growable and lens is not None]
            if not self.shared or not grow:
                raise
            sizes = [(c, max(2 * self.sizes[c], self.sizes[c] + n * self.item_bytes[c])) for c, n in grow]
            if any(size > _MAX_ARENA_BYTES for _, size in sizes):
                raise  # more than any arena may hold: the native error says so
            for c, size in sizes:
                self._resize(c, size)
        return store()

    def _shrink_empty(self) -> None:
        """Grown arenas of columns left empty go back to their configured size (lock held)."""
        for c in sorted(self.growable):
            base = max(self.base_sizes[c], 1)
            if c in self.fds and self.sizes[c] > base and self.wh.column_stats(c)["bytes_used"] == 0:
                self._resize(c, base)
        if self.old_maps and not (self.leases or self.pins or self.writing or self.pending):
            self.old_maps.clear()  # no reader or writer can hold an address in them any more

    def arena_fds(self) -> tuple[list[list[int]], list[int]]:
        """([column ids, arena sizes], fds) of the declared columns' shared arenas."""
        with self.lock:
            cids = sorted(self.fds)
            return [cids, [self.sizes[c] for c in cids]], [self.fds[c] for c in cids]

    def declare_column(self, cid: int, column: tuple) -> None:
        """A run-time column (id from the controller): placeholders keep the ids aligned when declarations
        arrive out of order; an existing declaration is kept (the controller checked the type)."""
        with self.lock:
            while self.wh.num_columns < cid:
                n = self.wh.num_columns
                self.wh.add_column((f"#{n}", "uint8", False, [], 0, False, "uint8"), 0, False)
            if cid < self.wh.num_columns and self.wh.declared(cid):
                return
            self._describe(cid, column)
            ext = self._new_arena(cid, _arena_sizes([column], self.num_rows)[0]) if self.shared else 0
            if cid < self.wh.num_columns:
                self.wh.set_column(cid, column, ext)
            else:
                self.wh.add_column(column, ext)

    def _exclusive(self, what: str, timeout: float) -> None:
        """Waits (self.lock held on return) until no read is in flight here; refuses while zero-copy views
        are alive. For rewrites and erases, which free or rewrite bytes readers copy without the lock."""
        deadline = time.monotonic() + timeout
        pause = 0.0001
        self.lock.acquire()
        try:
            while True:
                if self.pins:
                    raise InvalidArgument(
                        f"{what} while zero-copy fetch views of {len(self.pins)} fetch(es) are alive; drop "
                        "them first; nothing was changed"
                    )
                if not self.leases:
                    return
                if time.monotonic() >= deadline:
                    raise Timeout(f"{what} waited {timeout:g} s for fetches in flight; nothing was changed")
                self.lock.release()
                time.sleep(pause)
                pause = min(2 * pause, 0.005)
                self.lock.acquire()
        except BaseException:
            self.lock.release()
            raise

    def erase_rows(self, rows: np.ndarray, timeout: float = 60.0) -> None:
        """Erases every column of rows (erase by key): their bytes are free at once."""
        self._exclusive("erase", timeout)
        try:
            cids = [c for c in range(self.wh.num_columns) if self.wh.declared(c)]
            self.wh.erase(cids, rows)
            self._shrink_empty()
        finally:
            self.lock.release()

    def column_stats(self, cid: int) -> dict[str, int]:
        return self.wh.column_stats(cid)

    def reserve(self, cols: list[tuple], rows: np.ndarray, epoch: int) -> tuple[int, list[tuple]]:
        with self.lock:
            self._check_epoch(epoch)
            res = self._growing(lambda: self.wh.reserve(cols, rows), cols)
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

    def put(self, inputs: list[tuple], rows: np.ndarray, epoch: int = -1, overwrite: bool = False) -> int:
        """A far client's put: stored all or nothing, registered while it stores like a same-node
        reservation (reset refuses meanwhile; reset(force) abandons it: then what it stored is erased and
        it raises, so no byte of it reaches a later iteration). overwrite: cells already written are
        rewritten, with no read in flight here (it waits for them and holds reads back meanwhile)."""
        if overwrite:
            self._exclusive("overwrite", 60.0)
            try:
                self._check_epoch(epoch)
                self._growing(lambda: self.wh.put(inputs, rows, True), [(c, ln) for c, _, ln in inputs])
            finally:
                self.lock.release()
            return len(rows)
        with self.lock:
            self._check_epoch(epoch)
            self.next_id += 1
            wid = self.next_id
            self.writing.add(wid)
        stored = False
        try:
            try:
                self.wh.put(inputs, rows)
            except OutOfMemory:  # grown under the lock (no reservation moves meanwhile), then stored
                with self.lock:
                    self._growing(lambda: self.wh.put(inputs, rows), [(c, ln) for c, _, ln in inputs])
            stored = True
        finally:
            with self.lock:
                self.writing.discard(wid)
                abandoned = wid in self.abandoned
                if abandoned:
                    if stored:
                        with contextlib.suppress(MsrlError):
                            self.wh.erase([cid for cid, _, _ in inputs], rows)
                    self.abandoned.discard(wid)
                    self.idle.notify_all()
        if abandoned:
            raise InvalidArgument(
                "this put was abandoned by reset(force=True); nothing was stored (put again)"
            )
        return len(rows)

    def erase(self, columns: list[int], rows: np.ndarray, epoch: int = -1) -> None:
        """Undoes the committed rows of a put that failed elsewhere; nothing when the warehouse has moved
        past the put's iteration (a reset forgot them, and the rows may be another put's now)."""
        with self.lock:
            if epoch >= 0 and epoch != self.epoch:
                return
            self.wh.erase(columns, rows)
            self._shrink_empty()

    def fetch(self, specs: list[tuple], rows: np.ndarray, epoch: int = -1) -> list[tuple]:
        """Packed copies of the rows for each (column id, storage dtype, inner shape, ragged), under a
        lease like a same-node fetch (reset refuses meanwhile; when reset(force) drops the lease, the
        copies may be of moved bytes: it raises instead of answering)."""
        with self.lock:
            self._check_epoch(epoch)
            self.next_id += 1
            lid = self.next_id
            self.leases[lid] = self.epoch
        try:
            out = self._gather(specs, rows)
        finally:
            with self.lock:
                live = self.leases.pop(lid, None) is not None
        if not live:
            raise InvalidArgument(
                "this fetch was abandoned by reset(force=True); nothing was read (fetch again)"
            )
        return out

    def _gather(self, specs: list[tuple], rows: np.ndarray) -> list[tuple]:
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
                self.abandoned |= self.writing  # still storing: reset() waits for them to end
                self.writing.clear()
                self.pins.clear()  # views of a reader that died; live ones would see the next iteration
            self._check_idle()
            self.frozen = True

    def cancel_reset(self) -> None:
        with self.lock:
            self.frozen = False

    def reset(self, epoch: int, keep_rows: np.ndarray | None = None, timeout: float = 60.0) -> None:
        """keep_rows (partial reset): rows of this warehouse that stay, their bytes compacted. Waits (up to
        timeout) for far puts a forced reset abandoned to end: they erase what they stored."""
        with self.lock:
            if not self.idle.wait_for(lambda: not self.abandoned, timeout):
                raise Timeout(
                    f"warehouse {self.wid}: {len(self.abandoned)} abandoned put(s) still storing after "
                    f"{timeout:g} s; nothing was reset"
                )
            self.wh.reset(None if keep_rows is None or not len(keep_rows) else keep_rows)
            self._shrink_empty()
            self.epoch = epoch
            self.frozen = False

    def _check_idle(self) -> None:
        if self.pins:
            raise InvalidArgument(
                f"reset() while zero-copy fetch views of {len(self.pins)} fetch(es) are alive (arrays "
                "from fetch(copy=False) or take(copy=False)); drop them first; nothing was reset"
            )
        if self.leases or self.pending or self.writing:
            puts = len(self.pending) + len(self.writing)
            raise InvalidArgument(
                f"reset() while {len(self.leases)} fetch(es) and {puts} put(s) are in flight; nothing was "
                "reset"
            )
