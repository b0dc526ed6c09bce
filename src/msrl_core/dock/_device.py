"""Device tensors in and out of the dock through the native copy engine (values never use ``.cpu()``).

A put of a device tensor copies it device->host into a pinned staging block of a ``PinnedPool`` with
``CopyEngine.copy`` and puts from there (the block returns to the pool when the put is done); a fetch
with ``device=`` allocates the tensor on that device and copies host->device with the engine (pageable
sources go through the engine's pinned bounce buffers). One engine and one pool per process, made on
first use. The engine uses the process's runtime (``MSRL_DEVICE`` or auto) and its current device; a
padded fetch's small bool mask is moved with torch's ``.to(device)``.

Every copy is ordered after the caller's current stream on the tensor's device (``after=``): a put of a
tensor that a kernel (or the ``.contiguous()`` copy here) has just produced reads it only once that work
is done, and a fetch writes a freshly allocated tensor only after the work that used its memory before.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from msrl_core.copy import current_stream
from msrl_core.errors import InvalidArgument

_WAIT_S = 60.0
_lock = threading.Lock()
_io: DeviceIO | None = None


def is_device_tensor(x: Any) -> bool:
    """True for a torch tensor that is not in host memory (tests substitute CPU tensors here)."""
    return x.device.type != "cpu"


class DeviceIO:
    def __init__(self) -> None:
        from msrl_core.copy import CopyEngine
        from msrl_core.memory import PinnedPool

        self.engine = CopyEngine()
        self.pool = PinnedPool()

    def to_host(self, t: Any) -> np.ndarray:
        """A contiguous tensor's bytes as a numpy uint8 array over a pinned staging block."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return np.empty(0, np.uint8)
        buf = self.pool.allocate(nbytes)
        self.engine.copy(buf, t, after=current_stream(t.device)).wait(_WAIT_S)
        return np.frombuffer(memoryview(buf), dtype=np.uint8, count=nbytes)

    def to_device(self, t: Any, device: Any) -> Any:
        """A CPU tensor copied into a new tensor of the same shape and dtype on ``device``."""
        import torch

        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        if t.numel():
            self.engine.copy(out, t.contiguous(), after=current_stream(out.device)).wait(_WAIT_S)
        return out


def device_io() -> DeviceIO:
    global _io
    with _lock:
        if _io is None:
            _io = DeviceIO()
        return _io


def device_to_numpy(t: Any, storage_dtype: np.dtype) -> np.ndarray:
    """A device tensor (already of the column's dtype) as a host numpy array of ``storage_dtype``."""
    t = t.contiguous()
    return device_io().to_host(t).view(storage_dtype).reshape(tuple(t.shape))


def check_device_output(device: Any, output: str, copy: bool) -> None:
    if device is None:
        return
    if output != "torch":
        raise InvalidArgument(
            f"fetch(device={device!r}) returns torch tensors: pass output='torch', got {output!r}"
        )
    if not copy:
        raise InvalidArgument(f"fetch(device={device!r}) copies to the device: copy=False does not apply")
