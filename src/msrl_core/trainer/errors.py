"""Exceptions of the trainer. Each derives from :class:`msrl_core.errors.MsrlError` and the fitting builtin,
so ``except ValueError`` keeps working; messages name the bad value and what is allowed."""

from __future__ import annotations

from msrl_core.errors import InvalidArgument, MsrlError


class ConfigError(InvalidArgument):
    """The trainer configuration is invalid: unknown key, wrong type or an impossible combination."""


class DataError(InvalidArgument):
    """A prompt file is missing, unreadable, or has a malformed record (the message names file and line)."""


class RewardError(MsrlError, RuntimeError):  # type: ignore[misc]
    """A reward function could not be loaded or raised/returned garbage (names the function and prompt)."""


__all__ = ["ConfigError", "DataError", "RewardError"]
