"""An honest install and config (issue 15, "tried as a new user would"):

- ``pip install .`` alone, then ``msrl train``: one line naming the missing ``train`` extra, exit 2 (was a
  traceback, ``No module named 'omegaconf'``); the extra lists everything the trainer imports (megatron-core
  was in none); ``requires-python`` is what the config module needs (3.10, was ">=3.9");
- every config key changes what a run does, or is rejected with a message naming it (``model.path`` was
  read nowhere);
- ``model.norm_epsilon`` and ``model.rope_theta`` reach every engine as they are (the HF engine, the HF
  sampler and the vLLM config hard-coded 1e-6; Megatron got ``int(rope_theta)``);
- the Megatron rank-0 -> follower header carries floats as floats (a learning rate below 5e-13 became 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")

import torch  # noqa: E402

import trainer_util  # noqa: E402
from msrl_core.cli import TRAIN_MODULES  # noqa: E402
from msrl_core.trainer import algorithm as A  # noqa: E402
from msrl_core.trainer.config import _LEAVES, ModelSection, load_config, model_config, validate  # noqa: E402
from msrl_core.trainer.errors import ConfigError, DataError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_train_extra_brings_what_the_trainer_imports_and_python_is_310():
    project = _pyproject()["project"]
    names = {
        r.split(">")[0].split("=")[0].split("<")[0].strip() for r in project["optional-dependencies"]["train"]
    }
    assert names == set(TRAIN_MODULES.values())
    assert "megatron-core" in names  # the default engine
    assert project["requires-python"] == ">=3.10"  # the config's `str | None` dataclass fields need 3.10


def test_missing_extra_is_one_line_naming_it(tmp_path):
    # an environment after `pip install .` alone: the trainer's dependencies cannot be imported
    code = textwrap.dedent(
        """
        import sys
        for m in ("omegaconf", "transformers", "megatron"):
            sys.modules[m] = None
        from msrl_core.cli import main
        sys.exit(main(["train", "x.yaml"]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "pip install '.[train]' in the msrl_core checkout" in lines[0]
    assert "omegaconf" in lines[0] and "megatron-core" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


def _section(**kw) -> ModelSection:
    base = dict(
        arch="qwen2", vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=1, num_attention_heads=2,
        num_query_groups=1, max_position_embeddings=64, make_vocab_size_divisible_by=8,
    )  # fmt: skip
    return ModelSection(**{**base, **kw})


def test_norm_epsilon_and_rope_theta_reach_the_hf_engine_and_sampler():
    from msrl_core.reshard import to_hf
    from msrl_core.trainer.engines.hf import HFSampler, HFTrainEngine, hf_config

    m = _section(norm_epsilon=1e-5, rope_theta=123456.5)
    eng = HFTrainEngine(m, seed=0)
    sampler = HFSampler(m, to_hf(eng.model_config, eng.parallel).allocate_inference()[1])
    for c in (hf_config(m), eng.model.config, sampler.model.config):
        assert c.rms_norm_eps == 1e-5
        assert c.rope_parameters["rope_theta"] == 123456.5
    # the forward uses them: another epsilon gives other logits
    tokens = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        a = eng.logits(tokens)
        eng.model = HFTrainEngine(_section(norm_epsilon=1e-1, rope_theta=123456.5), seed=0).model
        b = eng.logits(tokens)
    assert not torch.allclose(a, b)


MEGATRON_PROBE = """
import torch
from msrl_core.models import build_gpt
from msrl_core.reshard import Parallel
from msrl_core.trainer.config import ModelSection, model_config
from msrl_core.trainer.engines.megatron import init_distributed, _free_port
init_distributed(0, 1, _free_port())
m = ModelSection(arch="qwen2", vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                 num_attention_heads=2, num_query_groups=1, max_position_embeddings=64,
                 make_vocab_size_divisible_by=8, norm_epsilon=1e-5, rope_theta=1000.5)
g = build_gpt(model_config(m), Parallel(tp=1), seed=0)
inv = g.rotary_pos_emb.inv_freq
want = 1.0 / (1000.5 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
print(g.config.layernorm_epsilon, bool(torch.allclose(inv.cpu().float(), want)))
"""


def test_norm_epsilon_and_rope_theta_reach_megatron_as_they_are():
    pytest.importorskip("megatron.core")
    out = subprocess.run([sys.executable, "-c", MEGATRON_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["1e-05", "True"]  # int(1000.5) = 1000 would give other frequencies


# ---- every key changes behaviour or is rejected ----------------------------------------------------------

#: Model keys: another value gives another model description (reshard layout + transformers config).
MODEL_KEYS = {
    "model.arch": "qwen3",
    "model.vocab_size": 64,
    "model.hidden_size": 32,
    "model.ffn_hidden_size": 64,
    "model.num_layers": 1,
    "model.num_attention_heads": 2,
    "model.num_query_groups": 1,
    "model.head_dim": 32,
    "model.max_position_embeddings": 512,
    "model.rope_theta": 500000.0,
    "model.tie_word_embeddings": True,
    "model.qkv_bias": False,
    "model.norm_epsilon": 1e-5,
    "model.dtype": "bfloat16",
    "model.make_vocab_size_divisible_by": 16,
}
#: Loss keys: another value gives another loss on the same tensors.
LOSS_KEYS = {
    "actor.clip_ratio_low": 0.01,
    "actor.clip_ratio_high": 0.5,
    "actor.kl_loss_coef": 0.5,
    "actor.kl_loss_type": "k1",
    "actor.entropy_coeff": 0.3,
    "actor.loss_agg_mode": "seq-mean-token-sum",
}
#: Keys whose value a whole run exercises (steps, checkpoints, resume, engines, Ray): the named tests.
RUN_KEYS = {
    "actor.engine": "test_trainer_e2e.py::test_megatron_tp2_short_run",
    "actor.tp": "test_trainer_e2e.py::test_megatron_tp2_short_run",
    "actor.dp": "test_trainer_dp.py::test_dp2_trains_as_dp1",
    "dock.backend": "test_trainer_e2e.py::test_ray_dock_same_schema",
    "trainer.steps": "test_trainer_e2e.py::test_hf_engine_short_run",
    "trainer.output_dir": "test_trainer_e2e.py::test_hf_engine_short_run",
    "trainer.save_every": "test_trainer_e2e.py::test_resume_reproduces_next_step",
    "trainer.resume": "test_trainer_e2e.py::test_resume_reproduces_next_step",
    "trainer.val_every": "test_trainer_e2e.py::test_hf_engine_short_run",
    "trainer.tensorboard": "test_trainer_metrics.py::test_tensorboard_is_optional",
}
#: Every other key: one training step with another value ends otherwise (or is rejected naming the key).
STEP_KEYS = {
    "model.path": "/nonexistent/qwen",
    "model.num_experts": 4,
    "model.moe_intermediate_size": 8,
    "actor.pp": 2,
    "actor.ep": 2,
    "model.moe_router_topk": 1,
    "model.moe_norm_topk_prob": False,
    "actor.lr": 0.1,
    "actor.weight_decay": 0.5,
    "actor.clip_grad": 1e-4,
    "actor.ppo_mini_batch_size": 2,
    "actor.micro_batch_size": 4,
    "actor.ppo_epochs": 2,
    "rollout.engine": "vllm",
    "rollout.tp": 2,
    "rollout.n": 2,
    "rollout.temperature": 0.5,
    "rollout.top_p": 0.5,
    "rollout.max_prompt_length": 4,
    "rollout.max_response_length": 1,
    "rollout.gpu_memory_utilization": 0.9,
    "rollout.claim_groups": 4,
    "algorithm.adv_estimator": "ppo",
    "algorithm.norm_adv_by_std": False,
    "reward.fn": "REWARD_FILE:half",
    "data.train_files": "OTHER_FILE",
    "data.val_files": "OTHER_FILE",
    "data.prompt_key": "question",
    "data.answer_key": "solution",
    "data.global_batch_size": 2,
    "data.seed": 5,
    "data.val_fraction": 0.5,
    "dock.warehouses": 1,
    "dock.ray_address": "auto",
    "reshard.bucket_mb": 64,
    "reshard.swap": False,
    "trainer.seed": 7,
    "trainer.device": "cuda" if not torch.cuda.is_available() else "npu",
    "trainer.step_timeout_s": 1e-6,
    "trainer.workers": "ray",  # the HF engine runs in the driver: rejected
    "trainer.nnodes": 2,  # local workers run on one node: rejected
    "trainer.devices_per_node": 2,  # 1 node x 2 does not hold a world of 1: rejected
}


def test_every_key_is_in_one_table():
    tables = [MODEL_KEYS, LOSS_KEYS, RUN_KEYS, STEP_KEYS]
    listed = [k for t in tables for k in t]
    assert sorted(listed) == sorted(_LEAVES), set(listed) ^ set(_LEAVES)
    for test in RUN_KEYS.values():
        file, name = test.split("::")
        assert f"def {name}(" in (ROOT / "python_tests" / file).read_text(), test


def _valid(*overrides: str):
    return load_config(None, ["data.train_files=prompts.jsonl", *overrides])


def _ov(key: str, value) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"


@pytest.mark.parametrize("key", sorted(MODEL_KEYS))
def test_model_key_changes_the_model_description(key):
    from msrl_core.trainer.engines.hf import hf_config

    def describe(cfg):
        m = cfg.model
        return model_config(m), hf_config(m).to_dict()

    base = _valid()
    changed = _valid(_ov(key, MODEL_KEYS[key]))
    validate(changed)
    assert describe(changed) != describe(base), key


@pytest.mark.parametrize("key", sorted(LOSS_KEYS))
def test_loss_key_changes_the_loss(key):
    from msrl_core.trainer.grpo import loss_settings

    g = torch.Generator().manual_seed(0)
    lp, old, ref = (torch.randn(4, 6, generator=g) * 0.5 - 1 for _ in range(3))
    adv, ent = torch.randn(4, generator=g), torch.rand(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[0, 3:] = 0

    def loss(cfg):
        return float(A.actor_loss(lp, old, ref, adv, mask, ent, **loss_settings(cfg.actor))[0])

    assert loss(_valid(_ov(key, LOSS_KEYS[key]))) != loss(_valid()), key


@pytest.fixture(scope="module")
def step_data(tmp_path_factory):
    from msrl_core.trainer.task import arithmetic_records, write_jsonl

    d = tmp_path_factory.mktemp("keys")
    main = write_jsonl(arithmetic_records(40, 2, 5, seed=0), str(d / "main.jsonl"))
    other = write_jsonl(arithmetic_records(40, 2, 5, seed=1), str(d / "other.jsonl"))
    reward = d / "half_reward.py"
    reward.write_text("def half(prompt, response, answer):\n    return 0.5 * (response == answer)\n")
    return main, other, str(reward)


def _one_step(overrides: list[str], out: Path, data: tuple[str, str, str]):
    """What one step does: its metrics (no timings), the weights after it, the engine's forward count and
    the dock's layout; or the rejection (its message must name the key)."""
    from msrl_core.trainer.run import open_session

    args = [
        *trainer_util.TINY_RUN,
        f"data.train_files={data[0]}",
        f"trainer.output_dir={out}",
        *[o.replace("OTHER_FILE", data[1]).replace("REWARD_FILE", data[2]) for o in overrides],
    ]
    try:
        cfg = load_config(None, args)
        s = open_session(cfg, log=lambda _: None)
    except (ConfigError, DataError) as e:
        return ("rejected", str(e))
    try:
        calls = [0]
        engine = s.engine.engine  # the HF engine inside the trainer's LocalActor
        logits = engine.logits

        def counted(tokens):
            calls[0] += 1
            return logits(tokens)

        engine.logits = counted
        s.trainer.runner.deadline_s = cfg.trainer.step_timeout_s
        try:
            m = s.trainer.step(next(s.loader), s.val_records or None)
        except Exception as e:  # noqa: BLE001 - the step's failure is this value's behaviour
            return ("failed", type(e).__name__)
        keep = {k: round(v, 6) for k, v in m.items() if not k.startswith("timing/") and "_us" not in k}
        keep.pop("e2e_tps", None)
        weights = hashlib.sha256(b"".join(v.float().numpy().tobytes() for v in engine.state_dict().values()))
        stats = s.trainer.dock.stats()
        return ("ran", keep, weights.hexdigest(), calls[0], len(stats["warehouses"]), stats["capacity"])
    finally:
        s.trainer.close()
        s.engine.close()


@pytest.fixture(scope="module")
def baseline(step_data, tmp_path_factory):
    return _one_step([], tmp_path_factory.mktemp("base"), step_data)


@pytest.mark.parametrize("key", sorted(STEP_KEYS))
def test_key_changes_a_step_or_is_rejected(key, baseline, step_data, tmp_path):
    if key == "rollout.engine":
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            pytest.skip("vLLM is installed here: the vLLM tier runs rollout.engine=vllm")
    assert baseline[0] == "ran", baseline
    got = _one_step([_ov(key, STEP_KEYS[key])], tmp_path, step_data)
    if got[0] == "rejected":
        assert key in got[1] or key.split(".")[-1] in got[1], (key, got[1])
    else:
        assert got != baseline, key


def test_dataclass_config_is_typed_once():
    cfg = _valid("actor.lr=2e-5")
    assert dataclasses.is_dataclass(cfg) and dataclasses.is_dataclass(cfg.actor)
    assert type(cfg.actor.lr) is float and type(cfg.rollout.n) is int
