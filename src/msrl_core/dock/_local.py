"""The embedded backend: one native DockCore (warehouses + controllers) in this process."""

from __future__ import annotations

from typing import Any

import numpy as np

from msrl_core import _core
from msrl_core.dock._backend import ClaimDP, ClaimIn
from msrl_core.dock._types import Column


def column_tuple(name: str, c: Column, rows_per_warehouse: int) -> tuple:
    """(name, native dtype, ragged, inner shape, arena bytes per warehouse, growable) for the native core."""
    return (
        name,
        c.native_dtype,
        c.ragged,
        list(c.shape),
        c.arena_bytes(rows_per_warehouse),
        c.max_bytes is None,
        c.dtype,
    )


def column_tuples(columns: dict[str, Column], rows_per_warehouse: int) -> list[tuple]:
    return [column_tuple(name, c, rows_per_warehouse) for name, c in columns.items()]


class LocalBackend:
    name = "local"
    views = True
    picklable = False

    def __init__(
        self,
        columns: dict[str, Column],
        stages: dict[str, list[str]],
        capacity: int,
        group_size: int,
        warehouses: int,
        balance_by: str | None = None,
    ):
        groups = capacity // group_size
        rows_per_wh = -(-groups // warehouses) * group_size
        self.columns = columns
        self._core = _core.DockCore(
            column_tuples(columns, rows_per_wh),
            [(s, list(cols), balance_by or "") for s, cols in stages.items()],
            capacity,
            group_size,
            warehouses,
        )
        self.num_warehouses = warehouses
        self.rows_per_warehouse = rows_per_wh

    # ---- the keyed store (partition ids from partition(); keys str | int) ----

    def partition(self, name: str, create: bool) -> int:
        return self._core.partition(name, create)

    def partition_names(self) -> list[str]:
        return self._core.partition_names()

    def declare_column(self, name: str, col: Column) -> int:
        return self._core.declare_column(column_tuple(name, col, self.rows_per_warehouse))

    def column_info(self, name: str) -> tuple | None:
        return self._core.column_info(name)

    def put_keys(
        self, p: int, keys: list, inputs: list[tuple], overwrite: bool, tags: list | None, versions: list[int]
    ) -> np.ndarray:
        return self._core.put_keys(p, keys, inputs, overwrite, tags, versions)

    def put_in(
        self,
        p: int,
        inputs: list[tuple],
        rows: np.ndarray,
        epoch: int = -1,
        stage: int = -1,
        claim_id: int = 0,
    ) -> None:
        self._core.put_in(p, inputs, rows, epoch, stage, claim_id)

    def rows_of(self, p: int, keys: list) -> np.ndarray:
        return self._core.rows_of(p, keys)

    def keys_of(self, p: int, rows: np.ndarray) -> list:
        return self._core.keys_of(p, rows)

    def list_keys(self, p: int) -> tuple[list, np.ndarray, list]:
        return self._core.list_keys(p)

    def written(self, p: int, keys: list, cids: list[int]) -> np.ndarray:
        return self._core.written(p, keys, cids)

    def tag(self, p: int, keys: list, tags: list) -> None:
        self._core.tag(p, keys, tags)

    def erase_keys(self, p: int, keys: list) -> None:
        self._core.erase_keys(p, keys)

    def erase_rows(self, p: int, rows: np.ndarray) -> None:
        self._core.erase_rows(p, rows)

    def clear(self, p: int) -> None:
        self._core.clear(p)

    def drop_partition(self, p: int) -> None:
        self._core.drop_partition(p)

    def claim_in(self, req: ClaimIn) -> tuple[np.ndarray, int, int]:
        return self._core.claim_in(*req)

    def claim_dp(self, req: ClaimDP) -> tuple[np.ndarray, int, int]:
        return self._core.claim_dp(*req)

    def release_in(self, p: int, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._core.release_in(p, stage, rows, epoch, claim_id)

    def complete_in(self, p: int, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._core.complete_in(p, stage, rows, epoch, claim_id)

    def progress_in(self, p: int, stage: int) -> dict:
        return self._core.progress(stage, p)

    def check_claim_epoch(self, p: int, epoch: int) -> None:
        self._core.check_claim_epoch(p, epoch)

    def column_stats(self, cid: int) -> list[dict]:
        return self._core.column_stats(cid)

    def put_new(self, inputs: list[tuple], n: int) -> np.ndarray:
        return self._core.put_new(inputs, n)

    def put(
        self, inputs: list[tuple], rows: np.ndarray, epoch: int = -1, stage: int = -1, claim_id: int = 0
    ) -> None:
        self._core.put(inputs, rows, epoch, stage, claim_id)

    def complete(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._core.complete(stage, rows, epoch, claim_id)

    def claim(
        self, stage: int, max_rows: int, min_rows: int, timeout: float, max_items: int = 0
    ) -> tuple[np.ndarray, int, int]:
        return self._core.claim(stage, max_rows, min_rows, timeout, max_items)

    def release(self, stage: int, rows: np.ndarray, epoch: int = -1, claim_id: int = 0) -> None:
        self._core.release(stage, rows, epoch, claim_id)

    def fetch(
        self, cid: int, col: Column, rows: np.ndarray, layout: str, epoch: int = -1
    ) -> tuple[np.ndarray, Any]:
        """Packed: (values, lengths); padded: (values [n, width, ...], lengths); fixed: (array, None)."""
        if not col.ragged:
            out = np.empty((len(rows), *col.shape), dtype=col.storage_dtype)
            self._core.gather(cid, rows, out, epoch)
            return out, None
        if epoch >= 0 and epoch != self._core.epoch:  # before lengths(); gather re-checks under its lock
            self._core.gather(cid, rows[:0], np.empty(0, np.uint8), epoch)
        lengths = self._core.lengths(cid, rows)
        if layout == "padded":
            width = int(lengths.max()) if len(lengths) else 0
            out = np.empty((len(rows), width, *col.shape), dtype=col.storage_dtype)
            self._core.gather_padded(cid, rows, width, out, epoch)
        else:
            out = np.empty((int(lengths.sum()), *col.shape), dtype=col.storage_dtype)
            self._core.gather(cid, rows, out, epoch)
        return out, lengths

    def fetch_view(
        self, cid: int, col: Column, rows: np.ndarray, epoch: int = -1
    ) -> tuple[np.ndarray, Any, bool]:
        """Zero-copy when the rows' bytes are contiguous in one arena: (read-only array over the arena,
        lengths or None, True); the array keeps a native DockView alive that pins the iteration.
        Otherwise one packed copy: (array, lengths or None, False)."""
        view, lengths = self._core.view(cid, rows, epoch)
        if view is None:
            arr, _ = self.fetch(cid, col, rows, "packed", epoch)
            return arr, (lengths if col.ragged else None), False
        items = int(lengths.sum()) if col.ragged else len(rows)
        arr = np.frombuffer(memoryview(view), dtype=col.storage_dtype).reshape(items, *col.shape)
        return arr, (lengths if col.ragged else None), True

    def fetch_views(self, cols: list[tuple[int, Column]], rows: np.ndarray, epoch: int = -1) -> list[tuple]:
        out = []
        try:
            for cid, col in cols:
                out.append(self.fetch_view(cid, col, rows, epoch))
        except BaseException:
            out.clear()  # views of earlier columns must not stay pinned by the traceback
            raise
        return out

    def live_views(self) -> int:
        return self._core.live_views

    def fetch_many(
        self, cols: list[tuple[int, Column]], rows: np.ndarray, layout: str, epoch: int = -1
    ) -> list[tuple]:
        return [self.fetch(cid, col, rows, layout, epoch) for cid, col in cols]

    def warehouse_of(self, rows: np.ndarray) -> np.ndarray:
        return self._core.warehouse_of(rows)

    def progress(self, stage: int) -> dict:
        return self._core.progress(stage)

    def consumed(self, stage: int, row: int) -> bool:
        return self._core.consumed(stage, row)

    def warehouse_status(self) -> list[dict[str, Any]]:
        return [{"bytes": int(b), "error": None} for b in self._core.warehouse_bytes()]

    def op_stats(self) -> dict:
        return self._core.op_stats()

    def allocated_rows(self) -> int:
        return self._core.allocated_rows()

    def reset(self, force: bool = False, keep_unfinished: bool = False) -> np.ndarray:
        # In-process puts and fetches cannot be orphaned: force changes nothing here.
        return self._core.reset(keep_unfinished)

    def close(self) -> None:
        self._core.close()

    def shutdown(self) -> None:
        self._core.close()  # the memory goes with this object
