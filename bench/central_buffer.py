"""The centralized baseline: one Ray actor stores every row's tensors and answers every request itself.

This is the conventional replay-buffer design the MindSpeed RL paper measures the transfer dock against:
per-row numpy arrays in dicts, readiness found by scanning, every byte of every put and fetch passing
through one process. Blocking claims wait on a condition variable (no polling), so the comparison is about
the data path, not about sleeps.
"""

from __future__ import annotations

import threading

import numpy as np


class CentralBuffer:
    def __init__(self, stages: dict[str, list[str]], capacity: int, group_size: int):
        self.stages = stages
        self.capacity, self.group = capacity, group_size
        self.cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        with self.cond:
            self.data: dict[str, dict[int, np.ndarray]] = {}
            self.consumed: dict[str, set[int]] = {s: set() for s in self.stages}
            self.next_row = 0

    def put(self, rows: list[int] | None, columns: dict[str, list[np.ndarray]]) -> list[int]:
        n = len(next(iter(columns.values())))
        with self.cond:
            if rows is None:
                if self.next_row + n > self.capacity:
                    raise MemoryError(f"central buffer full: {self.next_row} + {n} > {self.capacity}")
                rows = list(range(self.next_row, self.next_row + n))
                self.next_row += n
            for name, values in columns.items():
                col = self.data.setdefault(name, {})
                for r, v in zip(rows, values):
                    col[r] = v  # per-row tensors, as a conventional buffer keeps them
            self.cond.notify_all()
        return rows

    def _ready_groups(self, stage: str, n: int) -> list[int]:
        cols = [self.data.get(c, {}) for c in self.stages[stage]]
        done = self.consumed[stage]
        out: list[int] = []
        for g0 in range(0, self.next_row, self.group):
            if len(out) + self.group > n:
                break
            grp = range(g0, g0 + self.group)
            if g0 in done:
                continue
            if all(r in col for col in cols for r in grp):  # scan readiness row by row
                out += grp
        return out

    def claim(self, stage: str, n: int, timeout: float) -> list[int]:
        with self.cond:
            rows = self._ready_groups(stage, n)
            if not rows:
                self.cond.wait_for(lambda: bool(self._ready_groups(stage, n)), timeout=timeout)
                rows = self._ready_groups(stage, n)
            self.consumed[stage].update(rows)
            return rows

    def get(self, rows: list[int], fields: list[str]) -> dict[str, list[np.ndarray]]:
        with self.cond:
            return {f: [self.data[f][r] for r in rows] for f in fields}

    def consumed_rows(self, stage: str) -> int:
        with self.cond:
            return len(self.consumed[stage])
