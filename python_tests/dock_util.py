"""Shared by the dock's Ray tests: one local Ray per test module (loopback, small object store)."""

from __future__ import annotations


def init_local_ray(object_store_mb: int = 100) -> None:
    import ray

    ray.init(
        address="local",  # a new instance: never join another cluster running on this machine
        num_cpus=2,
        object_store_memory=object_store_mb * 1024 * 1024,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
