"""Exception classes of msrl_core.

Every error raised by the native core or the Python layer derives from :class:`MsrlError` and from the
builtin that fits, so ``except ValueError`` keeps working for callers that do not know msrl_core.
"""

from msrl_core._core import (
    Closed,
    DeviceError,
    InvalidArgument,
    MsrlError,
    NotFound,
    OutOfMemory,
    Timeout,
    Unavailable,
)


class Unsupported(MsrlError, NotImplementedError):  # type: ignore[misc]
    """The operation exists but this backend or configuration does not support it."""


__all__ = [
    "Closed",
    "DeviceError",
    "InvalidArgument",
    "MsrlError",
    "NotFound",
    "OutOfMemory",
    "Timeout",
    "Unavailable",
    "Unsupported",
]
