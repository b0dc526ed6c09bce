"""Issue 15, must show: ``msrl train`` on a user's Hugging Face checkpoint, as a user runs it.

A small Qwen2 with a byte-level BPE tokenizer and a chat template, built in code, briefly fine-tuned on an
addition task so that it is right only part of the time, saved as a Hugging Face directory; then ``msrl
train`` from its path with verl-format parquet files and a verl-signature reward, on the HF engine and on
Megatron with TP 2: the reward rises (first 10 vs last 10 steps), the first validation equals transformers'
own greedy evaluation of the checkpoint, ``training/rollout_probs_diff_max`` <= 1e-5 (fp32) every step, and
the final checkpoint loads in transformers with the same tokenizer and chat template.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import hf_fixture  # noqa: E402
from msrl_core.trainer.metrics import read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = 40


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("must_show")
    base = hf_fixture.write_checkpoint(d / "base")
    return hf_fixture.finetune(base, d / "qwen2-tiny-sft")


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine", [["actor.engine=hf"], ["actor.engine=megatron", "actor.tp=2"]], ids=["hf", "tp2"]
)
def test_grpo_from_a_finetuned_hf_checkpoint(engine, finetuned, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    val_rows = hf_fixture.verl_rows(20, seed=1, split="test")
    train = hf_fixture.write_parquet(hf_fixture.verl_rows(200, seed=0), tmp_path / "data" / "train.parquet")
    val = hf_fixture.write_parquet(val_rows, tmp_path / "data" / "test.parquet")
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "msrl_core.cli", "train", f"model.path={finetuned}",
        f"data.train_files={train}",
        f"data.val_files={val}", f"reward.fn={HERE / 'hf_fixture.py'}:compute_score",
        f"trainer.output_dir={run}", "trainer.device=cpu", "data.global_batch_size=8", "rollout.n=16",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=128", "rollout.max_prompt_length=24",
        "rollout.max_response_length=4", f"trainer.steps={STEPS}", f"trainer.val_every={STEPS}",
        "actor.lr=5e-4", "actor.kl_loss_coef=0", "actor.entropy_coeff=0", *engine, "--no-progress",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    steps = [r for r in rows if "grpo/score/mean" in r]
    assert len(steps) == STEPS
    scores = [r["grpo/score/mean"] for r in steps]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    print(f"{engine}: reward first 10 steps {first:.3f}, last 10 {last:.3f}")
    assert last >= first + 0.02, (first, last)
    assert max(r["training/rollout_probs_diff_max"] for r in steps) <= 1e-5
    # the first validation is the checkpoint's greedy accuracy, as transformers computes it
    assert steps[0]["val/score/mean"] == pytest.approx(hf_fixture.greedy_eval(str(finetuned), val_rows, 4))
    assert 0.0 < steps[0]["val/score/mean"] < 1.0  # right only part of the time
    final = run / "checkpoints" / f"step_{STEPS}"
    AutoModelForCausalLM.from_pretrained(str(final))
    tok, orig = AutoTokenizer.from_pretrained(str(final)), AutoTokenizer.from_pretrained(str(finetuned))
    assert tok.chat_template == orig.chat_template and tok.get_vocab() == orig.get_vocab()
