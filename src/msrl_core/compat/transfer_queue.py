"""``transfer_queue``-compatible module over the dock's own control plane: verl's subset of TransferQueue.

verl V1 uses TransferQueue 0.1.11 as a key-value store with tags. This module implements the part verl
calls — ``init``, ``close``, ``get_client``, ``get_metrics_endpoint``, ``kv_put`` / ``async_kv_put``,
``kv_batch_put`` / ``async_kv_batch_put``, ``kv_batch_get`` (+ ``_by_meta``, async twins), ``kv_list``,
``kv_clear``, ``save_checkpoint``, ``load_checkpoint``; the client calls ``async_get_data``, ``async_put(data,
metadata=)``, ``async_kv_retrieve_meta(create=)``, ``async_kv_retrieve_keys``; the types ``KVBatchMeta`` and
``BatchMeta`` (TransferQueue's own classes) — on a Ray-backend msrl_core Dock, with no TransferQueue
controller: TQ partitions are dock partitions, TQ keys are dock keys, tags are dock tags, global indexes are
dock row ids. ``install()`` puts this module in ``sys.modules["transfer_queue"]`` (name it as Ray's
``worker_process_setup_hook`` to do that in every worker). Fields are stored as the MsrlDock backend stores
them (``msrl_core.integrations.transfer_queue``: one dock column per field and kind, exactly what
SimpleStorage returns comes back); the column of each (key, field) is a reserved tag entry
(``RESERVED_TAG + field``) written with the data in the same all-or-nothing put and hidden from ``kv_list``.

Keys are listed in insertion order (a creation stamp, ``SEQ_TAG``, is written with each new key), as
TransferQueue's controller lists them. A put is one dock call (tags, the column entries and the new keys'
stamps travel with the data, all or nothing); the KVBatchMeta it returns reads its keys' tags when first used
(``_PutMeta``), so an upsert whose result is dropped — verl's agent loop, per sample — reads nothing.

Not implemented (verl does not use them): samplers / consumption and production status, ``StreamingDataset``,
``clear_partition`` from the client, metrics, ``data_parser``. For TransferQueue's own e2e tests a named
actor ``TransferQueueController`` (namespace ``transfer_queue``) answers the three calls they make to TQ's
controller (``list_partitions``, ``clear_partition``, ``get_partition_snapshot``) from the dock, and
``Client.get_meta`` is a stub of TQ's sampler API (fetch / force_fetch, per-task consumption in that actor,
no samplers, never waits) for the one test that calls it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import ray
import torch
from omegaconf import DictConfig
from tensordict import NonTensorStack, TensorDict

try:
    from transfer_queue.metadata import BatchMeta, KVBatchMeta
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "msrl_core.compat.transfer_queue uses TransferQueue's own BatchMeta / KVBatchMeta: it needs "
        "transferqueue==0.1.11 installed (pip install 'msrl_core[tq]')"
    ) from exc

from msrl_core.dock import Dock
from msrl_core.dock._objects import ObjectCodec
from msrl_core.errors import InvalidArgument, NotFound
from msrl_core.integrations import transfer_queue as _msrl_tq  # refuses transferqueue other than 0.1.11

__all__ = [
    "BatchMeta",
    "KVBatchMeta",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "install",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
]

# verl versions whose TransferQueue calls this module is written against: verl V1 as of
# verl-project/verl 1dda039 (0.10.0.dev; PyPI's 0.9.1 predates V1). No verl installed is fine (TQ's own
# tests, benchmarks); any other installed verl is refused at import.
SUPPORTED_VERL_VERSIONS = ("0.10.0.dev", "0.10.0.dev0")


def _check_verl() -> str | None:
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version not in SUPPORTED_VERL_VERSIONS:
        raise ImportError(
            f"msrl_core.compat.transfer_queue implements the TransferQueue calls of verl "
            f"{SUPPORTED_VERL_VERSIONS[0]} (verl V1, verl-project/verl 1dda039); found verl {version}. "
            "Use verl 0.10.0.dev, or keep TransferQueue itself (its MsrlDock storage backend: "
            "msrl_core.integrations.transfer_queue)"
        )
    return version


TQ_VERSION = _msrl_tq.TQ_VERSION  # checked by msrl_core.integrations.transfer_queue (one rule)
VERL_VERSION = _check_verl()

CONTROLLER_NAME = "TransferQueueController"
NAMESPACE = "transfer_queue"
# Tag names starting with RESERVED_PREFIX are this module's, hidden from kv_list and refused from users:
# RESERVED_TAG + field names the dock column of that field of the key; SEQ_TAG orders keys by insertion.
RESERVED_PREFIX = "\x00msrl."
RESERVED_TAG = RESERVED_PREFIX + "column:"
SEQ_TAG = RESERVED_PREFIX + "seq"
_METADATA_FILE = "metadata.json"
_ACTOR_TIMEOUT_S = 60.0  # the deadline of every call to the stand-in controller actor

_STATE_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}  # dock, codec, controller, owner, client


def install() -> None:
    """Makes ``import transfer_queue`` return this module in this process (Ray worker_process_setup_hook).

    TransferQueue itself is imported first (its metadata types are used as they are)."""
    sys.modules["transfer_queue"] = sys.modules[__name__]


# ---- the stand-in for TQ's controller actor (what TQ's e2e tests ask it) --------------------------


class PartitionSnapshot:
    """The parts of TQ's ``DataPartitionStatus`` its e2e tests read."""

    def __init__(self, keys_mapping: dict, custom_meta: dict, fields: list[str], written: np.ndarray):
        self.keys_mapping = keys_mapping
        self.global_indexes = set(keys_mapping.values())
        self.custom_meta = custom_meta
        self.field_name_mapping = {f: j for j, f in enumerate(fields)}
        rows = max(self.global_indexes, default=-1) + 1
        status = torch.zeros(rows, len(fields), dtype=torch.int8)
        for i, row in enumerate(keys_mapping.values()):
            status[row] = torch.from_numpy(written[i].astype(np.int8))
        self.production_status = status


class _Controller:
    """The named actor every process finds the dock by; also keeps get_meta's consumption (per partition and
    task: the keys handed out) and answers the three calls TransferQueue's e2e fixtures make."""

    def __init__(self, dock: Any, codec: ObjectCodec):
        self.dock = dock
        self.codec = codec
        self._lock = threading.Lock()
        self._consumed: dict[tuple[str, str | None], set] = {}

    def handle(self) -> tuple[Any, ObjectCodec]:
        return self.dock, self.codec

    def consume(
        self, partition_id: str, task: str | None, ready: list, batch_size: int | None, whole: bool
    ) -> list:
        """Up to batch_size of ``ready`` not consumed by ``task`` yet, now consumed (with ``whole``: all
        batch_size or none)."""
        with self._lock:
            done = self._consumed.setdefault((partition_id, task), set())
            free = [k for k in ready if k not in done]
            if batch_size is not None:
                if whole and len(free) < batch_size:
                    return []
                free = free[:batch_size]
            done.update(free)
            return free

    def forget(self, partition_id: str, keys: list) -> None:
        with self._lock:
            for (p, _), done in self._consumed.items():
                if p == partition_id:
                    done.difference_update(keys)

    def list_partitions(self) -> list[str]:
        return list(self.dock.partitions())

    def clear_partition(self, partition_id: str) -> None:
        if partition_id in self.dock.partitions():
            self.dock.drop_partition(partition_id)
        with self._lock:
            self._consumed = {pt: d for pt, d in self._consumed.items() if pt[0] != partition_id}

    def get_partition_snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        if partition_id not in self.dock.partitions():
            return None
        tags = self.dock.tags(partition=partition_id)
        keys = _insertion_order(tags)
        user = {k: _user_tags(t) for k, t in tags.items()}
        fields = sorted({f for t in tags.values() for f in _columns(t)})
        written = np.array([[f in _columns(tags[k]) for f in fields] for k in keys], dtype=bool).reshape(
            len(keys), len(fields)
        )
        rows = self.dock.rows_of(keys, partition=partition_id) if keys else np.empty(0, np.int64)
        mapping = {k: int(r) for k, r in zip(keys, rows)}
        return PartitionSnapshot(mapping, {mapping[k]: user[k] for k in keys}, fields, written)


# ---- tags: the user's and the reserved column entries ------------------------------------------


def _columns(tag: dict) -> dict[str, str]:
    return {k[len(RESERVED_TAG) :]: v for k, v in tag.items() if k.startswith(RESERVED_TAG)}


def _user_tags(tag: dict) -> dict:
    return {k: v for k, v in tag.items() if not k.startswith(RESERVED_PREFIX)}


def _insertion_order(tags: dict) -> list:
    """Keys of ``{key: tags}`` in insertion order (TransferQueue's kv_list order): by the sequence stamped
    on each key's creation; keys without one (written by other dock handles) last, in row order."""
    last = [float("inf")]
    return sorted(tags, key=lambda k: tags[k].get(SEQ_TAG, last))


_SEQ_LOCK = threading.Lock()
_SEQ_LAST = [0]


def _new_seq(n: int) -> list[list[int]]:
    """n increasing creation stamps: [wall-clock ns, n-th], strictly increasing within this process and
    ordered across the processes of a node (the wall clock); JSON-able for the dock's tags."""
    with _SEQ_LOCK:
        now = max(time.time_ns(), _SEQ_LAST[0] + 1)
        _SEQ_LAST[0] = now
    return [[now, i] for i in range(n)]


# ---- lifecycle ----------------------------------------------------------------------------------


def _options(conf: Any) -> dict[str, int]:
    block = None
    if conf is not None:
        backend = conf.get("backend") if hasattr(conf, "get") else None
        block = backend.get(_msrl_tq.BACKEND_NAME) if backend is not None else None
    return _msrl_tq._user_options(block or {})


def init(conf: DictConfig | dict | None = None) -> DictConfig | dict | None:
    """Creates the dock (first call in the cluster) or attaches to it (later calls, any Ray process).

    ``conf``: TransferQueue's config; only ``backend.MsrlDock.capacity`` / ``.warehouses`` are read."""
    with _STATE_LOCK:
        if _STATE.get("dock") is not None:
            return conf
        if not ray.is_initialized():
            ray.init()
        try:
            controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
            owner = False
        except ValueError:
            opts = _options(conf)
            dock: Any = Dock(
                columns={},
                stages={},
                capacity=opts["capacity"],
                warehouses=opts["warehouses"],
                backend="ray",
                output="torch",
            )
            codec = ObjectCodec.new(allow_pickle=True)
            try:
                actor_cls: Any = ray.remote(_Controller)
                named = actor_cls.options(
                    name=CONTROLLER_NAME, namespace=NAMESPACE, num_cpus=0.01, max_concurrency=8
                )
                controller = named.remote(dock, codec)
                ray.get(controller.handle.remote(), timeout=_ACTOR_TIMEOUT_S)
                owner = True
            except ValueError:  # another process won the race: use its dock
                dock.shutdown()
                controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
                owner = False
        dock, codec = ray.get(controller.handle.remote(), timeout=_ACTOR_TIMEOUT_S)
        client = Client(dock, codec, controller)
        _STATE.update(dock=dock, codec=codec, controller=controller, owner=owner, client=client)
    return conf


def close() -> None:
    with _STATE_LOCK:
        client = _STATE.get("client")
        if client is not None:
            client.close()
        if _STATE.get("owner"):
            try:
                _STATE["dock"].shutdown()
            finally:
                ray.kill(_STATE["controller"])
        _STATE.clear()


def get_metrics_endpoint() -> str | None:
    """No Prometheus exporter here (the dock's figures are ``Dock.stats()``)."""
    return None


def get_client() -> Client:
    client = _STATE.get("client")
    if client is None:
        init()
        client = _STATE["client"]
    return client


# ---- the client ---------------------------------------------------------------------------------


def _key_list(keys: Any) -> list:
    return [keys] if isinstance(keys, (str, int)) else list(keys)


class _PutMeta(KVBatchMeta):
    """The KVBatchMeta a put returns (TransferQueue's: the keys' merged tags and every field they hold), with
    ``tags`` and ``fields`` read from the dock when first used — or, at the latest, before this process's
    client next changes one of its keys (``Client._settle``), so within a process they are the state right
    after the put, as TQ returns it. A result nobody reads (verl's agent loop drops what its upserts return)
    costs no read. Pickled or copied it becomes a plain KVBatchMeta, read then."""

    @classmethod
    def pending(cls, keys: list, partition_id: str, load: Callable[[], dict]) -> _PutMeta:
        self = cls.__new__(cls)
        self.__dict__.update(
            keys=list(keys),
            partition_id=partition_id,
            extra_info={},
            _size=len(keys),
            _load=load,
            _lock=threading.Lock(),
        )
        return self

    def _loaded(self) -> dict:
        d = self.__dict__
        if "_load" in d:
            with d.setdefault("_lock", threading.Lock()):
                load = d.pop("_load", None)
                if load is not None:
                    tags = load()
                    d["tags"] = [_user_tags(tags[k]) for k in d["keys"]]
                    d["fields"] = sorted({f for k in d["keys"] for f in _columns(tags[k])})
        return d

    @property  # type: ignore[override]
    def tags(self) -> list[dict]:
        return self._loaded()["tags"]

    @tags.setter
    def tags(self, value: list[dict]) -> None:
        self._loaded()["tags"] = value

    @property  # type: ignore[override]
    def fields(self) -> list[str] | None:
        return self._loaded()["fields"]

    @fields.setter
    def fields(self, value: list[str] | None) -> None:
        self._loaded()["fields"] = value

    def __reduce__(self) -> tuple:
        return (KVBatchMeta, (self.keys, self.tags, self.partition_id, self.fields, self.extra_info))


def _retrying(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a Client operation again, once, when the dock says a partition id it cached was dropped by
    another handle (``NotFound: ... was dropped``: refused before anything changed)."""

    def call(self: Client, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except NotFound as e:
            if "was dropped" not in str(e):
                raise
        # The Ray client resets its partition-id cache on this error only on its socket path, not on calls
        # through Ray (list_keys, tag): forget the ids here (asked of the dock's owner, inbox/dock.md).
        if isinstance(getattr(self.dock._backend, "_pids", None), dict):
            self.dock._backend._pids = {}
        return fn(self, *args, **kwargs)

    call.__name__, call.__doc__ = fn.__name__, fn.__doc__
    return call


_FEW_KEYS = 16  # up to this many keys, a put finds its new keys by per-key lookups, above by one listing


class Client:
    """The client calls verl makes (``tq.get_client()``), plus the key-value operations behind the module
    functions. Dock calls block (natively, GIL released); the async methods run them on a thread pool."""

    def __init__(self, dock: Any, codec: ObjectCodec, controller: Any = None):
        self.dock = dock
        self.codec = codec
        self.controller = controller  # the stand-in actor: get_meta's consumption
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="msrl-tq-compat")
        # Put results not read yet: id -> weak reference (a result dropped unread is never read).
        self._pending: dict[int, weakref.ref] = {}
        self._pending_lock = threading.Lock()

    def _settle(self, keys: list | None, partition_id: str | None) -> None:
        """Reads the pending put results of keys in partition_id (None: all) before they change."""
        if not self._pending:
            return
        wanted = None if keys is None else set(keys)
        with self._pending_lock:
            metas = [m for m in (r() for r in list(self._pending.values())) if m is not None]
        for m in metas:
            if partition_id is not None and m.partition_id != partition_id:
                continue
            if wanted is None or not wanted.isdisjoint(m.keys):
                m._loaded()
                with self._pending_lock:
                    self._pending.pop(id(m), None)

    def _pend(self, meta: _PutMeta) -> _PutMeta:
        key = id(meta)

        def gone(_ref: weakref.ref, key: int = key, pending: dict = self._pending) -> None:
            pending.pop(key, None)

        with self._pending_lock:
            self._pending[key] = weakref.ref(meta, gone)
        return meta

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # -- synchronous core --

    def _absent(self, keys: list, partition_id: str) -> list:
        """Those of keys the partition does not hold (yet)."""
        if len(keys) <= _FEW_KEYS:
            out = []
            for k in keys:
                try:
                    self.dock.rows_of([k], partition=partition_id)
                except NotFound as e:
                    if "was dropped" in str(e):
                        raise
                    out.append(k)
            return out
        try:
            present = set(self.dock.keys(partition=partition_id))
        except NotFound as e:
            if "was dropped" in str(e):
                raise
            return list(keys)
        return [k for k in keys if k not in present]

    def tags_of(self, keys: list, partition_id: str) -> dict:
        """``{key: tags}`` of keys, reserved entries included (ValueError naming missing keys).

        The dock has no per-key tag read yet: ``Dock.tags`` lists (and decodes) the whole partition; this
        decodes only the keys asked for (asked of the dock's owner: /work/coord/inbox/dock.md)."""
        backend = self.dock._backend
        try:
            listed_keys, _rows, items = backend.list_keys(self.dock._pid(partition_id))
        except NotFound as e:
            if "was dropped" in str(e):
                raise
            raise ValueError(
                f"keys were not found: partition {partition_id!r} does not exist "
                f"(partitions: {sorted(self.dock.partitions())})"
            ) from None
        where = {k: i for i, k in enumerate(listed_keys)}
        missing = [k for k in keys if k not in where]
        if missing:
            raise ValueError(
                f"keys were not found in partition {partition_id!r}: {missing[:8]!r}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                + f" ({len(missing)} of the {len(keys)} requested); nothing was read"
            )
        return {k: {name: json.loads(text) for name, text in items[where[k]]} for k in keys}

    @_retrying
    def put(
        self,
        keys: list,
        partition_id: str,
        fields: TensorDict | None,
        tags: list[dict] | None,
        existing: bool = False,
    ) -> KVBatchMeta:
        """Writes fields and/or tags of keys in one all-or-nothing dock call (new keys get their creation
        stamp in it); returns their KVBatchMeta as TransferQueue does (tags merged, every field held; read
        when first used, see _PutMeta)."""
        n = len(keys)
        if fields is None and tags is None:
            raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
        if n == 0:
            raise ValueError("`keys` is empty: a put needs at least one key")
        if len(set(keys)) != n:
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"key {dup!r} appears twice in one put; keys of a put must be unique")
        if fields is not None and fields.batch_size[0] != n:
            raise ValueError(
                f"`keys` with length {n} does not match the `fields` TensorDict with batch_size "
                f"{fields.batch_size[0]}"
            )
        if tags is not None and len(tags) != n:
            raise ValueError(f"keys with length {n} does not match length of tags {len(tags)}")
        bad = [k for t in (tags or []) for k in t if str(k).startswith(RESERVED_PREFIX)]
        if bad:
            raise ValueError(f"tag keys starting with {RESERVED_PREFIX!r} are reserved, got {bad[0]!r}")
        merged = [dict(t) for t in tags] if tags is not None else [{} for _ in keys]
        columns: dict[str, Any] = {}
        if fields is not None:
            columns, chosen = _msrl_tq.encode_fields(fields, n, self.codec)
            reserved = {RESERVED_TAG + f: c for f, c in chosen.items()}
            for t in merged:
                t.update(reserved)
        fresh = set() if existing else set(self._absent(keys, partition_id))  # existing: keys from keys_of
        if fresh:
            stamps = iter(_new_seq(len(fresh)))
            for k, t in zip(keys, merged):
                if k in fresh:
                    t[SEQ_TAG] = next(stamps)
        # A put without columns is the tag upsert (Dock.tag's native rule) on the dock's same-node socket
        # path (~0.1 ms); Dock.tag itself goes through a Ray call (~1.5-3 ms here).
        self._settle(keys, partition_id)  # earlier results of these keys show the state before this put
        self.dock.put(columns, keys=keys, partition=partition_id, overwrite=True, tags=merged)
        read = _retrying(lambda client: client.tags_of(keys, partition_id))
        return self._pend(_PutMeta.pending(keys, partition_id, lambda: read(self)))

    @_retrying
    def get(self, keys: list, partition_id: str, select_fields: list[str] | None) -> TensorDict:
        if not keys:
            raise ValueError("`keys` is empty: kv_batch_get needs at least one key")
        tags = self.tags_of(keys, partition_id)
        cols = [_columns(tags[k]) for k in keys]
        if select_fields is None:  # as TQ: the fields every requested key has
            fields = sorted(set.intersection(*[set(c) for c in cols]))
        else:
            fields = list(select_fields)
        missing = [(k, f) for k, c in zip(keys, cols) for f in fields if f not in c]
        if missing:
            short = sorted({k for k, _ in missing}, key=keys.index)
            raise ValueError(
                f"Some fields are not ready in all the requested keys! key {missing[0][0]!r} has no field "
                f"{missing[0][1]!r} in partition {partition_id!r} ({len(short)} of {len(keys)} keys lack "
                f"some of {fields}); nothing was read"
            )
        n = len(keys)
        groups: dict[tuple[str, ...], list[int]] = {}
        for pos, c in enumerate(cols):
            groups.setdefault(tuple(c[f] for f in fields), []).append(pos)
        parts: dict[str, list[tuple[list[int], str, Any]]] = {f: [] for f in fields}
        for group_cols, positions in groups.items():
            batch = self.dock.get(
                [keys[p] for p in positions], sorted(set(group_cols)), partition=partition_id, output="torch"
            )
            for field, col in zip(fields, group_cols):
                kind, value = _msrl_tq.decode_column(col, batch[col], self.codec)
                parts[field].append((positions, kind, value))
        return TensorDict({f: _msrl_tq.pack_field(parts[f], n) for f in fields}, batch_size=n)

    @_retrying
    def list_keys(self, partition_id: str | None) -> dict[str, dict]:
        names = list(self.dock.partitions())
        if partition_id is not None:
            if partition_id not in names:
                return {}
            names = [partition_id]
        out = {}
        for p in names:
            tags = self.dock.tags(partition=p)
            out[p] = {k: _user_tags(tags[k]) for k in _insertion_order(tags)}
        return out

    @_retrying
    def clear(self, keys: list, partition_id: str) -> None:
        if partition_id in self.dock.partitions():
            self._settle(keys, partition_id)
            _msrl_tq.erase_present(self.dock, keys, partition_id)
            if self.controller is not None:
                ray.get(self.controller.forget.remote(partition_id, keys), timeout=_ACTOR_TIMEOUT_S)

    @_retrying
    def meta(self, keys: list, partition_id: str, create: bool) -> BatchMeta:
        if create:
            fresh = self._absent(keys, partition_id)
            if fresh:
                stamps = [{SEQ_TAG: s} for s in _new_seq(len(fresh))]
                self.dock.put({}, keys=fresh, partition=partition_id, overwrite=True, tags=stamps)
        try:
            tags = self.dock.tags(partition=partition_id, keys=keys)
            rows = self.dock.rows_of(keys, partition=partition_id)
        except NotFound as e:
            if "was dropped" in str(e):
                raise
            return BatchMeta.empty()
        return _batch_meta(keys, rows, partition_id, tags)

    @_retrying
    def get_meta(
        self,
        data_fields: list[str] | None,
        batch_size: int | None,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict | None = None,
    ) -> BatchMeta:
        """A stub of TransferQueue's sampler API (verl does not call it; TQ's key-value e2e file does once):
        ``mode="fetch"``: ``batch_size`` keys, in insertion order, that hold every one of ``data_fields`` and
        that ``task_name`` has not consumed yet (consumption kept by the stand-in controller actor, forgotten
        by kv_clear and clear_partition), or an empty BatchMeta when fewer are ready (TQ's polling mode: it
        never waits); ``"force_fetch"``: the same without the readiness check. No samplers, no
        ``sampling_config``."""
        if sampling_config is not None:
            raise NotImplementedError("msrl_core.compat.transfer_queue.get_meta takes no sampling_config")
        if mode not in ("fetch", "force_fetch"):
            raise ValueError(f"get_meta mode must be 'fetch' or 'force_fetch' here, got {mode!r}")
        if mode == "fetch" and batch_size is None:
            raise ValueError("must provide batch_size in fetch mode")
        if partition_id not in self.dock.partitions() or self.controller is None:
            return BatchMeta.empty()
        tags = self.dock.tags(partition=partition_id)
        wanted = list(data_fields or [])
        ready = [
            k
            for k in _insertion_order(tags)
            if mode == "force_fetch" or set(wanted) <= set(_columns(tags[k]))
        ]
        ref = self.controller.consume.remote(partition_id, task_name, ready, batch_size, mode == "fetch")
        taken = ray.get(ref, timeout=_ACTOR_TIMEOUT_S)
        if not taken:
            return BatchMeta.empty()
        rows = self.dock.rows_of(taken, partition=partition_id)
        meta = _batch_meta(taken, rows, partition_id, {k: tags[k] for k in taken})
        return meta.select_fields(wanted) if wanted else meta

    # -- verl's client calls --

    async def async_get_meta(self, *args: Any, **kwargs: Any) -> BatchMeta:
        return await self._call(self.get_meta, *args, **kwargs)

    async def async_kv_retrieve_meta(self, keys: Any, partition_id: str, create: bool = False) -> BatchMeta:
        return await self._call(self.meta, _key_list(keys), partition_id, create)

    async def async_kv_retrieve_keys(self, global_indexes: Any, partition_id: str) -> list:
        return await self._call(self.kv_retrieve_keys, global_indexes, partition_id)

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        if metadata.size == 0 or not metadata.field_names:
            return TensorDict({}, batch_size=0)
        partition = _one_partition(metadata)
        keys = await self.async_kv_retrieve_keys(metadata.global_indexes, partition)
        return await self._call(self.get, keys, partition, list(metadata.field_names))

    async def async_put(
        self, data: TensorDict, metadata: BatchMeta | None = None, partition_id: str | None = None, **kw: Any
    ) -> BatchMeta:
        if kw.get("data_parser") is not None:
            raise NotImplementedError("data_parser is not supported by msrl_core.compat.transfer_queue")
        if metadata is None or metadata.size == 0:
            raise ValueError("put() here needs the BatchMeta of existing keys (kv_retrieve_meta)")
        partition = _one_partition(metadata)
        keys = await self.async_kv_retrieve_keys(metadata.global_indexes, partition)
        await self._call(self.put, keys, partition, data, None, True)
        return metadata.add_fields(data)

    def kv_retrieve_meta(self, keys: Any, partition_id: str, create: bool = False) -> BatchMeta:
        return self.meta(_key_list(keys), partition_id, create)

    @_retrying
    def kv_retrieve_keys(self, global_indexes: Any, partition_id: str) -> list:
        return list(self.dock.keys_of([int(i) for i in global_indexes], partition=partition_id))

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        return _run(self.async_get_data(metadata))

    def put_data(self, data: TensorDict, metadata: BatchMeta) -> BatchMeta:
        return _run(self.async_put(data, metadata))

    @_retrying
    def get_partition_list(self) -> list[str]:
        return list(self.dock.partitions())


def _one_partition(metadata: BatchMeta) -> str:
    parts = set(metadata.partition_ids)
    if len(parts) != 1:
        raise InvalidArgument(f"a BatchMeta of one partition is needed here, got partitions {sorted(parts)}")
    return parts.pop()


def _field_schema(column: str) -> dict[str, Any]:
    """TransferQueue's field schema entry (``extract_field_schema``) for a field stored in ``column``: a
    field of one scalar per sample (a 1-D batch field) is recorded as TQ records it, per-sample shape (1,)
    (``(B, 1)``); fields with a first dimension per sample are nested (their lengths per sample vary)."""
    _, dtype, ndim, _trail = _msrl_tq._parse_kind(column)
    if dtype is None:
        return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    if ndim == 0:
        return {"dtype": dtype, "shape": torch.Size([1]), "is_nested": False, "is_non_tensor": False}
    return {"dtype": dtype, "shape": None, "is_nested": True, "is_non_tensor": False}


def _batch_meta(keys: list, rows: Any, partition_id: str, tags: dict) -> BatchMeta:
    cols = [_columns(tags[k]) for k in keys]
    fields = sorted({f for c in cols for f in c})
    schema = {}
    for f in fields:
        first = next((c[f] for c in cols if f in c), None)
        if first is not None:
            schema[f] = _field_schema(first)
    ready = np.array([all(f in c for f in fields) for c in cols], dtype=np.int8)
    return BatchMeta(
        global_indexes=[int(r) for r in rows],
        partition_ids=[partition_id] * len(keys),
        field_schema=schema,
        production_status=ready,
        custom_meta=[_user_tags(tags[k]) for k in keys],
    )


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    raise RuntimeError("call the async_ variant from inside an event loop")


# ---- the key-value module functions --------------------------------------------------------------


def _single_fields(fields: TensorDict | dict | None) -> TensorDict | None:
    if fields is None or isinstance(fields, TensorDict):
        return fields
    if not isinstance(fields, dict):
        raise ValueError("`fields` can only be dict or TensorDict")
    batch = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ValueError("Please use (async)kv_batch_put for batch operation")
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = NonTensorStack(value)
    return TensorDict(batch, batch_size=[1])


def kv_put(
    key: Any, partition_id: str, fields: Any = None, tag: dict | None = None, data_parser: Any = None
) -> KVBatchMeta:
    if fields is None and tag is None:
        raise ValueError("Please provide at least one parameter of fields or tag.")
    return kv_batch_put(
        [key], partition_id, _single_fields(fields), None if tag is None else [tag], data_parser
    )


def kv_batch_put(
    keys: list,
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    if data_parser is not None:
        raise NotImplementedError("data_parser is not supported by msrl_core.compat.transfer_queue")
    return get_client().put(_key_list(keys), partition_id, fields, tags)


def kv_batch_get(keys: Any, partition_id: str, select_fields: Any = None) -> TensorDict:
    fields = [select_fields] if isinstance(select_fields, str) else select_fields
    return get_client().get(_key_list(keys), partition_id, fields)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: Any = None) -> TensorDict:
    if meta.partition_id is None:
        raise ValueError("Must provide partition_id in the input KVBatchMeta.")
    if select_fields is not None:
        wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        if meta.fields is None or any(f not in meta.fields for f in wanted):
            raise ValueError(
                f"Some fields assigned in select_fields not found in the metadata. "
                f"Assigned: {wanted}; Fields in KVBatchMeta: {meta.fields}."
            )
    else:
        wanted = meta.fields
    return kv_batch_get(meta.keys, meta.partition_id, wanted)


def kv_list(partition_id: str | None = None) -> dict[str, dict]:
    return get_client().list_keys(partition_id)


def kv_clear(keys: Any, partition_id: str) -> None:
    get_client().clear(_key_list(keys), partition_id)


async def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await get_client()._call(fn, *args, **kwargs)


async def async_kv_put(
    key: Any, partition_id: str, fields: Any = None, tag: dict | None = None, data_parser: Any = None
) -> KVBatchMeta:
    return await _in_thread(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(
    keys: list,
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    return await _in_thread(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(keys: Any, partition_id: str, select_fields: Any = None) -> TensorDict:
    return await _in_thread(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: Any = None) -> TensorDict:
    return await _in_thread(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict]:
    return await _in_thread(kv_list, partition_id)


async def async_kv_clear(keys: Any, partition_id: str) -> None:
    return await _in_thread(kv_clear, keys, partition_id)


# ---- checkpoints ---------------------------------------------------------------------------------


def save_checkpoint(
    checkpoint_dir: str | Path, *, include_storage: bool = True, metadata: dict | None = None
) -> None:
    """Every partition (keys, tags, bytes) via the dock's own save, plus ``metadata.json``; atomic."""
    if _STATE.get("dock") is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    dock = _STATE["dock"]
    checkpoint_dir = Path(checkpoint_dir)
    tmp = checkpoint_dir.parent / f"{checkpoint_dir.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        partitions = list(dock.partitions())
        for i, p in enumerate(partitions):
            dock.save(p, tmp / f"partition_{i}")
        meta = {"partitions": partitions, "storage_saved": True, "user_metadata": metadata or {}}
        (tmp / _METADATA_FILE).write_text(json.dumps(meta))
        if checkpoint_dir.exists():
            shutil.rmtree(checkpoint_dir)
        tmp.rename(checkpoint_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Replaces every partition by the checkpoint's."""
    if _STATE.get("dock") is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    dock = _STATE["dock"]
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {checkpoint_dir}")
    meta_path = checkpoint_dir / _METADATA_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{_METADATA_FILE} not found in {checkpoint_dir}")
    meta = json.loads(meta_path.read_text())
    _STATE["client"]._settle(None, None)  # put results not read yet show the state before the load
    for p in list(dock.partitions()):
        dock.drop_partition(p)
    for i, p in enumerate(meta["partitions"]):
        dock.create_partition(p)
        dock.load(p, checkpoint_dir / f"partition_{i}")
