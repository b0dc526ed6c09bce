"""End-to-end GRPO runs of the trainer on tiny configs: the HF engine in this process, the Megatron engine
(TP 1 and TP 2 over gloo) through the ``msrl`` command in a subprocess, resume, and the metrics schema."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")

import trainer_util  # noqa: E402
from msrl_core.trainer.demo import run_demo  # noqa: E402
from msrl_core.trainer.metrics import read_metrics  # noqa: E402

TINY = [*trainer_util.TINY, "trainer.val_every=2"]

SCHEMA = [
    "step",
    "grpo/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "timing/all",
    "timing/rollout",
    "timing/resharding_to_infer",
    "timing/resharding_to_train",
    "timing/reference",
    "timing/rule_reward",
    "timing/adv",
    "timing/update",
    "timing/non_overlap_rollout",
    "timing/non_overlap_update",
    "e2e_tps",
    "reshard/peak_bytes",
    "reshard/bytes_gathered",
    "dock/put_count",
    "dock/claim_count",
]
STAGES = ("rollout", "reference", "rule_reward", "adv", "update")


def _quiet(_: str) -> None:
    pass


def check_steps(rows: list[dict], steps: int, batch_rows: int, stages=STAGES) -> None:
    train = [r for r in rows if "grpo/score/mean" in r]
    assert [r["step"] for r in train] == list(range(steps))
    for r in train:
        missing = [k for k in SCHEMA if k not in r]
        assert not missing, missing
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "e2e_tps"):
            assert r[k] is not None and math.isfinite(r[k]), (k, r[k])
        assert r["training/rollout_probs_diff_max"] <= 1e-5  # fp32: the rollout samples the trained weights
        for s in stages:  # every row consumed exactly once by every stage
            assert r[f"dock/consumed_{s}"] == batch_rows, (s, r[f"dock/consumed_{s}"])
        assert r["reshard/freed_bytes"] == r["reshard/train_bytes"] > 0  # the training copy was swapped out


def test_hf_engine_short_run(tmp_path):
    res = run_demo(
        TINY + [f"trainer.output_dir={tmp_path}", "trainer.steps=3", "actor.engine=hf"],
        progress=False,
        log=_quiet,
    )
    rows = read_metrics(tmp_path)
    check_steps(rows, 3, 16)
    assert rows[0]["actor/kl_loss"] == 0.0  # the reference is the initial policy
    assert "val/score/mean" in rows[0] and "val/score/mean" in rows[-1]  # step 0 and the final policy
    assert (res.final_checkpoint / "model.safetensors").is_file()
    # the checkpoint is a Hugging Face model: transformers loads it with exactly the saved weights
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(res.final_checkpoint)).eval()
    from safetensors.torch import load_file

    saved = load_file(str(res.final_checkpoint / "model.safetensors"))
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in saved.items())
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "reward.png").is_file()


def test_off_policy_recomputes_old_log_probs(tmp_path):
    """Two mini-batches per step: old_log_p runs as a stage (after the swap back) and the ratio moves."""
    run_demo(
        TINY
        + [
            f"trainer.output_dir={tmp_path}",
            "trainer.steps=2",
            "actor.engine=hf",
            "actor.ppo_mini_batch_size=2",
        ],
        progress=False,
        log=_quiet,
    )
    rows = read_metrics(tmp_path)
    check_steps(rows, 2, 16, STAGES + ("old_log_p",))
    assert all(r["timing/old_log_p"] > 0 for r in rows if "timing/old_log_p" in r)


def test_resume_reproduces_next_step(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = TINY + ["actor.engine=hf", "trainer.val_every=0"]
    run_demo(common + [f"trainer.output_dir={full}", "trainer.steps=3"], progress=False, log=_quiet)
    run_demo(
        common + [f"trainer.output_dir={part}", "trainer.steps=2", "trainer.save_every=1"],
        progress=False,
        log=_quiet,
    )
    res = run_demo(
        common + [f"trainer.output_dir={part}", "trainer.steps=3", "trainer.resume=auto"],
        progress=False,
        log=_quiet,
    )
    assert res.steps_done == 3
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2]
    for k in ("grpo/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert b[2][k] == pytest.approx(a[2][k], rel=1e-5, abs=1e-7), k


def _cli(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "msrl_core.cli", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
def test_megatron_tp2_short_run(tmp_path):
    pytest.importorskip("megatron.core")
    out = _cli(
        [
            "demo",
            *TINY,
            f"trainer.output_dir={tmp_path}",
            "trainer.steps=2",
            "actor.engine=megatron",
            "actor.tp=2",
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    check_steps(rows, 2, 16)
    ckpt = Path(tmp_path) / "checkpoints" / "step_2"
    # only the HF weights at the top: vLLM loads every top-level *.safetensors of a directory without index
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    assert {"rank0.safetensors", "rank1.safetensors"} <= {p.name for p in (ckpt / "train_state").iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2


@pytest.mark.slow
def test_ray_dock_same_schema(tmp_path):
    pytest.importorskip("ray")
    out = _cli(
        ["demo", *TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=2", "actor.engine=hf", "--ray"]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    check_steps(read_metrics(tmp_path), 2, 16)


@pytest.mark.slow
def test_megatron_tp2_resume_continues_at_the_next_step(tmp_path):
    """Tried as a new user would: the shipped demo (Megatron TP 2) stopped with Ctrl-C could not be resumed
    (``trainer.resume with actor.tp > 1 is not supported``). Every rank now loads its own shard."""
    pytest.importorskip("megatron.core")
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["demo", *TINY, "actor.engine=megatron", "actor.tp=2", "trainer.val_every=0"]
    for args in (
        [f"trainer.output_dir={full}", "trainer.steps=3"],
        [f"trainer.output_dir={part}", "trainer.steps=2"],
        [f"trainer.output_dir={part}", "trainer.steps=3", "trainer.resume=auto"],
    ):
        out = _cli([*common, *args])
        assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "at step 2" in out.stdout
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2]
    for k in ("grpo/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert b[2][k] == pytest.approx(a[2][k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow
def test_megatron_ep2_moe_trains_as_ep1(tmp_path):
    """A Qwen3-MoE (4 experts, top-2) from its HF directory on Megatron with the experts split over 2 EP
    ranks trains as with EP 1: the same losses and grad norms (the experts' gradients are not doubled by the
    two ranks running the same tokens), probs diff <= 1e-5, and its checkpoint loads in transformers."""
    pytest.importorskip("megatron.core")
    import transformers

    moe = ["model.arch=qwen3_moe", "model.num_experts=4", "model.moe_intermediate_size=32", "actor.tp=1"]
    common = ["demo", *TINY, *moe, "demo.warmup_steps=0", "trainer.val_every=0", "trainer.steps=3"]
    rows = {}
    for ep in (1, 2):
        out = _cli([*common, f"actor.ep={ep}", f"trainer.output_dir={tmp_path / str(ep)}"])
        assert out.returncode == 0, out.stderr[-3000:]
        rows[ep] = read_metrics(tmp_path / str(ep))
    assert len(rows[2]) == 3
    for a, b in zip(rows[1], rows[2]):
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert math.isfinite(b[k]) and b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
        assert b["training/rollout_probs_diff_max"] <= 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "2" / "checkpoints" / "step_3"))
    assert model.config.num_experts == 4


@pytest.mark.slow
def test_megatron_pp2_trains_as_pp1_and_resumes(tmp_path):
    """Pipeline parallelism in the trainer's Megatron engine: PP 2 (stages in turn, activations and gradients
    broadcast in the PP group) gives PP 1's losses and grad norms, the rollout samples the trained weights,
    and a PP 2 run stopped after 2 steps and resumed continues with the uninterrupted run's step 2."""
    pytest.importorskip("megatron.core")
    common = ["demo", *TINY, "actor.engine=megatron", "trainer.val_every=0"]
    runs = [
        ("pp1", ["actor.pp=1", "trainer.steps=3"]),
        ("pp2", ["actor.pp=2", "trainer.steps=2"]),
        ("pp2", ["actor.pp=2", "trainer.steps=3", "trainer.resume=auto"]),
    ]
    for name, args in runs:
        out = _cli([*common, *args, f"trainer.output_dir={tmp_path / name}"])
        assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 2" in out.stdout
    a, b = read_metrics(tmp_path / "pp1"), read_metrics(tmp_path / "pp2")
    assert [r["step"] for r in b] == [0, 1, 2]
    for x, y in zip(a, b):
        for k in ("grpo/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert math.isfinite(y[k]) and y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), k
        assert y["training/rollout_probs_diff_max"] <= 1e-5
