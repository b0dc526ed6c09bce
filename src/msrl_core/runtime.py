"""Device runtime selection: ``MSRL_DEVICE=auto|host|cuda|npu``."""

from __future__ import annotations

import os
import threading
from typing import Any

from msrl_core import _core
from msrl_core.errors import InvalidArgument

_ALLOWED = ("auto", "host", "cpu", "cuda", "gpu", "npu", "acl", "ascend")
_lock = threading.Lock()
_default: _core.Runtime | None = None


def _requested() -> str:
    value = os.environ.get("MSRL_DEVICE", "auto").strip().lower() or "auto"
    if value not in _ALLOWED:
        raise InvalidArgument(f"MSRL_DEVICE={value!r} is not a device; allowed: {', '.join(_ALLOWED)}")
    return value


def get_runtime(device: str | None = None) -> _core.Runtime:
    """The process-wide runtime for ``device`` (default: ``MSRL_DEVICE``, else auto)."""
    global _default
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
    backends = {name: {"available": ok, "detail": detail} for name, ok, detail in _core.probe_backends()}
    return {
        "requested": _requested(),
        "selected": get_runtime().name,
        "backends": backends,
    }
