"""Measured (not summed) memory of a switch.

:class:`MemoryProbe` measures the peak of the bytes *allocated while it is active* on one device:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the bytes allocated at
  entry (the caching allocator's own tally);
- CPU (and any other device): a ``TorchDispatchMode`` that sees every torch op, counts each output storage
  that is new (aliases no input storage) and subtracts it when the storage is freed (a ``weakref`` finaliser
  on the storage). Every temporary torch makes is seen, so an extra copy shows up in the peak.

Not seen on the CPU: memory allocated outside torch ops (the native copy engine's bounce buffers, gloo's
internal buffers, pinned-pool slabs: the pool reports those itself) and storages resized in place
(``resize_``); these are stated beside the figures that use the probe.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["MemoryProbe"]


class MemoryProbe:
    """``with MemoryProbe(device) as m: ...`` then ``m.peak_bytes`` (bytes above the level at entry)."""

    def __init__(self, device: Any = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.peak_bytes = 0
        self.live_bytes = 0  # still allocated at exit (CPU tally) / allocated - entry level (CUDA)
        self._mode: Any = None
        self._base = 0

    def __enter__(self) -> MemoryProbe:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _Tally()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            self.live_bytes = torch.cuda.memory_allocated(self.device) - self._base
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes, self.live_bytes = self._mode.peak, self._mode.cur


def _make_tally_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Tally(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.cur = self.peak = 0
            self._live: dict[int, int] = {}
            self._lock = threading.Lock()

        def _free(self, key: int) -> None:
            with self._lock:
                self.cur -= self._live.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            out = func(*args, **(kwargs or {}))
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)
            }
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                key, nb = st.data_ptr(), st.nbytes()
                if nb == 0 or key in inputs or key in self._live:
                    continue
                with self._lock:
                    self._live[key] = nb
                    self.cur += nb
                    self.peak = max(self.peak, self.cur)
                weakref.finalize(st, self._free, key)
            return out

    return Tally


def _Tally() -> Any:
    return _make_tally_class()()
