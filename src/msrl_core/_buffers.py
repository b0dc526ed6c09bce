"""Turns the buffers callers hold (torch tensors, numpy arrays, pinned buffers) into (ptr, nbytes, where).

Only contiguous memory is accepted: a strided view would need a copy the caller did not ask for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from msrl_core import _core
from msrl_core.errors import InvalidArgument


@dataclass(frozen=True)
class Region:
    ptr: int
    nbytes: int
    on_device: bool  # device memory of the selected runtime (host memory on the host backend)
    pinned: bool
    owner: Any  # keeps the memory alive while the region is in use
    read_only: bool = False  # a read-only numpy array: never a copy's destination, registered read-only


def _torch_region(t: Any, name: str, writable: bool) -> Region:
    if not t.is_contiguous():
        raise InvalidArgument(
            f"{name}: tensor of shape {tuple(t.shape)} is not contiguous; call .contiguous()"
        )
    nbytes = t.numel() * t.element_size()
    on_device = t.device.type != "cpu"
    pinned = False
    if not on_device:
        try:
            pinned = bool(t.is_pinned())
        except RuntimeError:  # no accelerator build: nothing is pinned
            pinned = False
    return Region(int(t.data_ptr()), nbytes, on_device, pinned, t)


def region(obj: Any, name: str = "buffer", writable: bool = False) -> Region:
    """Describe ``obj``'s memory. ``writable`` rejects read-only numpy arrays for destinations."""
    if isinstance(obj, _core.PinnedBuffer):
        return Region(obj.ptr, obj.nbytes, False, True, obj)
    if isinstance(obj, _core.DeviceBuffer):
        return Region(obj.ptr, obj.nbytes, True, False, obj)
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        return _torch_region(obj, name, writable)
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            arr = np.frombuffer(memoryview(obj), dtype=np.uint8)
        except TypeError:
            raise InvalidArgument(
                f"{name}: {type(obj).__name__} is not a buffer; "
                "pass a torch tensor, numpy array or PinnedBuffer"
            ) from None
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"{name}: numpy array of shape {arr.shape} is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"{name}: numpy array is read-only and cannot be a destination")
    ptr = arr.__array_interface__["data"][0]
    pinned = _core.PinnedPool.is_pinned(ptr, arr.nbytes) if ptr else False
    return Region(ptr, arr.nbytes, False, pinned, arr, read_only=not arr.flags.writeable)
