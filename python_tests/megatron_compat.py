"""Thin re-export for the reshard tests: the CPU compatibility layer lives in the package
(``msrl_core.trainer.engines.megatron_cpu``)."""

from __future__ import annotations

import warnings

from msrl_core.trainer.engines import megatron_cpu


def patch() -> None:
    warnings.filterwarnings("ignore")
    megatron_cpu.activate()
