"""Reshard errors. ``ReshardError`` is a ``ValueError`` (and an ``msrl_core.errors.MsrlError`` when the native
module is importable) so callers can catch either."""

from __future__ import annotations

try:  # the native error hierarchy, when built
    from msrl_core.errors import InvalidArgument as _Base  # type: ignore[attr-defined]
except Exception:  # pragma: no cover - plan building works without the extension
    _Base = ValueError  # type: ignore[misc,assignment]


class ReshardError(_Base):  # type: ignore[valid-type,misc]
    """Bad layout, parameter set, parallel sizes or call order; the message names the offender."""


class SwapStateError(ReshardError):
    """allgather-swap called in the wrong state (swap_back twice, new switch before swap back)."""
