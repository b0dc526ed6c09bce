"""``model.path``: a Hugging Face checkpoint directory as the trainer's model (issue 15).

Tried as a new user would: ``model.path=/nonexistent/qwen`` was accepted silently (the key was read nowhere),
and a prompt such as "What is 1+1?" failed on the demo's character alphabet (the tokenizer was hard-wired).
Now config.json fills the model section (a contradicting override names both values), the tokenizer and chat
template come from the directory, and the weights reach the engines through the reshard plan in reverse.
Bad input is one message, a non-zero exit, and nothing written outside the run directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import hf_fixture  # noqa: E402
from msrl_core.cli import main  # noqa: E402
from msrl_core.trainer.config import load_config  # noqa: E402
from msrl_core.trainer.errors import ConfigError  # noqa: E402
from msrl_core.trainer.metrics import read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return hf_fixture.write_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-tiny")


def test_config_json_fills_the_model_section(ckpt):
    cfg = load_config(None, [f"model.path={ckpt}", "data.train_files=x.parquet"])
    c = json.loads((ckpt / "config.json").read_text())
    m = cfg.model
    assert (m.arch, m.vocab_size, m.hidden_size, m.num_layers) == (
        "qwen2",
        c["vocab_size"],
        c["hidden_size"],
        c["num_hidden_layers"],
    )
    assert m.rope_theta == 1e6 and m.norm_epsilon == c["rms_norm_eps"] and m.qkv_bias is True
    # an override equal to config.json is fine; a contradicting one names both values
    load_config(None, [f"model.path={ckpt}", "model.hidden_size=32"])
    with pytest.raises(
        ConfigError, match=r"model.hidden_size=64 \(override\) contradicts 32 in .*config.json"
    ):
        load_config(None, [f"model.path={ckpt}", "model.hidden_size=64"])


def test_tokenizer_renders_chat_messages_and_keeps_strings(ckpt):
    from transformers import AutoTokenizer

    from msrl_core.trainer.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(ckpt))
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    msgs = [{"role": "user", "content": "What is 1+1?"}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.encode(msgs) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.encode("What is 1+1?") == hf("What is 1+1?")["input_ids"]  # a string as it is
    assert tok.eos_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)
    assert tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.decode(hf("12")["input_ids"] + [tok.eos_id] + hf("9")["input_ids"]) == "12"


def _job(tmp_path: Path, ckpt: Path, *extra: str, reward: str = "compute_score") -> list[str]:
    train = hf_fixture.write_parquet(hf_fixture.verl_rows(24, seed=0), tmp_path / "data" / "train.parquet")
    val = hf_fixture.write_parquet(
        hf_fixture.verl_rows(8, seed=1, split="test"), tmp_path / "data" / "test.parquet"
    )
    return [
        f"model.path={ckpt}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"reward.fn={HERE / 'hf_fixture.py'}:{reward}",
        f"trainer.output_dir={tmp_path / 'run'}",
        "actor.engine=hf",
        "trainer.device=cpu",
        "data.global_batch_size=4",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=16",
        "rollout.max_prompt_length=24",
        "rollout.max_response_length=4",
        "trainer.steps=2",
        "trainer.val_every=1",
        "actor.lr=1e-3",
        *extra,
    ]


def test_hf_engine_trains_from_the_checkpoint(tmp_path, ckpt):
    """Verl parquet + a verl-signature reward from a HF directory: the first validation equals transformers'
    own greedy evaluation of the checkpoint, the rollout samples the trained weights, and the final checkpoint
    is a HF directory transformers loads with the same tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = _job(tmp_path, ckpt)
    assert main(["train", "--no-progress", *args]) == 0
    rows = read_metrics(tmp_path / "run")
    train = [r for r in rows if "grpo/score/mean" in r]
    assert len(train) == 2 and all(r["training/rollout_probs_diff_max"] <= 1e-5 for r in train)
    assert "reward/has_number/mean" in train[0]  # the dict reward's extra entry
    want = hf_fixture.greedy_eval(str(ckpt), hf_fixture.verl_rows(8, seed=1, split="test"), 4)
    assert train[0]["val/score/mean"] == pytest.approx(want, abs=1e-9)
    final = tmp_path / "run" / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert model.config.rope_parameters["rope_theta"] == 1e6
    tok, orig = AutoTokenizer.from_pretrained(str(final)), AutoTokenizer.from_pretrained(str(ckpt))
    assert tok.chat_template == orig.chat_template and tok.get_vocab() == orig.get_vocab()
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id


# ---- bad input: one message, a non-zero exit, nothing written outside the run directory --------------------


def _bad(tmp_path: Path, make) -> tuple[int, str]:
    """Run ``msrl train`` on the job ``make(tmp_path) -> overrides``; the return code and stderr, after
    checking that nothing but the run directory appeared."""
    args = make(tmp_path)
    before = {p for p in tmp_path.rglob("*")}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(["train", "--no-progress", *args])
    finally:
        os.chdir(cwd)
    after = {p for p in tmp_path.rglob("*")}
    outside = sorted(str(p) for p in after - before if "run" not in p.relative_to(tmp_path).parts)
    assert not outside, outside
    return rc, err.getvalue()


def _copy(ckpt: Path, to: Path) -> Path:
    shutil.copytree(ckpt, to)
    return to


def _missing(tmp_path):
    return _job(tmp_path, tmp_path / "no-such-model")


def _no_weights(tmp_path):
    d = _copy(hf_fixture.write_checkpoint(tmp_path / "src"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    return _job(tmp_path, d)


def _partial_index(tmp_path):
    d = _copy(hf_fixture.write_checkpoint(tmp_path / "src"), tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return _job(tmp_path, d)


def _missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(hf_fixture.write_checkpoint(tmp_path / "src"), tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    return _job(tmp_path, d)


def _unknown_arch(tmp_path):
    d = _copy(hf_fixture.write_checkpoint(tmp_path / "src"), tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    c["model_type"], c["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(c))
    return _job(tmp_path, d)


def _no_chat_template(tmp_path):
    return _job(tmp_path, hf_fixture.write_checkpoint(tmp_path / "m", chat_template=None))


def _contradiction(tmp_path):
    return _job(tmp_path, hf_fixture.write_checkpoint(tmp_path / "m"), "model.num_layers=3")


def _bad_reward(tmp_path):
    return _job(tmp_path, hf_fixture.write_checkpoint(tmp_path / "m"), reward="string_reward")


@pytest.mark.parametrize(
    "make, message",
    [
        (_missing, r"model.path='.*no-such-model' is not a directory"),
        (_no_weights, r"holds no weights: neither model.safetensors nor model.safetensors.index.json"),
        (_partial_index, r"partial checkpoint: .*names \['model-00002-of-00002.safetensors'\]"),
        (_missing_tensor, r"model.layers.1.mlp.down_proj.weight"),
        (_unknown_arch, r"unsupported architecture: model_type 'gpt2'.*supported model_type: llama"),
        (_no_chat_template, r"chat messages but the tokenizer has no chat template"),
        (_contradiction, r"model.num_layers=3 \(override\) contradicts 2 in .*config.json"),
        (_bad_reward, r"returned 'right', not a number"),
    ],
)
def test_bad_input_is_one_message(tmp_path, make, message):
    import re

    rc, err = _bad(tmp_path, make)
    assert rc != 0, err
    assert re.search(message, err), err
    assert "Traceback" not in err, err
