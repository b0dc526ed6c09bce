"""Shared settings of the TransferQueue tier: the backends, their configs, Ray's test options."""

from __future__ import annotations

import os
from typing import Any

# MSRL_TQ_COMPAT=1: a run with msrl_core.compat.transfer_queue installed as the module `transfer_queue`
# (TransferQueue's own controller and storage never start); it runs TQ's key-value e2e file.
COMPAT = os.environ.get("MSRL_TQ_COMPAT") == "1"
# MSRL_TQ_BACKENDS=SimpleStorage runs one backend (e.g. to compare a failure with TransferQueue's own).
BACKENDS = (
    ("Compat",)
    if COMPAT
    else tuple(b for b in os.environ.get("MSRL_TQ_BACKENDS", "SimpleStorage,MsrlDock").split(",") if b)
)
# What every Ray worker process runs first (Ray's worker_process_setup_hook).
SETUP_HOOK = (
    "msrl_core.compat.transfer_queue.install" if COMPAT else "msrl_core.integrations.transfer_queue.register"
)

# The upstream files this tier runs (relative to site-packages/tests/e2e).
UPSTREAM_FILES = ("test_kv_interface_e2e.py", "test_e2e_lifecycle_consistency.py", "test_checkpoint_e2e.py")

# Tests left out for MsrlDock: they inspect SimpleStorage's own checkpoint files or its own rule.
MSRL_DOCK_LEFT_OUT = {
    "test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields": (
        "asserts SimpleStorage's checkpoint files (simple_storage/storage_unit_info.json)"
    ),
    "test_checkpoint_e2e.py::TestIncludeStorageFalse::test_storage_saved_is_true": (
        "asserts SimpleStorage's own rule (include_storage=False is forced to True for "
        "AsyncSimpleStorageManager) and its simple_storage/ directory"
    ),
    "test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_on_storage_unit_count_mismatch": (
        "edits SimpleStorage's simple_storage/storage_unit_info.json"
    ),
}

# MsrlDock's config block, as a user would write it under transfer_queue.backend.MsrlDock.
MSRL_DOCK_TEST_CONFIG: dict[str, Any] = {"capacity": 4096, "warehouses": 2}

# address="local": always a Ray of its own (a bare ray.init() joins whatever cluster /tmp/ray names, e.g.
# another user's on a shared machine).
RAY_TEST_OPTIONS: dict[str, Any] = {
    "address": "local",
    "num_cpus": 4,
    "object_store_memory": 256 * 2**20,
    "include_dashboard": False,
    "_node_ip_address": "127.0.0.1",
}
TQ_ACTOR_CPUS = 0.1


def backend_config(name: str) -> dict[str, Any]:
    """The TransferQueue config the upstream files use, for either backend."""
    cfg: dict[str, Any] = {"controller": {"polling_mode": True}, "backend": {"storage_backend": name}}
    if name == "SimpleStorage":
        cfg["backend"]["SimpleStorage"] = {"total_storage_size": 200, "num_data_storage_units": 2}
    elif name in ("MsrlDock", "Compat"):  # the compat module reads the MsrlDock block only
        cfg["backend"]["storage_backend"] = "MsrlDock"
        cfg["backend"]["MsrlDock"] = dict(MSRL_DOCK_TEST_CONFIG)
    else:
        raise ValueError(f"unknown backend {name!r}; this tier runs {BACKENDS}")
    return cfg
