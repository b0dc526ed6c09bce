"""The keyed store of msrl_core.Dock: partitions, keys, field updates, erase, tags and checkpoints.

Every rule lives in the native control plane (``DockCore``, both backends); this mixin converts Python
values (keys ``str | int``, tags as JSON text, object columns encoded by the writer) and names errors.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from msrl_core.dock import _objects
from msrl_core.dock._jagged import ObjectValues, from_nested, is_nested
from msrl_core.dock._types import Column, Ragged, infer_column, is_tensordict, rows_array, to_put_input
from msrl_core.errors import InvalidArgument, NotFound

_CHECKPOINT_VERSION = 1


def _keys_list(keys: Any) -> list[Any]:
    if isinstance(keys, (str, int, np.integer)):
        return [keys]
    if isinstance(keys, np.ndarray):
        return keys.tolist()
    try:
        return list(keys)
    except TypeError:
        raise InvalidArgument(
            f"keys must be a str, an int or a sequence of them, got {type(keys).__name__}"
        ) from None


def _tags_json(tags: Any, n: int) -> list[list[tuple[str, str]]]:
    """One dict for all keys, or one per key -> per key [(name, JSON text)] (never pickled)."""
    per_key = [tags] * n if isinstance(tags, Mapping) else list(tags)
    if len(per_key) != n:
        raise InvalidArgument(f"tags: {len(per_key)} dicts for {n} keys (give one dict, or one per key)")
    out = []
    for i, t in enumerate(per_key):
        if not isinstance(t, Mapping):
            raise InvalidArgument(f"tags[{i}] must be a dict, got {type(t).__name__}")
        items = []
        for name, value in t.items():
            if not isinstance(name, str):
                raise InvalidArgument(f"tag names must be str, got {name!r}")
            try:
                items.append((name, json.dumps(value)))
            except (TypeError, ValueError) as e:
                raise InvalidArgument(
                    f"tag {name!r} of key #{i}: {type(value).__name__} is not JSON-able ({e}); tags hold "
                    "None/bool/int/float/str and lists/dicts of them"
                ) from None
        out.append(items)
    return out


def _tags_dict(items: list[tuple[str, str]]) -> dict[str, Any]:
    return {name: json.loads(text) for name, text in items}


class KeyedMixin:
    """Partition and key methods of Dock (see docs/dock.md, "The keyed store")."""

    columns: dict[str, Column]
    _column_ids: dict[str, int]
    _backend: Any
    capacity: int
    group_size: int

    def _init_keyed(self) -> None:
        self._cols_lock = threading.Lock()

    # ---- columns declared at run time ----------------------------------------------------------

    def _column(self, name: str, value: Any = None, declare: bool = True) -> tuple[int, Column]:
        """The id and Column of ``name``: known here, declared by another handle, or (value given)
        declared now from the value's type (``declare=False``: id -1 and the inferred Column, nothing
        declared yet). Unknown without a value: NotFound."""
        cid = self._column_ids.get(name)
        if cid is not None:
            return cid, self.columns[name]
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"column names must be non-empty str, got {name!r}")
        with self._cols_lock:
            cid = self._column_ids.get(name)
            if cid is not None:
                return cid, self.columns[name]
            info = self._backend.column_info(name)
            if info is not None and info[2]:
                col = _column_of_tuple(info[1])
            elif value is None:
                known = ", ".join(self.columns) or "(none)"
                raise NotFound(f"unknown column '{name}'; columns are: {known}")
            else:
                col = infer_column(name, value)
                if not declare:
                    return -1, col
            return self._declare(name, col), col

    def _declare(self, name: str, col: Column) -> int:
        cid = self._backend.declare_column(name, col)  # checks a concurrent declaration natively
        self.columns = {**self.columns, name: col}
        self._column_ids = {**self._column_ids, name: cid}
        return cid

    def _inputs(self, data: Mapping[str, Any]) -> tuple[list[tuple], int | None]:
        """Put values -> native inputs (column id, values, lengths) and the row count (None: no columns).
        Run-time columns are declared once every value converted (a bad value declares nothing)."""
        inputs: list[tuple] = []
        n: int | None = None
        fresh: list[tuple[int, str, Column]] = []
        for name, value in data.items():
            if is_nested(value):
                value = Ragged.from_lengths(*from_nested(value, name))
            cid, col = self._column(name, value, declare=False)
            if cid < 0:
                fresh.append((len(inputs), name, col))
            lengths: np.ndarray | None
            if col.is_object:
                if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
                    raise InvalidArgument(
                        f"object column '{name}' takes a list of values (one per row), "
                        f"got {type(value).__name__}"
                    )
                vals, lengths = _objects.encode(list(value), name, getattr(self, "object_codec", None))
                count = len(lengths)
            else:
                if isinstance(value, ObjectValues):
                    raise InvalidArgument(f"column '{name}' is {col.dtype}, not an object column")
                vals, lengths, count = to_put_input(name, col, value)
            if n is None:
                n = count
            elif count != n:
                raise InvalidArgument(f"column '{name}' has {count} rows, other columns of this put have {n}")
            inputs.append((cid, vals, lengths))
        for k, name, col in fresh:
            with self._cols_lock:
                have = self._column_ids.get(name)
                # A concurrent declaration: the native check decides.
                cid = self._declare(name, col) if have is None or self.columns[name] != col else have
            inputs[k] = (cid, *inputs[k][1:])
        return inputs, n

    # ---- partitions -------------------------------------------------------------------------------

    def _pid(self, partition: str | None, create: bool = False) -> int:
        if partition is None:
            return 0
        if not isinstance(partition, str) or not partition:
            raise InvalidArgument(
                f"partition must be a non-empty str (or None: the default), got {partition!r}"
            )
        return self._backend.partition(partition, create)

    def create_partition(self, partition: str) -> None:
        """Creates a partition (a no-op when it exists). Puts and tags create partitions on first use."""
        self._pid(partition, create=True)

    def partitions(self) -> list[str]:
        """The live named partitions (the default partition ``None`` is not listed)."""
        return self._backend.partition_names()

    def clear(self, partition: str) -> None:
        """Erases every key of the partition (rows and bytes reused at once); claims of its stages and
        their consumption are gone, and Claims from before are stale. The partition stays."""
        self._backend.clear(self._pid(partition))

    def drop_partition(self, partition: str) -> None:
        """``clear`` and forgets the name."""
        self._backend.drop_partition(self._pid(partition))

    # ---- keys --------------------------------------------------------------------------------------

    def _put_keys(
        self, data: Mapping[str, Any], partition: str, keys: Any, overwrite: bool, tags: Any, version: Any
    ) -> np.ndarray:
        keys = _keys_list(keys)
        if not keys:
            raise InvalidArgument("put(keys=...) needs at least one key")
        if is_tensordict(data):
            from msrl_core.dock._jagged import tensordict_to_columns

            data = tensordict_to_columns(data)
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"put takes a mapping of column name -> values, got {type(data).__name__}")
        inputs, n = self._inputs(data)
        if n is not None and n != len(keys):
            raise InvalidArgument(f"put of {n} rows of data for {len(keys)} keys")
        tag_items = None if tags is None else _tags_json(tags, len(keys))
        versions: list[int] = []
        if version is not None:
            v = np.asarray(version)
            if v.ndim == 0:
                v = np.full(len(keys), int(v), np.int64)
            if v.shape != (len(keys),) or v.dtype.kind not in "iu":
                raise InvalidArgument(f"version must be an int or one int per key, got {version!r}")
            versions = v.astype(np.int64).tolist()
        p = self._pid(partition, create=True)
        return self._backend.put_keys(p, keys, inputs, bool(overwrite), tag_items, versions)

    def rows_of(self, keys: Any, *, partition: str) -> np.ndarray:
        """Row ids of keys (NotFound naming the first unknown key)."""
        return self._backend.rows_of(self._pid(partition), _keys_list(keys))

    def keys_of(self, rows: Any, *, partition: str) -> list[Any]:
        """Keys of rows (NotFound for a row without a key in the partition)."""
        return self._backend.keys_of(self._pid(partition), rows_array(rows, self.capacity))

    def keys(self, *, partition: str) -> list[Any]:
        """The partition's keys, in row order."""
        return self._backend.list_keys(self._pid(partition))[0]

    def written(self, keys: Any, columns: Sequence[str], *, partition: str) -> np.ndarray:
        """bool ``[len(keys), len(columns)]``: which cells are written."""
        cids = [self._column(c)[0] for c in ([columns] if isinstance(columns, str) else columns)]
        return self._backend.written(self._pid(partition), _keys_list(keys), cids)

    def erase(self, keys: Any, *, partition: str) -> None:
        """Erases keys: their rows, bytes, readiness, tags and claims on them go; rows and bytes are
        reused at once. Unknown key: NotFound, nothing erased. Refused (InvalidArgument, nothing erased)
        while a put to one of the rows is in flight or zero-copy views are alive."""
        self._backend.erase_keys(self._pid(partition), _keys_list(keys))

    def drop(self, meta: Any, *, partition: str | None = None) -> None:
        """Filters rows out (e.g. DAPO's dynamic sampling): a Claim/Batch, row ids, or keys (with
        ``partition``). The rows are erased: no stage sees them again."""
        from msrl_core.dock._types import Batch, Claim

        if isinstance(meta, (Claim, Batch)):
            if partition is not None and meta.partition != partition:
                raise InvalidArgument(
                    f"drop: the claim is of partition {meta.partition!r}, not {partition!r}"
                )
            self._backend.erase_rows(self._pid(meta.partition), meta.rows)
            return
        if partition is not None:
            self._backend.erase_keys(self._pid(partition), _keys_list(meta))
            return
        self._backend.erase_rows(0, rows_array(meta, self.capacity))

    # ---- tags ----------------------------------------------------------------------------------------

    def tag(self, keys: Any, tags: Any, *, partition: str) -> None:
        """Upserts tags: one dict for every key, or one per key, merged into each key's tags by name.
        Values must be JSON-able (stored as JSON text natively, never pickled). An unknown key is
        created without data (it gets a row)."""
        keys = _keys_list(keys)
        items = _tags_json(tags, len(keys))
        self._backend.tag(self._pid(partition, create=True), keys, items)

    def tags(self, *, partition: str, keys: Any = None) -> dict[Any, dict[str, Any]]:
        """``{key: tags}`` of the partition (or of ``keys``), keys without tags as ``{}``."""
        ks, _rows, items = self._backend.list_keys(self._pid(partition))
        out = {k: _tags_dict(t) for k, t in zip(ks, items)}
        if keys is None:
            return out
        want = _keys_list(keys)
        for k in want:
            if k not in out:
                raise NotFound(f"unknown key {k!r} in partition '{partition}'")
        return {k: out[k] for k in want}

    def list(self, partition: str | None = None) -> dict[str, dict[Any, dict[str, Any]]]:
        """``{partition: {key: tags}}`` of one or every partition (TransferQueue's kv_list shape)."""
        names = self.partitions() if partition is None else [partition]
        return {p: self.tags(partition=p) for p in names}

    # ---- checkpoint --------------------------------------------------------------------------------

    def save(self, partition: str, directory: str | os.PathLike) -> None:
        """Writes the partition — keys, tags, written cells with their bytes (object columns as their
        encoded bytes) and column types — to ``directory`` (replaced atomically via ``directory.tmp``).
        JSON and raw arrays only, nothing pickled."""
        directory = os.fspath(directory)
        p = self._pid(partition)
        keys, rows, tags = self._backend.list_keys(p)
        cols = list(self.columns)
        tmp = directory + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        meta: dict[str, Any] = {
            "version": _CHECKPOINT_VERSION,
            "partition": partition,
            "keys": [
                [("i" if isinstance(k, int) else "s"), str(k) if isinstance(k, int) else k] for k in keys
            ],
            "tags": [dict(t) for t in tags],
            "columns": {},
        }
        written = self._backend.written(p, keys, [self._column_ids[c] for c in cols]) if keys else None
        for j, name in enumerate(cols):
            col = self.columns[name]
            have = np.flatnonzero(written[:, j]) if written is not None else np.empty(0, np.int64)
            meta["columns"][name] = {
                "dtype": col.dtype,
                "ragged": col.ragged,
                "shape": list(col.shape),
                "max_len": col.max_len,
                "max_bytes": col.max_bytes,
                "rows": have.tolist(),
            }
            if not len(have):
                continue
            sel = rows[have]
            got = self._backend.fetch_many([(self._column_ids[name], _raw(col))], sel, "packed", -1)[0]
            arr, lengths = got[0], got[1]
            np.ascontiguousarray(arr).view(np.uint8).tofile(os.path.join(tmp, f"{j}.bin"))
            if lengths is not None:
                np.asarray(lengths, np.int64).tofile(os.path.join(tmp, f"{j}.lengths.bin"))
        with open(os.path.join(tmp, "partition.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)

    def load(self, partition: str, directory: str | os.PathLike) -> None:
        """Restores a partition saved by ``save`` into ``partition`` (new or empty): keys, tags and written
        cells exactly (row ids may differ). A column type that differs from this dock's: InvalidArgument;
        on any error the partition is cleared again."""
        directory = os.fspath(directory)
        with open(os.path.join(directory, "partition.json")) as f:
            meta = json.load(f)
        if meta.get("version") != _CHECKPOINT_VERSION:
            raise InvalidArgument(f"checkpoint {directory!r} has version {meta.get('version')!r}, not 1")
        p = self._pid(partition, create=True)
        if self._backend.list_keys(p)[0]:
            raise InvalidArgument(f"load into partition '{partition}', which holds keys: clear it first")
        keys = [int(v) if t == "i" else v for t, v in meta["keys"]]
        if not keys:
            return
        try:
            tags = [list(t.items()) for t in meta["tags"]]
            self._backend.tag(p, keys, tags)  # creates every key (no data yet) with its tags
            for j, (name, spec) in enumerate(meta["columns"].items()):
                have = np.asarray(spec["rows"], np.int64)
                if not len(have):
                    continue
                col = Column(
                    spec["dtype"],
                    shape=tuple(spec["shape"]),
                    ragged=spec["ragged"],
                    max_len=spec["max_len"],
                    max_bytes=spec["max_bytes"],
                )
                raw = _raw(col)
                data = np.fromfile(os.path.join(directory, f"{j}.bin"), dtype=np.uint8)
                values = data.view(raw.storage_dtype).reshape(-1, *raw.shape)
                sel = [keys[i] for i in have]
                if col.ragged:
                    lengths = np.fromfile(os.path.join(directory, f"{j}.lengths.bin"), dtype=np.int64)
                    if col.is_object:
                        value: Any = _objects.decode(
                            values, lengths, name, getattr(self, "object_codec", None)
                        )
                    else:
                        value = Ragged.from_lengths(values, lengths)
                else:
                    value = values
                cid, have_col = self._column(name, value if not col.is_object else list(value))
                if (have_col.dtype, have_col.ragged, have_col.shape) != (col.dtype, col.ragged, col.shape):
                    raise InvalidArgument(
                        f"checkpoint column '{name}' is {col.dtype} ragged={col.ragged} shape={col.shape}; "
                        "this "
                        f"dock's is {have_col.dtype} ragged={have_col.ragged} shape={have_col.shape}"
                    )
                inputs, _ = self._inputs({name: value})
                self._backend.put_keys(p, sel, inputs, False, None, [])
        except BaseException:
            self._backend.clear(p)
            raise


def _raw(col: Column) -> Column:
    """The column as stored: object columns are their encoded uint8 rows."""
    return Column("uint8", ragged=True, max_len=col.max_len) if col.is_object else col


def _column_of_tuple(t: tuple) -> Column:
    name, dtype, ragged, shape, _arena, growable, label = t
    del name, dtype, growable
    return Column(label, shape=tuple(shape), ragged=bool(ragged))
