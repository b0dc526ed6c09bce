"""Per-step metrics: an append-only ``metrics.jsonl`` (one JSON object per step, flushed every step, so a
crash or Ctrl-C keeps every finished step), optional TensorBoard, and the derived figures the trainer
reports: stage busy time with its overlap (``timing/*``) and end-to-end tokens per second per device.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
Interval = tuple[float, float]


def _scalar(value: Any) -> Any:
    """A JSON-safe scalar: tensors/arrays of one element become Python numbers; NaN/inf become None."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    f = float(value)
    return f if math.isfinite(f) else None


def _metrics_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p / METRICS_FILE if p.is_dir() else p


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a run directory's (or a file's) ``metrics.jsonl``. A last line cut short by a crash is
    skipped; a malformed line elsewhere raises ValueError naming file and line."""
    p = _metrics_path(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                log.warning("%s:%d: skipping the truncated last line", p, lineno)
                break
            raise ValueError(f"{p}:{lineno}: malformed metrics line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _rewrite(path: Path, resume_step: int | None) -> None:
    """Drop a partial last line (a crash mid-write) and, on resume, the rows of steps >= ``resume_step``,
    so the next append starts on a fresh line and no step appears twice."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    if text.endswith("\n") and resume_step is None:
        return
    keep = [line for line in text.splitlines(keepends=True) if line.endswith("\n") and line.strip()]
    if resume_step is not None:
        keep = [line for line, row in zip(keep, read_metrics(path)) if row.get("step", 0) < resume_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


class MetricsWriter:
    """Appends ``{"step": step, **metrics}`` to ``run_dir/metrics.jsonl``, flushed each step.

    ``resume_step``: the first step this run will write (a checkpoint's step count when resuming; 0 for a
    fresh run into an old directory): rows of steps >= ``resume_step`` are dropped first, so a resumed
    run never shows a step twice. None keeps every row and appends.
    ``tensorboard``: also write scalars with ``torch.utils.tensorboard`` if the tensorboard package is
    installed (it is optional; without it this logs a note and writes JSONL only).
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], *, tensorboard: bool = False, resume_step: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        _rewrite(self.path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard is not installed; writing %s only", self.path)
            else:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    @property
    def tensorboard_active(self) -> bool:
        """Whether scalars also go to TensorBoard."""
        return self._tb is not None

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one step's metrics (numbers, strings, bools; non-finite numbers become null); returns
        the row as written."""
        row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key, value, int(step))
            self._tb.flush()
        return row

    def close(self) -> None:
        """Close the file (and TensorBoard writer); safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def e2e_tps(tokens: int, seconds: float, devices: int) -> float:
    """End-to-end throughput as MindSpeed-RL defines it: the step's prompt + response tokens over the
    step's wall time, per device."""
    if seconds <= 0 or devices < 1 or tokens < 0:
        raise ValueError(
            f"e2e_tps needs tokens >= 0, seconds > 0, devices >= 1; got {tokens}, {seconds}, {devices}"
        )
    return tokens / seconds / devices


def _union(intervals: Sequence[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_timings(intervals: Mapping[str, Sequence[Interval]], total: float) -> dict[str, float]:
    """Stage timing with overlap, from each stage's busy ``(start, end)`` intervals (one clock):

    ``timing/<stage>`` is the wall time the stage was busy (the union of its intervals);
    ``timing/non_overlap_<stage>`` the part of it when no other stage was busy; ``timing/all`` is
    ``total``, the step's wall time.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    unions: dict[str, list[Interval]] = {}
    for stage, spans in intervals.items():
        for start, end in spans:
            if end < start:
                raise ValueError(f"stage {stage!r}: interval ({start}, {end}) ends before it starts")
        unions[stage] = _union(spans)
    out = {"timing/all": float(total)}
    for stage, own in unions.items():
        others = _union([iv for name, u in unions.items() if name != stage for iv in u])
        busy = sum(end - start for start, end in own)
        out[f"timing/{stage}"] = busy
        out[f"timing/non_overlap_{stage}"] = busy - _overlap(own, others)
    return out


class StageClock:
    """Thread-safe recorder of stage busy intervals on ``time.perf_counter`` (system-wide monotonic on
    Linux, so intervals from processes on one host are comparable), for :func:`overlap_timings`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, list[Interval]] = {}

    @contextmanager
    def span(self, stage: str) -> Iterator[None]:
        """Record the time spent inside the ``with`` block as busy time of ``stage``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, start, time.perf_counter())

    def add(self, stage: str, start: float, end: float) -> None:
        """Record one busy interval (e.g. reported by a worker process)."""
        with self._lock:
            self._spans.setdefault(stage, []).append((start, end))

    def intervals(self) -> dict[str, list[Interval]]:
        """A copy of the recorded intervals per stage."""
        with self._lock:
            return {k: list(v) for k, v in self._spans.items()}

    def reset(self) -> None:
        """Forget all intervals (call at the start of each step)."""
        with self._lock:
            self._spans.clear()


__all__ = [
    "METRICS_FILE",
    "MetricsWriter",
    "StageClock",
    "e2e_tps",
    "overlap_timings",
    "read_metrics",
]
