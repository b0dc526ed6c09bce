"""The transfer dock (sample flow): warehouses hold tensor bytes, per-stage controllers hold readiness."""

from msrl_core.dock._dock import Dock
from msrl_core.dock._types import Batch, Claim, Column, Padded, Ragged

__all__ = ["Batch", "Claim", "Column", "Dock", "Padded", "Ragged"]
