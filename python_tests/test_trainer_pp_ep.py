"""The Megatron engine with pipeline and expert parallelism, through ``msrl demo`` (2 gloo processes):
``actor.pp=2`` (one stage each) and a Qwen3-MoE with ``actor.ep=2`` (2 of 4 experts each) train a few steps
with finite losses, the rollout's log-probs equal the trainer's (fp32, <= 1e-5 every step: the switch gathers
both stages' layers / both ranks' experts), every row reaches every stage once, and the final checkpoint
loads in transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from msrl_core.trainer.metrics import read_metrics  # noqa: E402
from test_trainer_e2e import TINY, _cli, check_steps  # noqa: E402

MOE = ["model.arch=qwen3_moe", "model.num_experts=4", "model.moe_intermediate_size=32"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, hf_class", [(["actor.pp=2"], "LlamaForCausalLM"), (["actor.ep=2", *MOE], "Qwen3MoeForCausalLM")]
)
def test_megatron_pp2_and_ep2_short_runs(tmp_path, layout, hf_class):
    out = _cli(
        ["demo", *TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=3", "actor.engine=megatron", *layout]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    check_steps(rows, 3, 16)  # finite losses and grad norms, probs diff <= 1e-5, each row once per stage
    train = [r for r in rows if "grpo/score/mean" in r]
    assert len({r["actor/grad_norm"] for r in train}) == 3  # the weights move between steps
    ckpt = Path(tmp_path) / "checkpoints" / "step_3"
    assert {"train_rank0.safetensors", "train_rank1.safetensors", "model.safetensors"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert type(transformers.AutoModelForCausalLM.from_pretrained(ckpt)).__name__ == hf_class
