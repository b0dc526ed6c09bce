"""Device runtime selection: ``MSRL_DEVICE=auto|host|cuda|npu``."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

from msrl_core import _core
from msrl_core.errors import InvalidArgument

_ALLOWED = ("auto", "host", "cpu", "cuda", "gpu", "npu", "acl", "ascend")
_lock = threading.Lock()
_default: _core.Runtime | None = None
_dirs_set = False

# Where pip puts the CUDA runtime that torch's wheels depend on (CUDA 13: nvidia/cu13/lib; CUDA 12:
# nvidia/cuda_runtime/lib). It is not on the loader path, so a process that has not imported torch yet
# (``runtime_info()``, a benchmark) would not find libcudart by its soname.
_WHEEL_LIBRARY_DIRS = {"cuda": ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib")}


def vendor_library_dirs(backend: str, search_path: Iterable[str] | None = None) -> list[str]:
    """Folders that hold ``backend``'s vendor library outside the loader path: the CUDA wheels' lib folders
    under every entry of ``search_path`` (default ``sys.path``); for ``acl``, ``$ASCEND_HOME_PATH/lib64``."""
    dirs: list[str] = []
    for base in sys.path if search_path is None else search_path:
        for rel in _WHEEL_LIBRARY_DIRS.get(backend, ()):
            d = os.path.join(base or ".", rel)
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    home = os.environ.get("ASCEND_HOME_PATH")
    if backend == "acl" and home and os.path.isdir(os.path.join(home, "lib64")):
        dirs.append(os.path.join(home, "lib64"))
    return dirs


def _register_library_dirs() -> None:
    """Tell the native loader where the vendor libraries of this Python environment are (once)."""
    global _dirs_set
    if not _dirs_set:
        for backend in ("cuda", "acl"):
            _core.set_library_dirs(backend, vendor_library_dirs(backend))
        _dirs_set = True


def _requested() -> str:
    value = os.environ.get("MSRL_DEVICE", "auto").strip().lower() or "auto"
    if value not in _ALLOWED:
        raise InvalidArgument(f"MSRL_DEVICE={value!r} is not a device; allowed: {', '.join(_ALLOWED)}")
    return value


def get_runtime(device: str | None = None) -> _core.Runtime:
    """The process-wide runtime for ``device`` (default: ``MSRL_DEVICE``, else auto)."""
    global _default
    with _lock:
        _register_library_dirs()
    if device is not None:
        return _core.get_runtime(device)
    with _lock:
        if _default is None:
            _default = _core.get_runtime(_requested())
        return _default


def runtime_info() -> dict[str, Any]:
    """Which backends are available here, and which one msrl_core uses.

    >>> info = runtime_info()
    >>> info["selected"] in ("host", "cuda", "acl")
    True
    """
    with _lock:
        _register_library_dirs()
    backends = {name: {"available": ok, "detail": detail} for name, ok, detail in _core.probe_backends()}
    return {
        "requested": _requested(),
        "selected": get_runtime().name,
        "backends": backends,
    }
