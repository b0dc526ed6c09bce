"""msrl_core.Dock: the transfer dock's public API over the local or Ray backend."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from msrl_core.dock import _objects
from msrl_core.dock._backend import Backend, ClaimDP, ClaimIn
from msrl_core.dock._device import check_device_output, device_io
from msrl_core.dock._jagged import ragged_output
from msrl_core.dock._keyed import KeyedMixin, _keys_list
from msrl_core.dock._types import (
    MAX_WAIT_S,
    Batch,
    Claim,
    Column,
    Padded,
    Ragged,
    check_tensordict_keys,
    claim_id_of,
    epoch_of,
    is_tensordict,
    partition_of,
    rows_array,
    stage_of,
    tensordict_cls,
    to_output,
    to_tensordict,
)
from msrl_core.errors import InvalidArgument, MsrlError, NotFound, Unsupported

_LAYOUTS = ("packed", "padded", "nested")
_OUTPUTS = ("numpy", "torch", "tensordict")


_NO_VERSION = -(2**63)  # claims without a max_staleness filter


class _Latencies:
    """Recent latencies of one operation (bounded), for stats() percentiles."""

    def __init__(self, keep: int = 4096):
        self.samples: deque[float] = deque(maxlen=keep)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"p50_us": math.nan, "p99_us": math.nan}
        arr = np.fromiter(self.samples, dtype=np.float64)
        return {"p50_us": float(np.percentile(arr, 50)) * 1e6, "p99_us": float(np.percentile(arr, 99)) * 1e6}


def _make_backend(
    backend: str,
    columns: dict[str, Column],
    stages: dict[str, list[str]],
    capacity: int,
    group_size: int,
    warehouses: int | None,
    balance_by: str | None,
    options: dict[str, Any],
) -> Backend:
    if backend == "local":
        from msrl_core.dock._local import LocalBackend

        if options:
            raise InvalidArgument(f"unknown options for the local backend: {sorted(options)}")
        return LocalBackend(columns, stages, capacity, group_size, int(warehouses or 1), balance_by)
    if backend == "ray":
        from msrl_core.dock._client import RayBackend

        return RayBackend(columns, stages, capacity, group_size, warehouses, balance_by=balance_by, **options)
    raise InvalidArgument(f"backend must be 'local' or 'ray', got {backend!r}")


class Dock(KeyedMixin):
    """Distributed transfer dock: warehouses hold the bytes, one controller per stage holds readiness.

    >>> dock = Dock(columns={"prompts": Column("int64", ragged=True), "rewards": Column("float32")},
    ...             stages={"reward": ["prompts"], "update": ["prompts", "rewards"]},
    ...             capacity=8, group_size=2)
    >>> rows = dock.put({"prompts": [np.arange(3), np.arange(5)]})
    >>> meta = dock.claim("reward", max_rows=2, timeout=1.0)
    >>> batch = dock.fetch(meta, ["prompts"])
    >>> dock.put({"rewards": np.ones(2, np.float32)}, rows=meta)

    ``capacity`` rows per iteration (``prompts x group_size``), split into ``warehouses`` contiguous
    ranges of whole groups. A stage's rows become claimable when every column it reads is written.
    ``backend="local"`` keeps everything in this process; ``backend="ray"`` runs warehouses and
    controllers as Ray actors (``ray_address``/``ray_init`` control the Ray connection).
    ``output`` is the default tensor type of fetched data: ``"numpy"`` or ``"torch"``.
    ``balance_by`` names a ragged column whose row lengths the controllers record, so that
    ``claim(..., max_items=N)`` hands out whole groups FIFO up to about N items of that column
    (length-balanced claims: workers of a stage get similar token counts, not similar row counts).
    """

    def __init__(
        self,
        columns: Mapping[str, Column] | None = None,
        stages: Mapping[str, Sequence[str]] | None = None,
        capacity: int = 0,
        group_size: int = 1,
        warehouses: int | None = None,
        backend: str = "local",
        output: str = "numpy",
        balance_by: str | None = None,
        object_codec: _objects.ObjectCodec | None = None,
        **backend_options: Any,
    ):
        columns = dict(columns or {})
        stages = dict(stages or {})
        for name, col in columns.items():
            if not isinstance(col, Column):
                raise InvalidArgument(f"column '{name}' must be a msrl_core.Column, got {type(col).__name__}")
        for stage, cols in stages.items():
            if isinstance(cols, str) or not cols:
                raise InvalidArgument(f"stage '{stage}' must list the columns it reads, got {cols!r}")
            # A name that is not a column yet is declared at run time, by its first put.
        if output not in _OUTPUTS:
            raise InvalidArgument(f"output must be one of {_OUTPUTS}, got {output!r}")
        if output == "tensordict":
            tensordict_cls()
        if balance_by is not None and (balance_by not in columns or not columns[balance_by].ragged):
            raise InvalidArgument(f"balance_by must name a ragged column, got {balance_by!r}")
        self.balance_by = balance_by
        capacity, group_size = int(capacity), int(group_size)
        if group_size <= 0 or capacity <= 0 or capacity % group_size:
            raise InvalidArgument(
                "capacity must be a positive multiple of group_size; "
                f"got capacity={capacity}, group_size={group_size}"
            )
        self.columns: dict[str, Column] = dict(columns)
        self.stages: dict[str, list[str]] = {s: list(c) for s, c in stages.items()}
        self.object_codec = object_codec  # None: object columns hold safe types only, never unpickled
        self._init_keyed()
        self.capacity = capacity
        self.group_size = group_size
        self.output = output
        self._column_ids = {name: i for i, name in enumerate(self.columns)}
        self._stage_ids = {name: i for i, name in enumerate(self.stages)}
        self._backend: Backend = _make_backend(
            backend, self.columns, self.stages, capacity, group_size, warehouses, balance_by, backend_options
        )
        self.backend = backend
        self._shut_down = False
        self._lat = {op: _Latencies() for op in ("put", "claim", "fetch")}
        self._lat_lock = threading.Lock()

    # ---- names -----------------------------------------------------------------------------

    def _cid(self, name: str) -> int:
        return self._column(name)[0]

    def _sid(self, stage: str) -> int:
        try:
            return self._stage_ids[stage]
        except KeyError:
            raise NotFound(f"unknown stage '{stage}'; stages are: {', '.join(self.stages)}") from None

    def _record(self, op: str, t0: float) -> None:
        self._lat[op].samples.append(time.perf_counter() - t0)

    # ---- data plane ------------------------------------------------------------------------

    def put(
        self,
        data: Mapping[str, Any],
        rows: Any = None,
        *,
        partition: str | None = None,
        keys: Any = None,
        overwrite: bool = False,
        tags: Any = None,
        version: Any = None,
    ) -> np.ndarray:
        """Writes columns; returns the row ids written (in data order). All columns land or none: on
        any error the dock is unchanged. Readiness is published after the bytes are stored.

        Row ids (the default partition): without ``rows`` it allocates new rows (whole groups); with
        ``rows`` (ids, a Claim or a Batch) it writes into those allocated rows. A put with a Claim (or a
        Batch from ``take``) also *completes* that claim for its stage: see ``reset(keep_unfinished=True)``.

        Keys (``keys=[...]`` with ``partition=``): a new key gets a row (new keys of one put fill whole
        groups), an existing key's row gets this put's columns (fields added at any time). A cell already
        written is rewritten only with ``overwrite=True`` (readiness and claims stay; see docs/dock.md).
        ``tags``: one dict or one per key, upserted; ``version``: the rows' policy version (an int or one
        per key) for ``claim(max_staleness=...)``. A column not declared yet is declared by this put from
        its values (dtype, inner shape, ragged or not; a list of other values: an object column)."""
        t0 = time.perf_counter()
        if keys is not None:
            if partition is None:
                raise InvalidArgument("put(keys=...) needs partition= (keys live in a named partition)")
            if rows is not None:
                raise InvalidArgument("put takes keys= or rows=, not both")
            out = self._put_keys(data, partition, keys, overwrite, tags, version)
            self._record("put", t0)
            return out
        if overwrite or tags is not None or version is not None:
            raise InvalidArgument("overwrite=, tags= and version= need keys= (and partition=)")
        if is_tensordict(data):
            from msrl_core.dock._jagged import tensordict_to_columns

            data = tensordict_to_columns(data)
        if not isinstance(data, Mapping) or not data:
            raise InvalidArgument("put takes a non-empty mapping of column name -> values")
        inputs, n = self._inputs(data)
        assert n is not None
        if rows is None:
            if partition is not None:
                raise InvalidArgument("a put into a named partition needs keys= (or rows= from its claims)")
            if n == 0 or n % self.group_size:
                raise InvalidArgument(
                    f"a put of new rows must hold whole groups of {self.group_size} rows, got {n} rows"
                )
            out = self._backend.put_new(inputs, n)
        else:
            out = rows_array(rows, self.capacity)
            if len(out) != n:
                raise InvalidArgument(f"put of {n} rows of data into {len(out)} rows")
            if n == 0:
                raise InvalidArgument("put needs at least one row")
            part = self._partition_arg(rows, partition)
            stage = stage_of(rows)
            sid = -1 if stage is None else self._sid(stage)
            if part is None:
                self._backend.put(inputs, out, epoch_of(rows), sid, claim_id_of(rows))
            else:
                self._backend.put_in(self._pid(part), inputs, out, epoch_of(rows), sid, claim_id_of(rows))
        self._record("put", t0)
        return out

    @staticmethod
    def _partition_arg(meta: Any, partition: str | None) -> str | None:
        """The partition of a call with a Claim/Batch and an optional partition= (they must agree)."""
        got = partition_of(meta)
        if partition is not None and got is not None and got != partition:
            raise InvalidArgument(f"the claim is of partition {got!r}, not {partition!r}")
        return got if got is not None else partition

    def claim(
        self,
        stage: str,
        max_rows: int,
        timeout: float = 0.0,
        min_rows: int | None = None,
        max_items: int | None = None,
        *,
        partition: str | None = None,
        max_staleness: int | None = None,
        version: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        batch: Any = None,
        ranks_per_replica: int = 1,
    ) -> Claim:
        """Claims up to ``max_rows`` ready rows of ``stage`` (whole groups; metadata only).

        ``partition``: only that partition's rows (each partition has its own claims per stage); a
        partition that does not exist yet is created (a consumer may start before its producers).
        ``max_staleness=s, version=v``: only groups whose rows' policy version is ``>= v - s`` (older ones
        are skipped and stay). DP-aware (``dp_size=D, dp_rank=r, batch=b``): the round ``b``'s first call
        claims up to ``D * max_rows`` rows and splits them into D token-balanced shares (by
        ``balance_by``, else rows); every call of the round with ``dp_rank=r`` — the ``ranks_per_replica``
        TP/PP ranks of replica r — gets share r; replicas never share a row.

        Waits up to ``timeout`` seconds until at least ``min_rows`` (default: one group) are ready;
        ``timeout=0`` never waits and may return an empty claim. Raises ``Timeout`` when fewer than an
        explicit ``min_rows`` are ready at the deadline. Rows go to each stage exactly once per iteration.
        ``max_items`` (needs ``balance_by``): stop adding groups once the ``balance_by`` items would exceed
        it (at least one group, and at least ``min_rows``).
        """
        t0 = time.perf_counter()
        sid = self._sid(stage)
        if min_rows is None:
            min_rows = 0 if timeout == 0 else self.group_size
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise InvalidArgument(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        if timeout > MAX_WAIT_S:  # a year: longer waits would overflow deadlines
            timeout = MAX_WAIT_S
        items = 0
        if max_items is not None:
            if self.balance_by is None:
                raise InvalidArgument(
                    "claim(max_items=...) needs a dock created with balance_by=<ragged column>"
                )
            if int(max_items) <= 0:
                raise InvalidArgument(f"max_items must be > 0, got {max_items}")
            items = int(max_items)
        min_version = _NO_VERSION
        if max_staleness is not None or version is not None:
            if max_staleness is None or version is None or int(max_staleness) < 0:
                raise InvalidArgument(
                    f"max_staleness (>= 0) and version go together, got max_staleness={max_staleness!r}, "
                    f"version={version!r}"
                )
            min_version = int(version) - int(max_staleness)
        plain = partition is None and min_version == _NO_VERSION and dp_size is None
        if plain:
            rows, epoch, claim_id = self._backend.claim(
                sid, int(max_rows), int(min_rows), float(timeout), items
            )
        elif dp_size is not None or dp_rank is not None or batch is not None:
            if dp_size is None or dp_rank is None or batch is None:
                raise InvalidArgument("a DP claim needs dp_size=, dp_rank= and batch= together")
            if items:
                raise InvalidArgument("a DP claim balances by balance_by itself: max_items does not apply")
            p = self._pid(partition, create=True)  # a consumer may start before the producers
            rows, epoch, claim_id = self._backend.claim_dp(
                ClaimDP(
                    p,
                    sid,
                    f"{type(batch).__name__}:{batch}",
                    int(dp_rank),
                    int(dp_size),
                    int(ranks_per_replica),
                    int(max_rows),
                    int(min_rows),
                    float(timeout),
                    min_version,
                )
            )
        else:
            p = self._pid(partition, create=True)  # a consumer may start before the producers
            rows, epoch, claim_id = self._backend.claim_in(
                ClaimIn(p, sid, int(max_rows), int(min_rows), float(timeout), items, min_version)
            )
        self._record("claim", t0)
        return Claim._new(stage, rows, self._backend.warehouse_of, epoch, claim_id, partition)

    def release(self, meta: Claim | Batch) -> None:
        """Gives claimed rows back to their stage (e.g. a worker failed); they can be claimed again.
        Only while the claim holds them: a claim released before, whose rows another worker claimed
        since, or completed (a put with it, ``complete()``) raises InvalidArgument and changes nothing."""
        stage = stage_of(meta)
        if stage is None:
            raise InvalidArgument("release() takes the Claim (or the Batch of take()) to release")
        part = partition_of(meta)
        if part is None:
            self._backend.release(self._sid(stage), meta.rows, epoch_of(meta), claim_id_of(meta))
        else:
            self._backend.release_in(
                self._pid(part), self._sid(stage), meta.rows, epoch_of(meta), claim_id_of(meta)
            )

    def complete(self, meta: Claim | Batch) -> None:
        """Marks a claim as done by its stage without putting anything (a stage that writes no columns,
        e.g. the update). Only matters for ``reset(keep_unfinished=True)``: there a claim that was not
        completed — by a put with it or by this call — is dropped and its rows go back to the stage."""
        stage = stage_of(meta)
        if stage is None:
            raise InvalidArgument("complete() takes the Claim (or the Batch of take()) to complete")
        rows = rows_array(meta, self.capacity)
        part = partition_of(meta)
        if part is None:
            self._backend.complete(self._sid(stage), rows, epoch_of(meta), claim_id_of(meta))
        else:
            self._backend.complete_in(
                self._pid(part), self._sid(stage), rows, epoch_of(meta), claim_id_of(meta)
            )

    def fetch(
        self,
        meta: Any,
        columns: Sequence[str] | None = None,
        layout: str = "packed",
        output: str | None = None,
        copy: bool = True,
        device: Any = None,
    ) -> Batch:
        """Reads columns of claimed rows (a Claim, or row ids). Fixed columns come back dense
        ``[n, *shape]``; ragged ones as ``Ragged(values, offsets)`` (``layout='packed'``) or
        ``Padded(values, lengths)`` with a ``mask`` (``layout='padded'``). ``columns`` defaults to the
        claiming stage's inputs. ``output='tensordict'`` (tensordict installed) returns a
        ``TensorDict`` with batch size ``[n]`` instead of a Batch: dense columns as torch tensors, ragged
        ones padded (whatever ``layout``) with a bool ``<name>_mask``; keep the Claim to put back.

        ``copy=False`` (packed layout, numpy or torch output; local backend, or Ray on the warehouse's
        node): a column whose rows' bytes lie back to back in one warehouse arena comes back as a
        zero-copy view of the arena (read-only numpy array; torch tensor that must not be written) and is
        named in ``batch.views``; any other column (rows in several warehouses; Ray from another node)
        is one packed copy as usual. While any view is alive ``reset()`` raises InvalidArgument
        (nothing changed): drop the views (and tensors made from them) first.

        ``device`` (e.g. ``"cuda:0"``, needs ``output='torch'``): values are copied host->device through
        the native copy engine into tensors allocated on that device (offsets and lengths stay numpy)."""
        t0 = time.perf_counter()
        columns, layout, output = self._fetch_args(meta, columns, layout, output, copy, device)
        as_td = output == "tensordict"
        nested_td = as_td and layout == "nested"
        store_layout = "padded" if layout == "padded" else "packed"
        # The warehouses check a claim's iteration against reset(); a partition's claims count clears,
        # which the control plane checks after the copy (a clear that reused the rows meanwhile is caught).
        claim_partition = partition_of(meta)
        read_epoch = epoch_of(meta) if claim_partition is None else -1
        rows = rows_array(meta, self.capacity)
        cids = [self._column_ids[c] for c in columns]
        data: dict[str, Any] = {}
        specs = [(cid, self.columns[c]) for c, cid in zip(columns, cids)]
        specs = [(cid, Column("uint8", ragged=True) if col.is_object else col) for cid, col in specs]
        views: set[str] = set()
        if copy or len(rows) == 0:
            got = self._backend.fetch_many(specs, rows, store_layout, read_epoch)
        else:
            got = self._backend.fetch_views(specs, rows, read_epoch)
            views = {name for name, g in zip(columns, got) if g[2]}
        if claim_partition is not None and epoch_of(meta) >= 0:
            try:
                self._backend.check_claim_epoch(self._pid(claim_partition), epoch_of(meta))
            except BaseException:
                got = []  # no view of the refused read stays pinned by the traceback
                raise
        for name, (arr, lengths, *_) in zip(columns, got):
            col = self.columns[name]
            if col.is_object:  # decoded here, in the reading client only
                data[name] = _objects.decode(arr, lengths, name, self.object_codec)
                continue
            val = to_output(arr, col, "torch" if as_td else output, share=name in views)
            if device is not None:
                val = device_io().to_device(val, device)
            if lengths is None:
                data[name] = val
            elif layout == "padded":
                data[name] = Padded(val, lengths)
            elif layout == "nested" and not as_td:
                data[name] = ragged_output(val, lengths, "nested")
            elif nested_td:
                data[name] = Ragged.from_lengths(val, lengths)
            else:
                data[name] = Ragged.from_lengths(val, lengths)
        self._record("fetch", t0)
        if as_td:
            if any(self.columns[c].is_object for c in columns) or nested_td:
                from msrl_core.dock._jagged import columns_to_tensordict

                return columns_to_tensordict(data, len(rows), ragged="nested" if nested_td else "padded")
            return to_tensordict(data, len(rows))
        return Batch(
            rows,
            data,
            epoch_of(meta),
            stage_of(meta),
            frozenset(views),
            claim_id_of(meta),
            partition_of(meta),
        )

    def _fetch_args(
        self, meta: Any, columns: Any, layout: str, output: str | None, copy: bool, device: Any
    ) -> tuple[list[str], str, str]:
        """Validates fetch arguments (before anything is claimed or read): (columns, layout, output)."""
        if layout not in _LAYOUTS:
            raise InvalidArgument(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        output = output or self.output
        if output not in _OUTPUTS:
            raise InvalidArgument(f"output must be one of {_OUTPUTS}, got {output!r}")
        check_device_output(device, output, copy)
        if layout == "nested" and output == "numpy":
            raise InvalidArgument(
                "layout='nested' returns torch NestedTensors: use output='torch' or 'tensordict'"
            )
        if not copy:
            if not self._backend.views:
                raise Unsupported(
                    f"fetch(copy=False) (zero-copy views) is not built for this dock's backend "
                    f"{self.backend!r}: fetch with copy=True"
                )
            if layout != "packed" or output == "tensordict":
                raise InvalidArgument(
                    "fetch(copy=False) returns views of the packed arenas: it needs layout='packed' and "
                    f"output 'numpy' or 'torch', got layout={layout!r}, output={output!r}"
                )
        if columns is None:
            stage = stage_of(meta) if not isinstance(meta, str) else meta
            if stage is None:
                raise InvalidArgument("fetch of plain row ids needs columns=")
            columns = self.stages[stage]
        columns = [columns] if isinstance(columns, str) else list(columns)
        for c in columns:
            self._column(c)
        if output == "tensordict":
            tensordict_cls()  # InvalidArgument before any work when tensordict is missing
            check_tensordict_keys(columns, self.columns)
            layout = "nested" if layout == "nested" else "padded"
        return columns, layout, output

    def take(
        self,
        stage: str,
        max_rows: int,
        timeout: float = 0.0,
        min_rows: int | None = None,
        columns: Sequence[str] | None = None,
        max_items: int | None = None,
        layout: str = "packed",
        output: str | None = None,
        device: Any = None,
        copy: bool = True,
    ) -> Batch:
        """claim + fetch in one call; ``batch.rows`` are the claimed rows. Arguments are checked before
        claiming, and a fetch that fails after the claim (e.g. a column not ready) releases it: an error
        leaves nothing claimed. ``copy=False``: zero-copy views as in ``fetch``."""
        self._sid(stage)
        columns, layout, output = self._fetch_args(stage, columns, layout, output, copy, device)
        meta = self.claim(stage, max_rows, timeout=timeout, min_rows=min_rows, max_items=max_items)
        try:
            return self.fetch(meta, columns, layout, output, copy=copy, device=device)
        except BaseException:
            if len(meta):
                with contextlib.suppress(MsrlError):
                    self.release(meta)
            raise

    def reset(self, force: bool = False, keep_unfinished: bool = False) -> np.ndarray:
        """Ends the iteration: clears rows, readiness and claims. Raises InvalidArgument (nothing
        changed) while a put, fetch or another reset is in flight, or while zero-copy views from
        ``fetch(copy=False)`` are alive (the message says how many). Claims blocked in ``claim`` keep
        waiting and get the next iteration's rows; a Claim or Batch from before the reset is stale and
        a put, fetch or release with it raises InvalidArgument instead of touching the new rows.
        On Ray a reset is atomic against puts: a racing put's rows are wholly before or wholly after it.
        ``force=True`` (Ray backend) abandons puts, fetches and views still registered (e.g. of a worker
        that died between reserving and committing); their commits or publications fail.

        ``keep_unfinished=True`` (partial rollout): only *finished* groups — claimed by every stage —
        are freed. Unfinished groups stay in the dock with their rows, written columns and readiness,
        and each stage keeps the claims it *completed* (a put with the Claim/Batch, or ``complete()``),
        so no stage gets a row twice; a claim not completed does not survive the reset and its group is
        claimable again by that stage (first in line). New puts use the freed rows. Returns the kept
        row ids (empty without ``keep_unfinished``). Both backends apply the same native rules."""
        kept = self._backend.reset(force, keep_unfinished)
        return np.empty(0, np.int64) if kept is None else kept

    def close(self) -> None:
        """Wakes blocked claims with ``Closed``; later claims raise ``Closed``."""
        self._backend.close()

    def shutdown(self) -> None:
        """Ends the dock: wakes blocked claims with ``Closed`` and frees what the backend holds (the
        Ray backend kills its actors; handles in other processes then raise ``Unavailable``). Calling
        it again does nothing. ``with Dock(...) as dock:`` calls it on exit."""
        if self._shut_down:
            return
        self._shut_down = True
        with contextlib.suppress(MsrlError):
            self._backend.close()
        self._backend.shutdown()

    def __enter__(self) -> Dock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __getstate__(self) -> dict[str, Any]:
        # A dock handle can be sent to other processes (Ray tasks and actors) with the ray backend.
        if not self._backend.picklable:
            raise InvalidArgument("only a backend='ray' dock can be pickled (local docks stay in-process)")
        state = dict(self.__dict__)
        del state["_lat_lock"], state["_lat"], state["_cols_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lat = {op: _Latencies() for op in ("put", "claim", "fetch")}
        self._lat_lock = threading.Lock()
        self._init_keyed()

    def get(
        self,
        keys: Any,
        columns: Sequence[str] | str | None = None,
        *,
        partition: str,
        layout: str = "packed",
        output: str | None = None,
    ) -> Any:
        """Reads columns of keys (in key order), without claiming: every cell must be written
        (InvalidArgument naming the key and column otherwise); unknown key: NotFound. ``columns`` None:
        every column written for all of the keys. Returns a Batch (``batch.row_keys``) or a TensorDict."""
        keys = _keys_list(keys)
        p = self._pid(partition)
        rows = self._backend.rows_of(p, keys)
        if columns is None:
            names = list(self.columns)
            w = self._backend.written(p, keys, [self._column_ids[c] for c in names]) if keys else None
            columns = [c for j, c in enumerate(names) if w is not None and w[:, j].all()]
        cols = [columns] if isinstance(columns, str) else list(columns)
        cids = [self._column(c)[0] for c in cols]
        if keys and cols:
            w = self._backend.written(p, keys, cids)
            if not w.all():
                i, j = map(int, np.argwhere(~w)[0])
                raise InvalidArgument(
                    f"key {keys[i]!r} of partition '{partition}' has no column '{cols[j]}' written "
                    "(put it first)"
                )
        got = self.fetch(rows, cols, layout=layout, output=output)
        if isinstance(got, Batch):
            got.row_keys = keys
            got.partition = partition
        return got

    # ---- introspection ---------------------------------------------------------------------

    def warehouse_of(self, rows: Any) -> np.ndarray:
        return self._backend.warehouse_of(rows_array(rows, self.capacity))

    def progress(self, partition: str | None = None) -> dict[str, dict[str, int]]:
        """Per stage: rows ready and unclaimed, rows consumed this iteration, claims blocked now."""
        if partition is not None:
            p = self._pid(partition)
            return {s: self._backend.progress_in(p, i) for s, i in self._stage_ids.items()}
        return {s: self._backend.progress(i) for s, i in self._stage_ids.items()}

    def column_stats(self, column: str) -> list[dict[str, int]]:
        """Per warehouse: rows written, value bytes, arena bytes held and arena chunks of a column."""
        return self._backend.column_stats(self._column(column)[0])

    def stats(self) -> dict[str, Any]:
        """Sizes, per-stage progress, operation latencies and per-warehouse state: ``warehouse_bytes``
        holds None for a warehouse that does not answer (dead), and ``warehouses[w]["error"]`` says why;
        the other warehouses are still reported."""
        ops = self._backend.op_stats()
        warehouses = self._backend.warehouse_status()
        for op, lat in self._lat.items():
            ops.setdefault(op, {}).update(lat.summary())
        return {
            "backend": self.backend,
            "capacity": self.capacity,
            "group_size": self.group_size,
            "allocated_rows": self._backend.allocated_rows(),
            "warehouse_bytes": [w["bytes"] for w in warehouses],
            "warehouses": warehouses,
            "stages": self.progress(),
            "ops": ops,
        }

    def __repr__(self) -> str:
        return (
            f"Dock(backend={self.backend!r}, capacity={self.capacity}, group_size={self.group_size}, "
            f"columns={list(self.columns)}, stages={list(self.stages)})"
        )
