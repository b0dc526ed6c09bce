"""TransferQueue storage backend ``"MsrlDock"``: TransferQueue's byte store on a Ray-backend msrl_core Dock.

TransferQueue (TQ) 0.1.11 selects its byte store by name through two in-process registries:
``StorageBootstrapProvider.register_provider(name)`` (run once, in the process whose ``tq.init(conf)``
comes first: it creates the storage and writes its connection info into ``conf.backend[name]``, which TQ's
controller keeps and hands to every process that attaches later) and ``StorageManagerFactory.register(name)``
(the per-process client that ``put``s, ``get``s and ``clear``s rows). Importing this module registers both
under ``"MsrlDock"``; ``register`` does that import in every Ray process when named as Ray's
``worker_process_setup_hook``. A config then switches TQ (and verl, which passes its ``transfer_queue``
block to ``tq.init``) to the dock::

    backend:
      storage_backend: MsrlDock
      MsrlDock: {capacity: 100000, warehouses: 2}

What stays TransferQueue's: its controller allocates the global indexes, keeps keys, tags, field schema,
production/consumption status and samplers, and tells the storage which rows to write, read and clear.
MsrlDock stores and returns rows by those indexes: one dock partition (``PARTITION``) whose int keys are
TQ's global indexes, every put an upsert (``overwrite=True``: field additions and partial rewrites; an index
the controller reuses after a clear just gets new cells), clears erase the keys (rows and bytes reused),
checkpoints are the dock's own ``save``/``load`` of that partition (exact: keys, bytes, written cells).

Per TQ field one dock column, named ``"<field>::<kind>"`` after what the put held, so a field may change
type between partitions or after a clear (dock columns are dock-wide and typed once):

- tensors: ``t.<dtype>.<ndim>[.<d1>x<d2>...]`` — ``ndim`` of one sample; 0-d samples are a fixed column,
  samples with a first dimension a ragged one (the trailing dims in the name). A dense ``[B, L]`` field and a
  jagged NestedTensor both land as ragged rows without copies; dtypes the dock does not store natively
  (float64, int16, ...) go as their raw bytes (``uint8`` rows with a trailing ``itemsize`` dim);
- everything else (NonTensorStack, lists, numpy string/object arrays, and tensors whose samples differ in
  their trailing dims): ``obj``, encoded by the writing client with the dock's object codec
  (``msrl_core.dock._objects``: safe types without pickle, others as pickle authenticated with a secret of
  this dock; no actor or socket of the dock ever decodes a row).

The column of each (index, field) travels in TQ's ``custom_backend_meta`` (kept by TQ's controller and
returned in every ``BatchMeta``), so a read never guesses. Reads rebuild exactly what SimpleStorage returns
(TQ's own ``_pack_field_values`` rules): 0-d samples stacked dense, samples with a first dimension as a
jagged NestedTensor (built on the fetched values, no per-sample copies), objects as a NonTensorStack.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

try:
    import torch
    from omegaconf import DictConfig, OmegaConf
    from tensordict import NonTensorStack, TensorDict
    from transfer_queue.metadata import BatchMeta, extract_field_schema
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "msrl_core.integrations.transfer_queue needs transferqueue==0.1.11 (and its torch, tensordict, "
        "omegaconf): pip install 'msrl_core[tq]'"
    ) from exc

from msrl_core.dock import Dock, Ragged
from msrl_core.dock._objects import ObjectCodec
from msrl_core.errors import InvalidArgument, NotFound

__all__ = ["BACKEND_NAME", "PARTITION", "SUPPORTED_TQ_VERSIONS", "MsrlDockStorageManager", "register"]

BACKEND_NAME = "MsrlDock"
# The one dock partition that holds every TransferQueue partition's rows (keys: TQ global indexes).
PARTITION = "transfer_queue"
# Versions whose StorageManager / bootstrap-provider contract this module is written and tested against.
SUPPORTED_TQ_VERSIONS = ("0.1.11",)
# The keys users may set under backend.MsrlDock, with their defaults: capacity = rows (samples) the dock
# holds at once (TQ's indexes in use plus the ones its controller freed without clearing storage);
# warehouses = Ray warehouse actors holding the bytes.
CONFIG_DEFAULTS: dict[str, int] = {"capacity": 100_000, "warehouses": 2}
# Keys the bootstrap provider writes for the managers (not for users).
_HANDLE_KEYS = ("dock", "codec", "dock_id")
_CHECKPOINT_SUBDIR = "msrl_dock"

# Dtypes the dock stores natively (msrl_core.Column); others are stored as their raw bytes.
_NATIVE = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}
_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_OBJ = "obj"

# Docks this process created through the bootstrap provider, by dock_id: their manager here shuts them
# down on close (tq.close() tears down only SimpleStorage, MooncakeStore and Yuanrong resources itself).
_OWNED: dict[str, Any] = {}
_OWNED_LOCK = threading.Lock()


def _check_version() -> str:
    version = importlib.metadata.version("transferqueue")
    if version not in SUPPORTED_TQ_VERSIONS:
        raise ImportError(
            f"msrl_core's MsrlDock backend supports transferqueue {', '.join(SUPPORTED_TQ_VERSIONS)} "
            f"(its StorageManager and bootstrap-provider contract); found transferqueue {version}. "
            f"Install transferqueue=={SUPPORTED_TQ_VERSIONS[-1]}."
        )
    return version


TQ_VERSION = _check_version()


def register() -> None:
    """Registers ``"MsrlDock"`` with TransferQueue's registries (done at import; idempotent).

    Name it as Ray's ``worker_process_setup_hook`` (``"msrl_core.integrations.transfer_queue.register"``)
    so that every Ray worker process has the backend before it attaches to TransferQueue."""
    StorageManagerFactory.register(BACKEND_NAME)(MsrlDockStorageManager)
    StorageBootstrapProvider.register_provider(BACKEND_NAME)(bootstrap)


# ---- config -----------------------------------------------------------------------------------


def _user_options(block: Any) -> dict[str, int]:
    """Validated user keys of backend.MsrlDock (unknown keys and bad values raise, naming them)."""
    raw = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) else dict(block or {})
    assert isinstance(raw, dict)
    unknown = sorted(str(k) for k in raw if k not in CONFIG_DEFAULTS and k not in _HANDLE_KEYS)
    if unknown:
        raise ValueError(
            f"backend.{BACKEND_NAME}: unknown key(s) {unknown}; allowed: {sorted(CONFIG_DEFAULTS)}"
        )
    opts = dict(CONFIG_DEFAULTS)
    for key in CONFIG_DEFAULTS:
        if raw.get(key) is None:
            continue
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"backend.{BACKEND_NAME}.{key} must be a positive integer, got {value!r}")
        opts[key] = value
    return opts


def bootstrap(conf: DictConfig) -> dict[str, Any]:
    """TQ's bootstrap provider for MsrlDock: creates the Ray-backend dock, publishes its handle.

    Runs once, in the process whose ``tq.init(conf)`` is first (Ray already initialized there). The dock
    handle, its object codec and an id go into ``conf.backend.MsrlDock`` — TQ's controller stores that config
    (``allow_objects``) and hands it to every process that attaches with ``tq.init()``."""
    if BACKEND_NAME not in conf.backend or conf.backend[BACKEND_NAME] is None:
        conf.backend[BACKEND_NAME] = {}
    opts = _user_options(conf.backend[BACKEND_NAME])
    # Typed Any: the keyed calls (create_partition, put(keys=...), get, erase, save/load) are issue 14's.
    dock: Any = Dock(
        columns={},
        stages={},
        capacity=opts["capacity"],
        warehouses=opts["warehouses"],
        backend="ray",
        output="torch",
    )
    dock.create_partition(PARTITION)
    dock_id = uuid.uuid4().hex
    with _OWNED_LOCK:
        _OWNED[dock_id] = dock
    block = conf.backend[BACKEND_NAME]
    block.dock = dock
    block.codec = ObjectCodec.new(allow_pickle=True)
    block.dock_id = dock_id
    return {"dock": dock, "dock_id": dock_id}


# ---- TQ field <-> dock column ---------------------------------------------------------------


def _tensor_kind(dtype: torch.dtype, ndim: int, trail: tuple[int, ...]) -> str:
    kind = f"t.{str(dtype).removeprefix('torch.')}.{ndim}"
    return kind + ("." + "x".join(map(str, trail)) if trail else "")


def _parse_kind(column: str) -> tuple[str, torch.dtype | None, int, tuple[int, ...]]:
    """``"<field>::t.<dtype>.<ndim>[.<trail>]"`` or ``"<field>::obj"`` -> (field, dtype, ndim, trail)."""
    field, sep, kind = column.rpartition("::")
    if not sep:
        raise InvalidArgument(f"{BACKEND_NAME}: {column!r} is not a column this backend wrote")
    if kind == _OBJ:
        return field, None, 0, ()
    parts = kind.split(".")
    if parts[0] != "t" or len(parts) not in (3, 4) or parts[1] not in _BY_NAME:
        raise InvalidArgument(f"{BACKEND_NAME}: {column!r} is not a column this backend wrote")
    trail = tuple(int(d) for d in parts[3].split("x")) if len(parts) == 4 else ()
    return field, _BY_NAME[parts[1]], int(parts[2]), trail


def _to_storage(values: torch.Tensor) -> torch.Tensor:
    """Values in a dtype the dock stores: native ones as they are, others as raw bytes (trailing itemsize)."""
    values = values.detach().cpu().contiguous()
    if values.dtype in _NATIVE:
        return values
    return values.unsqueeze(-1).view(torch.uint8)


def _from_storage(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in _NATIVE:
        return values if values.dtype == dtype else values.view(dtype)
    return values.contiguous().view(dtype).squeeze(-1)


def _tensor_rows(value: torch.Tensor, n: int) -> tuple[str, Any] | None:
    """(kind, dock value) for a tensor field of n samples; None when its samples differ in trailing dims."""
    if value.is_nested:
        njt: Any = value  # a torch.nested jagged tensor: values(), offsets(), _lengths, _ragged_idx
        if value.layout == torch.jagged and njt._ragged_idx == 1 and njt._lengths is None:
            values, offsets = njt.values(), njt.offsets()
        else:
            parts = value.unbind()
            trails = {tuple(p.shape[1:]) for p in parts}
            if len(trails) != 1 or parts[0].dim() == 0:
                return None
            values = torch.cat([p.reshape(p.shape[0], *p.shape[1:]) for p in parts])
            offsets = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0)
        trail = tuple(values.shape[1:])
        if any(d == 0 for d in trail):
            return None
        kind = _tensor_kind(value.dtype, 1 + len(trail), trail)
        return kind, Ragged(_to_storage(values), offsets.to(torch.int64).cpu().numpy())
    if value.dim() == 1:
        return _tensor_kind(value.dtype, 0, ()), _to_storage(value)
    trail = tuple(value.shape[2:])
    if any(d == 0 for d in trail):
        return None
    length = value.shape[1]
    values = value.reshape(n * length, *trail)
    return _tensor_kind(value.dtype, value.dim() - 1, trail), Ragged.from_lengths(
        _to_storage(values), np.full(n, length, np.int64)
    )


def _samples(value: Any, n: int) -> list[Any]:
    """Per-sample values of a non-tensor field, as SimpleStorage holds them."""
    if isinstance(value, NonTensorStack):
        items = value.tolist()
    elif isinstance(value, torch.Tensor):
        items = list(value.unbind())
    elif isinstance(value, TensorDict):
        items = [value[i] for i in range(n)]
    else:
        items = list(value)
    if len(items) != n:
        raise InvalidArgument(f"{BACKEND_NAME}: a field holds {len(items)} samples, the batch has {n}")
    return items


def encode_fields(data: TensorDict, n: int, codec: ObjectCodec) -> tuple[dict[str, Any], dict[str, str]]:
    """(dock columns to put, field -> column) for one TQ put of n samples."""
    columns: dict[str, Any] = {}
    chosen: dict[str, str] = {}
    for key in data.keys():  # noqa: SIM118 (iterating a TensorDict walks its batch, not its keys)
        field = str(key)
        value = data[key]
        encoded = _tensor_rows(value, n) if isinstance(value, torch.Tensor) else None
        if encoded is None:
            raw, lengths = codec.encode(_samples(value, n), f"{field}::{_OBJ}")
            encoded = (_OBJ, Ragged.from_lengths(raw, lengths))
        kind, put_value = encoded
        column = f"{field}::{kind}"
        columns[column] = put_value
        chosen[field] = column
    return columns, chosen


def _torch(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def decode_column(column: str, got: Any, codec: ObjectCodec) -> tuple[str, Any]:
    """A fetched dock column -> (kind, value): ("dense", tensor [m]) for 0-d samples, ("jagged",
    NestedTensor [m, j, ...]) for samples with a first dimension, ("list", per-sample values) otherwise."""
    field, dtype, ndim, _ = _parse_kind(column)
    if dtype is None:
        return "list", codec.decode(np.asarray(got.values), np.asarray(got.offsets), column)
    if ndim == 0:
        return "dense", _from_storage(_torch(got), dtype)
    values = _from_storage(_torch(got.values), dtype)
    offsets = _torch(got.offsets).to(torch.int64)
    lengths = np.diff(np.asarray(got.offsets))
    # With the row lengths' bounds, as torch.nested.as_nested_tensor (SimpleStorage) has them:
    # to_padded_tensor() then pads to the longest row (verl's readers call it), not to the total.
    bounds: dict[str, Any] = {}
    if len(lengths):
        bounds = {"min_seqlen": int(lengths.min()), "max_seqlen": int(lengths.max())}
    return "jagged", torch.nested.nested_tensor_from_jagged(values, offsets, **bounds)


def _per_sample(kind: str, value: Any) -> list[Any]:
    if kind == "list":
        return list(value)
    return list(value.unbind())


def pack_field(parts: list[tuple[list[int], str, Any]], n: int) -> Any:
    """One TQ field from its parts (positions in the batch, decoded kind, value), packed as SimpleStorage
    packs it."""
    if len(parts) == 1 and parts[0][1] in ("dense", "jagged"):
        return parts[0][2]
    samples: list[Any] = [None] * n
    for positions, kind, value in parts:
        for pos, sample in zip(positions, _per_sample(kind, value)):
            samples[pos] = sample
    return AsyncSimpleStorageManager._pack_field_values(samples)


def erase_present(dock: Any, keys: list, partition: str) -> None:
    """Erases those of ``keys`` the partition holds (TQ's clears are idempotent and include indexes that
    never got data, such as tag-only keys; the dock's erase refuses unknown keys as a whole)."""
    if not keys:
        return
    try:
        dock.erase(keys, partition=partition)
    except NotFound:
        present = set(dock.keys(partition=partition))
        known = [k for k in keys if k in present]
        if known:
            dock.erase(known, partition=partition)


# ---- the storage manager ----------------------------------------------------------------------


@StorageManagerFactory.register(BACKEND_NAME)
class MsrlDockStorageManager(StorageManager):
    """TQ's per-process storage client for MsrlDock (see the module docstring)."""

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None):
        missing = [k for k in _HANDLE_KEYS if config is None or config.get(k) is None]
        if missing:
            raise ValueError(
                f"backend.{BACKEND_NAME} has no {', '.join(missing)}: the MsrlDock bootstrap provider writes "
                f"them at the first tq.init(conf) with backend.storage_backend={BACKEND_NAME}; that process "
                "must import msrl_core.integrations.transfer_queue (or run its register()) before tq.init"
            )
        super().__init__(controller_info, config, zmq_context=zmq_context)
        self.dock: Any = config.get("dock")
        self.codec: ObjectCodec = config.get("codec")
        self.dock_id: str = str(config.get("dock_id"))
        # Dock calls block (natively, GIL released): they run here, off TQ's event loop.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="msrl-dock-tq")

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def put_data(
        self, data: TensorDict, metadata: BatchMeta, data_parser: Callable[[Any], Any] | None = None
    ) -> None:
        if data_parser is not None:
            raise NotImplementedError(
                f"data_parser runs inside SimpleStorage's units; the {BACKEND_NAME} backend takes none "
                "(parse the data before the put)"
            )
        n = metadata.size
        if n == 0:
            return
        if data.batch_size[0] != n:
            raise ValueError(f"{BACKEND_NAME}: put of {data.batch_size[0]} samples for {n} global indexes")
        keys = [int(i) for i in metadata.global_indexes]
        columns, chosen = encode_fields(data, n, self.codec)
        if columns:
            await self._call(self.dock.put, columns, keys=keys, partition=PARTITION, overwrite=True)
        backend_meta = {k: dict(chosen) for k in keys}
        await self.notify_data_update(
            metadata.partition_ids[0], keys, extract_field_schema(data), backend_meta
        )

    async def get_data(self, metadata: BatchMeta) -> TensorDict:
        n = metadata.size
        if n == 0:
            return TensorDict({}, batch_size=0)
        fields = list(metadata.field_names)
        keys = [int(i) for i in metadata.global_indexes]
        backend_meta = metadata._custom_backend_meta
        # Samples grouped by the columns that hold their fields (one group unless a field changed type).
        groups: dict[tuple[str, ...], list[int]] = {}
        for pos in range(n):
            meta = backend_meta[pos] if pos < len(backend_meta) else {}
            cols: list[str] = []
            for field in fields:
                col = meta.get(field) if meta else None
                if col is None:
                    raise NotFound(
                        f"{BACKEND_NAME}: field {field!r} of global index {keys[pos]} has no stored column "
                        f"(it was not written through {BACKEND_NAME})"
                    )
                cols.append(col)
            groups.setdefault(tuple(cols), []).append(pos)
        parts: dict[str, list[tuple[list[int], str, Any]]] = {f: [] for f in fields}
        for group_cols, positions in groups.items():
            wanted = sorted(set(group_cols))
            batch = await self._call(
                self.dock.get, [keys[p] for p in positions], wanted, partition=PARTITION, output="torch"
            )
            for field, col in zip(fields, group_cols):
                kind, value = decode_column(col, batch[col], self.codec)
                parts[field].append((positions, kind, value))
        return TensorDict({f: pack_field(parts[f], n) for f in fields}, batch_size=n)

    async def clear_data(self, metadata: BatchMeta) -> None:
        if metadata.size == 0:
            return
        keys = [int(i) for i in metadata.global_indexes]
        await self._call(erase_present, self.dock, keys, PARTITION)

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        await self._call(self.dock.save, PARTITION, Path(checkpoint_dir) / _CHECKPOINT_SUBDIR)

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        directory = Path(checkpoint_dir) / _CHECKPOINT_SUBDIR
        if not directory.is_dir():
            raise FileNotFoundError(f"{BACKEND_NAME} checkpoint not found: {directory}")

        def restore() -> None:
            self.dock.clear(PARTITION)
            self.dock.load(PARTITION, directory)

        await self._call(restore)

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        with _OWNED_LOCK:
            owned = _OWNED.pop(getattr(self, "dock_id", ""), None)
        if owned is not None:
            with contextlib.suppress(Exception):
                owned.shutdown()
        super().close()


StorageBootstrapProvider.register_provider(BACKEND_NAME)(bootstrap)
