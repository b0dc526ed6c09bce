"""Runs TransferQueue 0.1.11's own end-to-end test files, unmodified, once per storage backend.

`make test-tq` passes this directory and the three e2e files that ship in TransferQueue's wheel
(site-packages/tests/e2e/: the key-value interface, the lifecycle, checkpointing). This conftest, loaded
first because its directory is an argument, registers `_BackendSwitch` as a plugin, which

- parametrizes each upstream module over ``BACKENDS`` (module scope, so TransferQueue is set up once per
  backend and file): the files that read ``TQ_TEST_BACKEND`` through their ``backend_name`` fixture get
  that fixture parametrized and "MsrlDock" added to their ``BACKEND_CONFIGS``; test_checkpoint_e2e.py,
  whose ``_TQ_CONFIG`` names SimpleStorage, gets its ``ray_init`` fixture parametrized and ``_TQ_CONFIG``
  set for the backend just before ``ray_init`` runs (its ``tq_system`` depends on ``ray_init``, so it is
  rebuilt per backend);
- wraps ``ray.init`` so the tests' own calls start a loopback Ray with a small object store, whose
  worker processes import msrl_core's TransferQueue backend (``worker_process_setup_hook``);
- gives TransferQueue's actors fractional CPUs (its controller and storage units ask for a whole CPU
  each; on a 2-core machine ``tq.init`` then waits for CPUs that never come);
- skips, for MsrlDock only, the tests in ``MSRL_DOCK_LEFT_OUT`` (each with its reason) and fails the run
  when an upstream file or a backend's tests are missing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
from tq_harness import (
    BACKENDS,
    COMPAT,
    MSRL_DOCK_LEFT_OUT,
    RAY_TEST_OPTIONS,
    SETUP_HOOK,
    TQ_ACTOR_CPUS,
    UPSTREAM_FILES,
    backend_config,
)

# The compat pass runs the compat tests (there `transfer_queue` is msrl_core's module), the other the rest.
collect_ignore = (
    ["test_msrl_dock_backend.py", "test_msrl_dock_fields.py"] if COMPAT else ["test_compat_transfer_queue.py"]
)

# Ray reads this when it is imported: without it a single-node Ray ignores _node_ip_address="127.0.0.1".
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# The upstream files' module-scoped Ray fixtures.
RAY_FIXTURES = ("ray_init", "ray_cluster")


def _upstream_name(path: Path) -> str | None:
    return path.name if path.name in UPSTREAM_FILES and path.parent.name == "e2e" else None


def _wrap_ray_init() -> None:
    import ray

    if getattr(ray.init, "_msrl_wrapped", False):
        return
    original = ray.init

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        if not args and "address" not in kwargs:
            for key, value in RAY_TEST_OPTIONS.items():
                kwargs.setdefault(key, value)
            runtime_env = dict(kwargs.get("runtime_env") or {})
            runtime_env.setdefault("worker_process_setup_hook", SETUP_HOOK)
            kwargs["runtime_env"] = runtime_env
        return original(*args, **kwargs)

    init._msrl_wrapped = True  # type: ignore[attr-defined]
    ray.init = init


def _fractional_tq_actors() -> None:
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    for actor_cls in (TransferQueueController, SimpleStorageUnit):
        actor_cls._default_options["num_cpus"] = TQ_ACTOR_CPUS


class _BackendSwitch:
    def __init__(self) -> None:
        self.seen_files: set[str] = set()
        self.counts: dict[tuple[str, str], int] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pycollect_makemodule(self, module_path: Path, parent: Any):  # noqa: ANN201
        yield
        name = _upstream_name(Path(module_path))
        if name is not None:
            self.seen_files.add(name)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        name = _upstream_name(Path(metafunc.definition.path))
        if name is None:
            return
        module = metafunc.module
        if hasattr(module, "BACKEND_CONFIGS"):
            for backend in BACKENDS:
                module.BACKEND_CONFIGS.setdefault(backend, backend_config(backend))
        # The module's Ray fixture is parametrized too (its value unused), so each backend gets its own Ray
        # session: TQ's module state in reused Ray worker processes would outlive the previous controller.
        ray_fixtures = [f for f in RAY_FIXTURES if f in metafunc.fixturenames]
        if "backend_name" in metafunc.fixturenames:
            names = ["backend_name", *ray_fixtures]
            values = [tuple([b] * len(names)) if ray_fixtures else b for b in BACKENDS]
            metafunc.parametrize(names, values, indirect=ray_fixtures, ids=list(BACKENDS), scope="module")
        elif hasattr(module, "_TQ_CONFIG") and "ray_init" in metafunc.fixturenames:
            metafunc.parametrize("ray_init", BACKENDS, indirect=True, scope="module")
        else:
            raise pytest.UsageError(f"{name}::{metafunc.function.__name__}: no backend switch applies")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any):  # noqa: ANN201
        if fixturedef.argname == "ray_init" and getattr(request, "param", None) in BACKENDS:
            from omegaconf import OmegaConf

            module = request.module
            if hasattr(module, "_TQ_CONFIG"):
                module._TQ_CONFIG = OmegaConf.create(backend_config(request.param))
        yield

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            name = _upstream_name(Path(item.path))
            if name is None:
                continue
            params = item.callspec.params
            backend = params.get("backend_name", params.get("ray_init"))
            self.counts[(name, backend)] = self.counts.get((name, backend), 0) + 1
            test_id = f"{name}::{'::'.join(item.nodeid.split('::')[1:]).split('[')[0]}"
            if backend == "MsrlDock" and test_id in MSRL_DOCK_LEFT_OUT:
                reason = f"left out for MsrlDock: {MSRL_DOCK_LEFT_OUT[test_id]}"
                item.add_marker(pytest.mark.skip(reason=reason))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        wanted = os.environ.get("MSRL_TQ_UPSTREAM")
        if wanted is None:
            return
        files = wanted.split()
        missing = [f for f in files if f not in self.seen_files]
        empty = [f"{f} ({b})" for f in files for b in BACKENDS if self.counts.get((f, b), 0) == 0]
        if missing or empty:
            raise pytest.UsageError(
                f"TransferQueue's e2e files not collected: missing {missing}, no tests for {empty}"
            )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.counts:
            terminalreporter.write_line("TransferQueue e2e tests collected per file and backend:")
            for (f, b), n in sorted(self.counts.items()):
                terminalreporter.write_line(f"  {f} [{b}]: {n}")


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _wrap_ray_init()
    _fractional_tq_actors()
    if COMPAT:
        import msrl_core.compat.transfer_queue as compat

        compat.install()
    if not config.pluginmanager.has_plugin("msrl_tq_backend_switch"):
        config.pluginmanager.register(_BackendSwitch(), "msrl_tq_backend_switch")
