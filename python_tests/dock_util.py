"""Shared by the dock's tests: one local Ray per test module (loopback, small object store) and the keyed
store's small dock."""

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


def keyed_dock_args(**kw) -> dict:
    """The keyed-store tests' small dock (prompts declared, responses and rewards at run time)."""
    from msrl_core import Column

    args = dict(
        columns={"prompts": Column("int64", ragged=True, max_len=4)},
        stages={"reward": ["prompts", "responses"], "update": ["prompts", "rewards"]},
        capacity=8,
    )
    args.update(kw)
    return args
