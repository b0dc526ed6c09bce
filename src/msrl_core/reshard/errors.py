"""Reshard errors. ``ReshardError`` is a ``ValueError`` (and an ``msrl_core.errors.MsrlError`` when the native
module is importable) so callers can catch either."""

from __future__ import annotations

try:  # the native error hierarchy, when built
    from msrl_core.errors import InvalidArgument as _Base  # type: ignore[attr-defined]
    from msrl_core.errors import Timeout as _Timeout  # type: ignore[attr-defined]
except Exception:  # pragma: no cover - plan building works without the extension
    _Base = ValueError  # type: ignore[misc,assignment]
    _Timeout = TimeoutError  # type: ignore[misc,assignment]


class ReshardError(_Base):  # type: ignore[valid-type,misc]
    """Bad layout, parameter set, parallel sizes or call order; the message names the offender."""


class SwapStateError(ReshardError):
    """allgather-swap called in the wrong state (swap_back twice, new switch before swap back)."""


class SwitchAborted(ReshardError):
    """A switch failed part-way (an OOM, a bad tensor, a failed copy) on this rank or another one; the ranks
    agreed on it after the bucket or step and every rank raised, with the training weights intact."""


class SwitchTimeout(SwitchAborted, _Timeout):  # type: ignore[valid-type,misc]
    """A collective of the switch did not finish within its ``timeout`` (a peer died or hangs)."""


class CheckpointError(ReshardError):
    """A Hugging Face checkpoint that cannot be used: a missing or mis-shaped tensor, a missing file, a
    ``config.json`` of an unsupported architecture or feature; the message names the file and the tensor or
    key."""
