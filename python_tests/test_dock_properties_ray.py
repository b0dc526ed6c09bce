"""The model-based state machine of test_dock_properties over the Ray backend (actors are separate
processes; same-node wire and the Ray-call path): exactly-once per stage, release/complete identity and
partial reset against the same model as the local backend."""

from __future__ import annotations

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


@pytest.mark.parametrize("fast_path", [True, False], ids=["socket", "actor-calls"])
def test_state_machine_over_ray(ray_up, fast_path):
    dock = make_dock(backend="ray", fast_path=fast_path)

    class RayDockMachine(DockMachine):
        def make_dock(self) -> Dock:
            dock.reset(force=True)  # one set of actors for every example: each starts empty
            return dock

        def teardown(self) -> None:
            pass

    try:
        run_state_machine_as_test(
            RayDockMachine,
            settings=settings(
                max_examples=12 if fast_path else 6,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        dock.shutdown()
