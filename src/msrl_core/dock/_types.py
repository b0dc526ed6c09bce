"""Column schema, claim metadata and batch containers of the transfer dock, plus numpy/torch conversion.

Everything that crosses into a backend is numpy: torch tensors become numpy views (bf16 as int16 bits),
and come back as torch views of the numpy results when asked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from msrl_core import _core
from msrl_core.dock import _device
from msrl_core.errors import InvalidArgument

MAX_WAIT_S = 365 * 86400.0  # claim timeouts are clamped to a year: no deadline overflows anywhere


def _storage_table() -> dict[str, np.dtype]:
    """numpy storage dtype of each column dtype of the native table (_core.dock_dtypes, the one dtype
    table of both backends); bfloat16 is stored as its 16 raw bits."""
    table = {}
    for name, size in _core.dock_dtypes():
        dt = np.dtype(np.int16) if name == "bfloat16" else np.dtype(name)
        if dt.itemsize != size:
            raise ImportError(f"dtype {name}: numpy stores {dt.itemsize} bytes, the native table {size}")
        table[name] = dt
    return table


_STORAGE = _storage_table()
DTYPES = tuple(_STORAGE)


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # torch is optional
        return None
    return torch


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


OBJECT = "object"  # an object column: any value per row, encoded by the writer (dock._objects)


def normalize_dtype(dtype: Any) -> str:
    """'float32', np.float32, np.dtype('float32') or torch.float32 -> 'float32'."""
    if dtype is object or dtype == OBJECT:
        return OBJECT
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}, object")
    return name


@dataclass(frozen=True)
class Column:
    """A named field of the dock.

    ``dtype``: one of bool, uint8, int32, int64, float16, bfloat16, float32 (or the numpy/torch dtype),
    or ``"object"``: any Python value per row, encoded by the writing client, decoded by readers.
    ``shape``: per-row shape of a fixed column, e.g. ``()`` for a scalar per row; for a ragged column
    the shape after the ragged first dimension (``()`` for token ids).
    ``ragged``: rows have their own length along the first dimension (stored packed, no padding).
    ``max_len``: ragged only, the expected mean row length used to size each warehouse's arena
    (rows x max_len items); ``max_bytes`` overrides the arena size per warehouse.
    """

    dtype: Any
    shape: tuple[int, ...] = ()
    ragged: bool = False
    max_len: int = 4096
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.dtype == OBJECT:  # stored as ragged bytes, one encoded value per row
            if self.shape:
                raise InvalidArgument(f"an object column has no shape, got {self.shape}")
            object.__setattr__(self, "ragged", True)
        shape = tuple(int(d) for d in self.shape)
        if any(d <= 0 for d in shape):
            raise InvalidArgument(f"Column shape dims must be > 0, got {self.shape}")
        object.__setattr__(self, "shape", shape)
        if self.ragged and self.max_len <= 0:
            raise InvalidArgument(f"Column max_len must be > 0, got {self.max_len}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise InvalidArgument(f"Column max_bytes must be > 0, got {self.max_bytes}")

    @property
    def is_object(self) -> bool:
        return self.dtype == OBJECT

    @property
    def native_dtype(self) -> str:
        """The dtype the native store holds: uint8 bytes for an object column."""
        return "uint8" if self.dtype == OBJECT else self.dtype

    @property
    def storage_dtype(self) -> np.dtype:
        return _STORAGE[self.native_dtype]

    @property
    def item_bytes(self) -> int:
        return int(self.storage_dtype.itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def arena_bytes(self, rows: int) -> int:
        if not self.ragged:
            return 0
        if self.max_bytes is not None:
            return int(self.max_bytes)
        return int(rows) * int(self.max_len) * self.item_bytes


@dataclass(frozen=True)
class Ragged:
    """Variable-length rows packed back to back: row i is ``values[offsets[i]:offsets[i+1]]``."""

    values: Any  # numpy array or torch tensor [total, *inner]
    offsets: Any  # int64 [n + 1]

    @classmethod
    def from_lengths(cls, values: Any, lengths: Any) -> Ragged:
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(values, offsets)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def to_padded(self, pad: Any = 0) -> Padded:
        """Pads on the caller's side (the dock pads natively with ``layout='padded'``)."""
        lens = self.lengths
        width = int(lens.max()) if len(lens) else 0
        vals = np.asarray(self.values) if not is_torch_tensor(self.values) else self.values.numpy()
        out = np.full((len(lens), width, *vals.shape[1:]), pad, dtype=vals.dtype)
        for i in range(len(lens)):
            out[i, : lens[i]] = vals[self.offsets[i] : self.offsets[i + 1]]
        return Padded(out, lens)


@dataclass(frozen=True)
class Padded:
    """Ragged rows padded to the longest: ``values[n, width, *inner]``; ``mask[i, j]`` marks real items."""

    values: Any
    lengths: np.ndarray

    @property
    def mask(self) -> Any:
        width = self.values.shape[1] if self.values.ndim > 1 else 0
        m = np.arange(width)[None, :] < np.asarray(self.lengths)[:, None]
        if is_torch_tensor(self.values):
            return _torch().from_numpy(m).to(self.values.device)  # a small mask: torch's own copy
        return m


@dataclass(frozen=True)
class Claim:
    """Metadata of claimed rows: no tensor bytes. ``rows`` are global row ids (whole groups)."""

    stage: str
    rows: np.ndarray
    _warehouse_of: Any = field(default=None, repr=False, compare=False)
    epoch: int = -1  # the iteration (resets so far) the rows belong to; -1 = unchecked
    claim_id: int = 0  # the claim's identity: release and put check it still holds the rows; 0 = unchecked
    partition: str | None = None  # the partition claimed in (None: the default partition)

    @classmethod
    def _new(
        cls,
        stage: str,
        rows: np.ndarray,
        warehouse_of: Any,
        epoch: int,
        claim_id: int,
        partition: str | None = None,
    ) -> Claim:
        """The claim hot path: one dict update instead of the frozen __init__'s setattr per field."""
        obj = object.__new__(cls)
        d = obj.__dict__
        d.update(
            stage=stage,
            rows=rows,
            _warehouse_of=warehouse_of,
            epoch=epoch,
            claim_id=claim_id,
            partition=partition,
        )
        return obj

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def warehouses(self) -> np.ndarray:
        """Warehouse id of each row."""
        return self._warehouse_of(self.rows)


class Batch(Mapping):
    """Fetched columns of some rows: ``batch["rewards"]`` (dense), ``batch["responses"]`` (Ragged/Padded)."""

    def __init__(
        self,
        rows: np.ndarray,
        data: dict[str, Any],
        epoch: int = -1,
        stage: str | None = None,
        views: frozenset[str] = frozenset(),
        claim_id: int = 0,
        partition: str | None = None,
        row_keys: list[Any] | None = None,
    ):
        self.rows = rows
        self.partition = partition  # the partition of the rows (None: the default partition)
        self.row_keys = row_keys  # the rows' keys when fetched by key (get), else None
        self.claim_id = claim_id  # the Claim's identity when fetched with one (take), else 0
        self._data = data
        self.epoch = epoch
        self.stage = stage  # the claiming stage when fetched with a Claim (take), else None
        # fetch(copy=False): the columns returned as zero-copy views of the warehouse arenas (the
        # others, whose rows were not contiguous in one arena, are one packed copy each).
        self.views = views

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Batch(rows={len(self.rows)}, columns={list(self._data)})"

    def drop(self) -> None:
        """Drops this batch's columns (zero-copy views included: once no other reference to those
        arrays is left, their pin on the iteration is gone and ``reset()`` may run)."""
        self._data = {}
        self.views = frozenset()

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()  # ``with dock.fetch(meta, copy=False) as batch:`` unpins the views at the end


RowsLike = Union[Claim, Batch, Sequence[int], np.ndarray, None]


def epoch_of(rows: Any) -> int:
    """The iteration a Claim/Batch belongs to; -1 (unchecked) for plain row ids."""
    return int(rows.epoch) if isinstance(rows, (Claim, Batch)) else -1


def claim_id_of(rows: Any) -> int:
    """The identity of a Claim (or of the Batch of take()); 0 (unchecked) for plain row ids."""
    return int(rows.claim_id) if isinstance(rows, (Claim, Batch)) else 0


def stage_of(rows: Any) -> str | None:
    """The claiming stage of a Claim (or of a Batch fetched with one); None for plain row ids."""
    return rows.stage if isinstance(rows, (Claim, Batch)) else None


def partition_of(rows: Any) -> str | None:
    """The partition of a Claim/Batch; None for plain row ids (and for the default partition)."""
    return rows.partition if isinstance(rows, (Claim, Batch)) else None


def infer_column(name: str, value: Any) -> Column:
    """The Column a run-time column's first put declares: a dense ``[n, *shape]`` array or tensor is a
    fixed column; a ``Ragged`` / ``(values, offsets)`` / list of per-row arrays is ragged (inner shape
    from its rows); a list of other Python values is an object column."""
    if isinstance(value, Ragged):
        v = value.values
        return Column(_dtype_name(v, name), shape=tuple(v.shape[1:]), ragged=True)
    if is_torch_tensor(value) or isinstance(value, np.ndarray):
        if getattr(value, "is_nested", False):
            raise InvalidArgument(
                f"column '{name}': a nested tensor is converted by the dock's jagged support; pass a Ragged "
                "or a list of rows"
            )
        if value.ndim < 1:
            raise InvalidArgument(f"column '{name}': a put needs one value per row, got a 0-d value")
        if isinstance(value, np.ndarray) and value.dtype == object:
            return Column("object")
        return Column(_dtype_name(value, name), shape=tuple(value.shape[1:]))
    if isinstance(value, (list, tuple)):
        if not value:
            raise InvalidArgument(f"column '{name}': cannot declare a column from an empty list")
        first = value[0]
        if is_torch_tensor(first) or isinstance(first, np.ndarray):
            if first.ndim < 1:
                return Column(_dtype_name(first, name))  # a list of 0-d tensors: one scalar per row
            return Column(_dtype_name(first, name), shape=tuple(first.shape[1:]), ragged=True)
        if all(isinstance(v, (bool, int, float)) for v in value) and not any(
            isinstance(v, bool) for v in value
        ):
            return Column("float32" if any(isinstance(v, float) for v in value) else "int64")
        return Column("object")
    raise InvalidArgument(
        f"column '{name}' is not declared and its type cannot be inferred from {type(value).__name__}: "
        "declare it with Column(...) or pass an array, a list of per-row arrays or a list of objects"
    )


def _dtype_name(x: Any, name: str) -> str:
    try:
        return normalize_dtype(x.dtype)
    except InvalidArgument as e:
        raise InvalidArgument(f"column '{name}': {e}") from None


def rows_array(rows: Any, capacity: int) -> np.ndarray:
    """Claim / Batch / sequence of ints -> int64 array (values are range-checked by the core)."""
    if isinstance(rows, (Claim, Batch)):
        return rows.rows
    if is_torch_tensor(rows):
        rows = rows.numpy()
    arr = np.asarray(rows)
    if arr.ndim != 1:
        raise InvalidArgument(f"rows must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"rows must be integers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= capacity):
        bad = int(arr[(arr < 0) | (arr >= capacity)][0])
        raise InvalidArgument(f"row {bad} out of range [0, {capacity})")
    return arr


# ---- TensorDict (optional) --------------------------------------------------------------------


def is_tensordict(x: Any) -> bool:
    return type(x).__module__.startswith("tensordict") and hasattr(x, "batch_size") and hasattr(x, "keys")


def tensordict_cls() -> Any:
    try:
        from tensordict import TensorDict
    except ImportError:
        raise InvalidArgument("output='tensordict' needs the tensordict package installed") from None
    return TensorDict


def tensordict_to_put(td: Any, columns: Mapping[str, Column]) -> dict[str, Any]:
    """A TensorDict with batch size [n] (n = rows) -> {column: tensor} for put. Dense columns only:
    its first batch dim is the row dim, so ragged columns cannot be expressed row by row."""
    if len(td.batch_size) != 1:
        raise InvalidArgument(
            f"put of a TensorDict needs batch_size [rows], got {list(td.batch_size)}; "
            "reshape it so the only batch dim is the rows"
        )
    out: dict[str, Any] = {}
    for key in td.keys():  # noqa: SIM118 (iterating a TensorDict walks its batch dim, not its keys)
        if not isinstance(key, str):
            raise InvalidArgument(f"put of a TensorDict takes top-level keys only, got nested key {key!r}")
        col = columns.get(key)
        if col is not None and col.ragged:
            raise InvalidArgument(
                f"column '{key}' is ragged: put it as a list of rows, a Ragged or (values, offsets), "
                "not inside a TensorDict (whose batch dim makes every row the same length)"
            )
        value = td.get(key)
        if is_tensordict(value):
            raise InvalidArgument(f"put of a TensorDict: key '{key}' holds a nested TensorDict")
        out[key] = value
    if not out:
        raise InvalidArgument("put of an empty TensorDict")
    return out


def check_tensordict_keys(names: Sequence[str], columns: Mapping[str, Column]) -> None:
    """Refuses a fetch whose ragged column's ``<name>_mask`` would collide with another fetched column."""
    for name in names:
        col = columns.get(name)
        if col is not None and col.ragged and f"{name}_mask" in names:
            raise InvalidArgument(
                f"output='tensordict': the mask of ragged column '{name}' would be stored as '{name}_mask', "
                "which is also a fetched column; fetch them separately"
            )


def to_tensordict(data: Mapping[str, Any], n: int) -> Any:
    """Fetched torch outputs -> TensorDict(batch_size=[n]): dense columns as they are, ragged columns
    as padded values under their name plus a bool ``<name>_mask`` [n, width]."""
    td_cls = tensordict_cls()
    torch = _torch()
    fields: dict[str, Any] = {}
    for name, val in data.items():
        if isinstance(val, Padded):
            fields[name] = val.values
            fields[f"{name}_mask"] = torch.from_numpy(np.ascontiguousarray(np.asarray(val.mask)))
        else:
            fields[name] = val
    return td_cls(fields, batch_size=[n])


# ---- input conversion -------------------------------------------------------------------------


def _as_numpy(x: Any, name: str, col: Column) -> np.ndarray:
    """A tensor/array for column ``col`` as a C-contiguous numpy array of its storage dtype.

    Arrays and tensors must already have the column's dtype (no silent casts); Python lists of scalars
    are converted.
    """
    if is_torch_tensor(x):
        got = str(x.dtype).replace("torch.", "")
        if got != col.dtype:
            raise InvalidArgument(f"column '{name}': expected dtype {col.dtype}, got torch.{got}")
        if _device.is_device_tensor(x):  # device -> pinned host staging through the copy engine
            return _device.device_to_numpy(x, col.storage_dtype)
        x = x.contiguous()
        if col.dtype == "bfloat16":
            x = x.view(_torch().int16)
        return x.numpy()
    if isinstance(x, np.ndarray):
        got = x.dtype.name
        ok = got == col.dtype or (col.dtype == "bfloat16" and got in ("int16", "uint16"))
        if not ok:
            raise InvalidArgument(f"column '{name}': expected dtype {col.dtype}, got numpy {got}")
        return np.ascontiguousarray(x).view(col.storage_dtype)
    if col.dtype == "bfloat16":
        raise InvalidArgument(f"column '{name}': bfloat16 values must be a torch tensor or int16 bit array")
    try:
        return np.ascontiguousarray(np.asarray(x, dtype=col.storage_dtype))
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"column '{name}': cannot convert {type(x).__name__} to {col.dtype}: {e}"
        ) from None


def to_put_input(name: str, col: Column, value: Any) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Returns (values, lengths or None, number of rows) for one column of a put."""
    if col.ragged:
        if isinstance(value, Ragged) or (
            isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], (int, float))
        ):
            vals, offsets = (value.values, value.offsets) if isinstance(value, Ragged) else value
            offsets = np.asarray(offsets.numpy() if is_torch_tensor(offsets) else offsets)
            if offsets.ndim != 1 or len(offsets) < 1 or offsets.dtype.kind not in "iu":
                raise InvalidArgument(
                    f"column '{name}': offsets must be a 1-D integer array of n + 1 entries"
                )
            offsets = offsets.astype(np.int64, copy=False)
            lengths = np.diff(offsets)
            if offsets[0] != 0 or (lengths < 0).any():
                raise InvalidArgument(f"column '{name}': offsets must start at 0 and never decrease")
            arr = _as_numpy(vals, name, col)
            if arr.ndim < 1 or int(offsets[-1]) != arr.shape[0]:
                raise InvalidArgument(
                    f"column '{name}': offsets end at {int(offsets[-1])} but values have "
                    f"{arr.shape[0] if arr.ndim else 0} items"
                )
            _check_inner(name, col, arr.shape[1:])
            return arr, np.ascontiguousarray(lengths), len(lengths)
        if isinstance(value, (list, tuple)):
            if isinstance(value, list) and col.dtype != "bfloat16":
                # One native call when every row is already a C-contiguous array of the column's dtype.
                packed = _core.dock_pack_rows(value, col.storage_dtype, list(col.shape))
                if packed is not None:
                    return packed[0], packed[1], len(value)
            parts = [_as_numpy(v, name, col) for v in value]
            for p in parts:
                if p.ndim < 1:
                    raise InvalidArgument(
                        f"column '{name}' is ragged: each row needs a first dimension, got a scalar"
                    )
                _check_inner(name, col, p.shape[1:])
            lengths = np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts))
            if parts:
                arr = np.concatenate(parts) if len(parts) > 1 else parts[0]
            else:
                arr = np.empty((0, *col.shape), dtype=col.storage_dtype)
            return np.ascontiguousarray(arr), lengths, len(parts)
        raise InvalidArgument(
            f"column '{name}' is ragged: pass a list of per-row arrays, a Ragged or (values, offsets); "
            f"got {type(value).__name__}"
        )
    arr = _as_numpy(value, name, col)
    if arr.ndim != 1 + len(col.shape) or tuple(arr.shape[1:]) != col.shape:
        raise InvalidArgument(
            f"column '{name}': expected shape (n, {', '.join(map(str, col.shape))}"
            f"{',' if len(col.shape) == 1 else ''}) per put, got {tuple(arr.shape)}"
        )
    return arr, None, arr.shape[0]


def _check_inner(name: str, col: Column, inner: tuple[int, ...]) -> None:
    if tuple(inner) != col.shape:
        raise InvalidArgument(
            f"column '{name}': rows must have shape (len, *{col.shape}), got inner shape {inner}"
        )


# ---- output conversion ------------------------------------------------------------------------


def to_output(arr: np.ndarray, col: Column, output: str, share: bool = False) -> Any:
    """numpy as is, or a torch tensor over the same memory. A read-only array is copied for torch unless
    ``share`` (zero-copy views: torch has no read-only tensors, the caller must not write them)."""
    if output == "numpy":
        return arr
    torch = _torch()
    if torch is None:
        raise InvalidArgument("output='torch' needs torch installed")
    if not arr.flags.writeable and not share:
        arr = arr.copy()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    if col.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t
