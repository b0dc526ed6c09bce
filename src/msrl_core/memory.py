"""Pinned host memory: a reusable pool, and zero-copy pinning of buffers the caller already owns."""

from __future__ import annotations

from typing import Any

from msrl_core import _core
from msrl_core._buffers import region
from msrl_core.errors import InvalidArgument
from msrl_core.runtime import get_runtime

PinnedBuffer = _core.PinnedBuffer
Registration = _core.Registration


class PinnedPool:
    """Page-locked host blocks, allocated once and reused.

    Blocks come back as :class:`PinnedBuffer` objects that support the buffer protocol, so
    ``numpy.frombuffer(buf, dtype)`` and ``torch.frombuffer(buf, dtype=...)`` are zero-copy views. A
    block returns to the pool when the last view of it is gone.

    >>> pool = PinnedPool()
    >>> buf = pool.allocate(1 << 20)
    >>> pool.stats()["in_use"] >= 1 << 20
    True
    """

    def __init__(self, capacity: int = 0, device: str | None = None) -> None:
        self._pool = _core.PinnedPool(get_runtime(device), capacity)

    def allocate(self, nbytes: int) -> PinnedBuffer:
        return self._pool.allocate(nbytes)

    def register(self, obj: Any) -> Registration:
        """Pin ``obj``'s memory in place (a contiguous numpy array or CPU tensor) until ``release()``.

        A read-only numpy array (``np.load(..., mmap_mode="r")``, ``np.frombuffer`` of bytes) is registered
        read-only (CUDA's ``cudaHostRegisterReadOnly``): its pages may be mapped read-only, which a plain
        registration refuses. Copies may read it, never write it."""
        r = region(obj, "register")
        if r.on_device:
            raise InvalidArgument("register: only host memory can be pinned; got device memory")
        if r.nbytes == 0:
            raise InvalidArgument("register: buffer is empty (0 bytes)")
        reg = self._pool.register(r.ptr, r.nbytes, r.read_only)
        reg.owner = r.owner  # the memory must outlive its registration
        return reg

    def stats(self) -> dict[str, int]:
        return self._pool.stats()

    def trim(self) -> None:
        self._pool.trim()

    def close(self) -> None:
        self._pool.close()

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
