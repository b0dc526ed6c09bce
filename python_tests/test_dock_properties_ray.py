"""The model-based state machine of test_dock_properties over the Ray backend (actors are separate
processes; same-node wire and the Ray-call path), driven from this process and from a Ray worker process
that got the dock pickled: exactly-once per stage, release/complete identity and partial reset against
the same model as the local backend."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from dock_util import init_local_ray
from msrl_core import Dock
from test_dock_properties import DockMachine, make_dock

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_up():
    init_local_ray(100)
    yield
    ray.shutdown()


def run_machine(dock: Dock, max_examples: int) -> int:
    """Runs the state machine on `dock` (reset before every example); returns this process's pid."""

    class RayDockMachine(DockMachine):
        def make_dock(self) -> Dock:
            dock.reset(force=True)  # one set of actors for every example: each starts empty
            return dock

        def teardown(self) -> None:
            pass

    run_state_machine_as_test(
        RayDockMachine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    return os.getpid()


@pytest.mark.parametrize("fast_path", [True, False], ids=["socket", "actor-calls"])
def test_state_machine_over_ray(ray_up, fast_path):
    dock = make_dock(backend="ray", fast_path=fast_path)
    try:
        run_machine(dock, 12 if fast_path else 6)
    finally:
        dock.shutdown()


def test_state_machine_from_a_worker_process(ray_up):
    # Every call comes from a Ray worker process holding an unpickled client of the driver's dock.
    dock = make_dock(backend="ray")
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])  # the worker imports this module
        task = ray.remote(num_cpus=0.25, runtime_env={"env_vars": {"PYTHONPATH": path}})(run_machine)
        pid = ray.get(task.remote(dock, 8), timeout=900)
        assert pid != os.getpid()
    finally:
        dock.shutdown()
