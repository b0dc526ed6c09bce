"""Fused copy plans and the asynchronous copy engine.

A :class:`CopyPlan` is a list of strided descriptors ``(src_offset, dst_offset, rows, row_bytes,
src_pitch, dst_pitch)`` in bytes, validated and coalesced once, then run many times by
:meth:`CopyEngine.execute`. Resharding transforms (QKV de-interleave, gate/up re-interleave, slice
extraction, vocab padding) are all plans.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from msrl_core import _core
from msrl_core._buffers import Region, region
from msrl_core.errors import InvalidArgument
from msrl_core.runtime import get_runtime

CopyPlan = _core.CopyPlan
Ticket = _core.Ticket

_KINDS = ("h2h", "h2d", "d2h", "d2d")


def descriptors(
    src_offset: Any,
    dst_offset: Any,
    row_bytes: Any,
    rows: Any = 1,
    src_pitch: Any = None,
    dst_pitch: Any = None,
) -> np.ndarray:
    """Build an ``(N, 6)`` int64 descriptor array from scalars or equal-length arrays (broadcast).

    Pitches default to ``row_bytes`` (contiguous rows).
    """
    cols = [src_offset, dst_offset, rows, row_bytes]
    cols.append(row_bytes if src_pitch is None else src_pitch)
    cols.append(row_bytes if dst_pitch is None else dst_pitch)
    arrays = np.broadcast_arrays(*[np.asarray(c, dtype=np.int64) for c in cols])
    return np.ascontiguousarray(np.stack([a.reshape(-1) for a in arrays], axis=1))


def _kind(src: Region, dst: Region, kind: str | None) -> str:
    if kind is not None:
        if kind not in _KINDS:
            raise InvalidArgument(f"unknown copy kind {kind!r}; allowed: {', '.join(_KINDS)}")
        return kind
    return ("d" if src.on_device else "h") + "2" + ("d" if dst.on_device else "h")


def _stream_arg(stream: Any) -> Any:
    """Accept None, a msrl_core Stream, an int handle, or a torch stream object.

    A stream given is kept even when its handle is 0: torch's default CUDA stream has handle 0 (the legacy
    default stream), and ``after=`` it must still order the copy (None alone means "no ordering")."""
    if stream is None or isinstance(stream, (int, _core.Stream)):
        return stream
    for attr in ("cuda_stream", "npu_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise InvalidArgument(
        f"stream: expected None, an int handle or a stream object, got {type(stream).__name__}"
    )


def current_stream(device: Any) -> Any:
    """The caller's current torch stream on accelerator ``device`` (CUDA / Ascend) — what ``after=`` should
    name for a copy of tensors that kernels produced or will use — or None for a CPU device."""
    import torch

    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    if device.type == "npu":  # pragma: no cover - torch_npu
        return torch.npu.current_stream(device)  # type: ignore[attr-defined]
    return None


def _current_device_index(backend: str) -> int:
    """The caller's current device (torch's notion), so the engine's threads use the same one."""
    try:
        import torch
    except ImportError:
        return 0
    if backend == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if backend == "acl" and npu is not None and npu.is_available():
        return int(npu.current_device())
    return 0


class CopyEngine:
    """Asynchronous copies: one stream per direction, pinned bounce buffers for pageable memory.

    ``copy`` and ``execute`` return a :class:`Ticket`; ``ticket.wait(timeout)`` raises
    :class:`msrl_core.errors.Timeout` past the deadline. ``after=stream`` orders the copy after work
    already enqueued on the caller's stream (torch's default stream included); ``order_stream(ticket,
    stream)`` does the reverse. The engine works on the caller's current device (torch's
    ``current_device()`` when the engine is made, or ``device_index``): on rank r of a node, device r.

    >>> import numpy as np
    >>> engine = CopyEngine()
    >>> src = np.arange(1000, dtype=np.float32); dst = np.empty_like(src)
    >>> engine.copy(dst, src).wait(timeout=10)
    >>> bool((dst == src).all())
    True
    """

    def __init__(
        self,
        device: str | None = None,
        chunk_bytes: int = 8 << 20,
        force_bounce: bool = False,
        device_index: int | None = None,
    ) -> None:
        self.runtime = get_runtime(device)
        index = _current_device_index(self.runtime.name) if device_index is None else int(device_index)
        if index < 0:
            raise InvalidArgument(f"device_index must be >= 0, got {index}")
        self._engine = _core.CopyEngine(self.runtime, chunk_bytes, force_bounce, index)
        self._keep: deque[tuple[Any, ...]] = deque()

    @property
    def device(self) -> int:
        """The device index the engine's streams and events belong to."""
        return int(self._engine.device)

    def copy(
        self, dst: Any, src: Any, nbytes: int | None = None, kind: str | None = None, after: Any = None
    ) -> Ticket:
        s, d = region(src, "src"), region(dst, "dst", writable=True)
        n = s.nbytes if nbytes is None else nbytes
        if nbytes is None and s.nbytes != d.nbytes:
            raise InvalidArgument(
                f"src has {s.nbytes} bytes but dst has {d.nbytes}; pass nbytes to copy a prefix"
            )
        if n < 0 or n > s.nbytes or n > d.nbytes:
            raise InvalidArgument(f"nbytes={n} is outside [0, min(src {s.nbytes}, dst {d.nbytes})]")
        return self._hold(self._engine.copy(d.ptr, s.ptr, n, _kind(s, d, kind), _stream_arg(after)), s, d)

    def copy_many(self, dsts: Any, srcs: Any, kind: str | None = None, after: Any = None) -> Ticket:
        """Copy ``srcs[i]`` into ``dsts[i]`` for every i as one job with one ticket.

        All pairs share one direction (``kind``, or the one their memory implies). Moving a model's
        parameters this way costs one submission instead of one per tensor.
        """
        dsts, srcs = list(dsts), list(srcs)
        if len(dsts) != len(srcs):
            raise InvalidArgument(f"dsts has {len(dsts)} buffers but srcs has {len(srcs)}")
        pairs = [
            (region(s, f"srcs[{i}]"), region(d, f"dsts[{i}]", writable=True))
            for i, (s, d) in enumerate(zip(srcs, dsts))
        ]
        kinds = {_kind(s, d, kind) for s, d in pairs} or {kind or "h2h"}
        if len(kinds) > 1:
            raise InvalidArgument(
                f"copy_many needs one direction for every pair, got {sorted(kinds)}; pass kind="
            )
        for i, (s, d) in enumerate(pairs):
            if s.nbytes != d.nbytes:
                raise InvalidArgument(
                    f"pair {i}: srcs[{i}] has {s.nbytes} bytes but dsts[{i}] has {d.nbytes}"
                )
        t = self._engine.copy_batch(
            [d.ptr for _, d in pairs],
            [s.ptr for s, _ in pairs],
            [s.nbytes for s, _ in pairs],
            kinds.pop(),
            _stream_arg(after),
        )
        return self._hold(t, *(r for pair in pairs for r in pair))

    def execute(
        self, plan: CopyPlan, dst: Any, src: Any, kind: str | None = None, after: Any = None
    ) -> Ticket:
        s, d = region(src, "src"), region(dst, "dst", writable=True)
        if s.nbytes == 0 or d.nbytes == 0:
            raise InvalidArgument(
                f"plan source ({s.nbytes} bytes) and destination ({d.nbytes} bytes) must be non-empty"
            )
        t = self._engine.execute(
            plan, d.ptr, d.nbytes, s.ptr, s.nbytes, _kind(s, d, kind), _stream_arg(after)
        )
        return self._hold(t, s, d)

    def _hold(self, ticket: Ticket, *regions: Region) -> Ticket:
        # The buffers must outlive the copy: hold them until a later call sees the ticket done
        # (tickets of one lane finish in order, so checking the oldest few is enough).
        while self._keep and self._keep[0][0].done():
            self._keep.popleft()
        self._keep.append((ticket, *(r.owner for r in regions)))
        return ticket

    def wait(self, ticket: Ticket, timeout: float = 60.0) -> None:
        self._engine.wait(ticket, timeout)

    def order_stream(self, ticket: Ticket, stream: Any, timeout: float = 60.0) -> None:
        self._engine.order_stream(ticket, _stream_arg(stream), timeout)

    def synchronize(self, timeout: float = 60.0) -> None:
        self._engine.synchronize(timeout)
        self._keep.clear()

    def stats(self) -> dict[str, int]:
        return self._engine.stats()
