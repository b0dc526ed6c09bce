"""msrl_core: the data-movement engine of RL training for LLMs.

Public names are re-exported here; the native module ``msrl_core._core`` is private.
"""

from msrl_core import errors, reshard
from msrl_core._core import DeviceBuffer, Stream
from msrl_core.copy import CopyEngine, CopyPlan, Ticket, descriptors
from msrl_core.dock import Batch, Claim, Column, Dock, Padded, Ragged
from msrl_core.memory import PinnedBuffer, PinnedPool, Registration
from msrl_core.reshard import allgather_swap
from msrl_core.runtime import get_runtime, runtime_info

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Claim",
    "Column",
    "Dock",
    "Padded",
    "Ragged",
    "CopyEngine",
    "CopyPlan",
    "DeviceBuffer",
    "PinnedBuffer",
    "PinnedPool",
    "Registration",
    "Stream",
    "Ticket",
    "__version__",
    "allgather_swap",
    "descriptors",
    "errors",
    "get_runtime",
    "reshard",
    "runtime_info",
]
