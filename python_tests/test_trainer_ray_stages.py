"""Stages as Ray actors (``dock.backend=ray``): rule_reward and adv run as Ray actors with fractional CPUs
over the same Ray dock, the model stages as threads beside their engines; the metrics schema is the local
run's, each row is consumed once per stage, and failures inside an actor (a raising reward function, a
killed actor) end the run with the thread path's message, a non-zero exit and no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")

import trainer_util  # noqa: E402
from msrl_core.trainer.demo import run_demo  # noqa: E402
from msrl_core.trainer.metrics import read_metrics  # noqa: E402
from msrl_core.trainer.stages import ACTOR_NUM_CPUS, StageRunner, StageSpec, grpo_stages  # noqa: E402

TINY = [*trainer_util.TINY, "trainer.val_every=0", "actor.engine=hf", "trainer.step_timeout_s=120"]

# Records where it ran (a Ray actor id, or "driver") and scores like the demo's rule reward; with
# MODE=raise or MODE=die it fails in step 1 (after the 16 rows of step 0) by raising or killing its process.
REWARD = """
import os, signal
from msrl_core.trainer.reward import rule_reward
calls = 0
def reward(prompt, response, answer):
    global calls
    calls += 1
    try:
        import ray
        where = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    except Exception:
        where = None
    with open({log!r}, "a") as f:
        f.write(f"{{where or 'driver'}}\\n")
    if calls > 16 and {mode!r} == "raise":
        raise ValueError("cannot score")
    if calls > 16 and {mode!r} == "die" and where:
        os.kill(os.getpid(), signal.SIGKILL)
    return rule_reward(prompt, response, answer)
"""


def _reward(tmp_path, mode: str) -> tuple[str, str]:
    log = str(tmp_path / "where.log")
    mod = tmp_path / f"reward_{mode}.py"
    mod.write_text(REWARD.format(log=log, mode=mode))
    return f"reward.fn={mod}:reward", log


def _cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "msrl_core.cli", "demo", *TINY, *args, "--ray", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_reward_and_adv_are_placed_on_actors():
    table = {s.name: s.placement for s in grpo_stages(16, 4, 2, use_reference=True, recompute_old=True)}
    assert table == {
        "rollout": "trainer",
        "reference": "trainer",
        "rule_reward": "actor",
        "adv": "actor",
        "old_log_p": "trainer",
        "update": "trainer",
    }
    assert 0 < ACTOR_NUM_CPUS < 1
    with pytest.raises(ValueError, match="'gpu'"):
        StageRunner(None, [StageSpec("x", ("a",), (), 1, placement="gpu")], {"x": print}, 1.0)  # type: ignore[arg-type]


@pytest.mark.slow
def test_ray_stage_actors_same_schema_as_local(tmp_path):
    spec, log = _reward(tmp_path, "ok")
    ray_dir = tmp_path / "ray"
    out = _cli([f"trainer.output_dir={ray_dir}", "trainer.steps=2", spec])
    assert out.returncode == 0, out.stderr[-3000:]
    where = Path(log).read_text().split()
    assert len(where) == 32 and "driver" not in where  # every score was computed in a Ray actor
    assert len(set(where)) == 1  # one rule_reward actor, reused across steps
    rows = [r for r in read_metrics(ray_dir) if "grpo/score/mean" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for s in ("rollout", "reference", "rule_reward", "adv", "update"):
            assert r[f"dock/consumed_{s}"] == 16, s  # each row consumed exactly once per stage
        assert r["timing/rule_reward"] > 0 and r["timing/adv"] > 0  # the actors' busy time is recorded
        assert r["dock/claim_count"] >= 5  # the actors' claims are counted with the threads'
    local = run_demo(
        [*TINY, f"trainer.output_dir={tmp_path / 'local'}", "trainer.steps=1"],
        progress=False,
        log=lambda _: None,
    )
    assert set(rows[0]) == set(local.rows[0])  # the same metrics schema as the local run


@pytest.mark.slow
def test_ray_actor_reward_error_is_the_thread_paths_message(tmp_path):
    spec, _ = _reward(tmp_path, "raise")
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = _cli([f"trainer.output_dir={run}", "trainer.steps=3", spec])
    assert time.monotonic() - t0 < 280
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error in stage 'rule_reward': reward function" in out.stderr
    assert "raised ValueError: cannot score (prompt '" in out.stderr
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().split("\n") if x] == [0]


@pytest.mark.slow
def test_killed_stage_actor_fails_within_the_deadline(tmp_path):
    spec, _ = _reward(tmp_path, "die")
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = _cli([f"trainer.output_dir={run}", "trainer.steps=3", spec])
    assert time.monotonic() - t0 < 280  # step deadline 120 s; the death is seen at once, not at it
    assert out.returncode == 1, out.stderr[-3000:]
    assert "the Ray actor of stage 'rule_reward' died" in out.stderr
    assert [r["step"] for r in read_metrics(run)] == [0]
