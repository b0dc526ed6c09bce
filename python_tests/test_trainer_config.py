"""Trainer config: defaults, YAML + dotted overrides, clear errors for unknown keys, wrong types and
impossible combinations, and the saved resolved config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from msrl_core.errors import MsrlError
from msrl_core.trainer.config import (
    DEFAULTS,
    ConfigError,
    load_config,
    model_config,
    rows_per_mini_batch,
    rows_per_step,
    save_config,
    validate,
)

ISSUE_KEYS = {
    "model": (
        "arch",
        "vocab_size",
        "hidden_size",
        "ffn_hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
        "qkv_bias",
        "dtype",
        "path",
    ),
    "actor": (
        "engine",
        "tp",
        "pp",
        "ep",
        "lr",
        "clip_grad",
        "ppo_mini_batch_size",
        "micro_batch_size",
        "ppo_epochs",
        "clip_ratio_low",
        "clip_ratio_high",
        "kl_loss_coef",
        "kl_loss_type",
        "entropy_coeff",
        "loss_agg_mode",
        "weight_decay",
    ),
    "rollout": ("engine", "tp", "n", "temperature", "top_p", "max_prompt_length", "max_response_length"),
    "algorithm": ("adv_estimator", "norm_adv_by_std"),
    "reward": ("fn",),
    "data": (
        "train_files",
        "val_files",
        "prompt_key",
        "answer_key",
        "global_batch_size",
        "seed",
        "val_fraction",
    ),
    "dock": ("backend", "warehouses", "ray_address"),
    "reshard": ("bucket_mb",),
    "trainer": ("steps", "output_dir", "save_every", "val_every", "resume", "seed", "device", "tensorboard"),
}


def valid(*overrides: str):
    return load_config(None, ["data.train_files=prompts.jsonl", *overrides])


def test_defaults_have_every_issue_key_and_validate():
    for section, keys in ISSUE_KEYS.items():
        for key in keys:
            assert OmegaConf.select(DEFAULTS, f"{section}.{key}", default="<missing>") != "<missing>", key
    with pytest.raises(Exception):  # noqa: B017 - read-only: any OmegaConf error will do
        DEFAULTS.actor.tp = 2
    cfg = valid()
    validate(cfg)
    assert cfg.actor.engine == "megatron" and cfg.rollout.engine == "hf" and cfg.dock.backend == "local"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  lr: 3.0e-4\n  tp: 2\nrollout:\n  n: 8\ndata:\n  train_files: a.jsonl\n")
    cfg = load_config(str(path), ["actor.lr=1e-5", "trainer.resume=auto", "model.path=null"])
    assert cfg.actor.lr == pytest.approx(1e-5)  # the override wins over the file
    assert cfg.actor.tp == 2 and cfg.rollout.n == 8 and cfg.data.train_files == "a.jsonl"
    assert cfg.trainer.resume == "auto" and cfg.model.path is None
    assert isinstance(cfg.actor.lr, float)
    validate(cfg)


def test_interpolation_is_resolved(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  seed: 7\ndata:\n  seed: ${trainer.seed}\n  train_files: x.jsonl\n")
    assert load_config(path, []).data.seed == 7


@pytest.mark.parametrize(
    "override, nearest",
    [
        ("actor.lrr=1", "actor.lr"),
        ("actor.temperature=0.5", "rollout.temperature"),  # right name, wrong section
        ("trainer.step=3", "trainer.steps"),
        ("rollout.num=3", "rollout.n"),
        ("modle.hidden_size=8", "model.hidden_size"),
    ],
)
def test_unknown_key_names_nearest(override, nearest):
    with pytest.raises(ConfigError, match=f"unknown config key '{override.split('=')[0]}'.*'{nearest}'"):
        valid(override)


def test_unknown_key_in_yaml_names_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  clip_ratio_hi: 0.3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*'actor.clip_ratio_hi'.*'actor.clip_ratio_high'"):
        load_config(path, [])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actor.tp=two", "actor.tp='two'.*expected int"),
        ("actor.lr=fast", "actor.lr='fast'.*expected float"),
        ("trainer.tensorboard=maybe", "trainer.tensorboard='maybe'.*expected bool"),
        ("rollout.n=2.5", "rollout.n=2.5.*expected int"),
        ("trainer.resume=3", r"trainer.resume=3.*expected bool or str or null"),
        ("model.path=null", None),
        ("actor=3", "'actor' is a section .*engine, tp"),
    ],
)
def test_wrong_type_names_key_value_and_type(override, expected):
    if expected is None:  # an Optional key takes null
        assert valid(override).model.path is None
        return
    with pytest.raises(ConfigError, match=expected):
        valid(override)


def test_config_error_types_and_bad_files(tmp_path):
    assert issubclass(ConfigError, MsrlError) and issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse config file"):
        load_config(bad, [])
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst, [])
    with pytest.raises(ConfigError, match=r"'actor.tp' is not of the form dotted.key=value"):
        load_config(None, ["actor.tp"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.tp=3"], r"actor.tp=3 does not divide model.num_attention_heads=4; allowed: \[1, 2, 4\]"),
        (["actor.tp=4"], r"actor.tp=4 does not divide model.num_query_groups=2; allowed: \[1, 2\]"),
        (["actor.pp=3"], r"actor.pp=3 does not divide model.num_layers=2"),
        (["rollout.engine=vllm", "rollout.tp=3"], r"rollout.tp=3 does not divide model.num_attention_heads"),
        (["rollout.tp=2"], r"rollout.engine='hf' samples with rollout.tp=1"),
        (["actor.engine=hf", "actor.tp=2"], r"actor.engine='hf' trains with tp=pp=ep=1"),
        (["actor.ep=2"], r"actor.ep=2 needs an MoE model"),
        (["actor.engine=hf", "actor.dp=2"], r"actor.dp=2 needs actor.engine='megatron'"),
        (["actor.dp=0"], r"actor.dp=0 must be >= 1"),
        (["actor.dp=99"], r"actor.dp=99 exceeds data.global_batch_size="),
        (["trainer.nnodes=2"], r"trainer.nnodes=2 needs trainer.workers='ray'"),
        (
            ["trainer.workers=ray", "trainer.nnodes=2", "actor.dp=3"],
            r"trainer.nnodes=2 x trainer.devices_per_node=0",
        ),
        (["trainer.devices_per_node=3", "actor.dp=2"], r"must hold the world actor.dp x tp x pp x ep = 2"),
        (["trainer.workers=gpu"], r"trainer.workers"),
        (
            ["actor.ppo_mini_batch_size=3"],
            r"actor.ppo_mini_batch_size=3 does not divide data.global_batch_size=8",
        ),
        (
            ["actor.micro_batch_size=5"],
            r"actor.micro_batch_size=5 does not divide actor.ppo_mini_batch_size\*rollout.n .*=32",
        ),
        (["rollout.n=1"], r"rollout.n=1: GRPO .* needs rollout.n >= 2"),
        (["actor.clip_ratio_low=1.0"], r"actor.clip_ratio_low must be in \[0, 1\), got 1.0"),
        (["actor.clip_ratio_high=-0.1"], r"actor.clip_ratio_high must be >= 0"),
        (["actor.kl_loss_type=k4"], r"actor.kl_loss_type='k4' is not one of k1, kl, k2, mse, k3, low_var_kl"),
        (["actor.loss_agg_mode=sum"], r"actor.loss_agg_mode='sum' is not one of token-mean"),
        (["model.arch=gpt2"], r"model.arch='gpt2' is not one of llama, qwen2"),
        (["rollout.engine=sglang"], r"rollout.engine='sglang' is not one of hf, vllm"),
        (["trainer.device=tpu"], r"trainer.device='tpu' is not one of auto, cpu, cuda, npu"),
        (
            ["model.num_query_groups=3"],
            r"model.num_query_groups=3 does not divide model.num_attention_heads=4",
        ),
        (["rollout.max_response_length=250"], r"exceeds model.max_position_embeddings=256"),
        (["rollout.top_p=0"], r"rollout.top_p=0.0 must be in \(0, 1\]"),
        (["rollout.temperature=0"], r"rollout.temperature=0.0 must be > 0"),
        (["data.val_fraction=1.0"], r"data.val_fraction=1.0 must be in \[0, 1\)"),
        (["dock.ray_address=auto"], r"dock.ray_address='auto' needs dock.backend='ray'"),
        (["reward.fn=mymodule.f"], r"reward.fn='mymodule.f' must be of the form pkg.module:function"),
        (["data.train_files=null"], r"data.train_files is not set"),
        (["actor.tp=0"], r"actor.tp=0 must be >= 1"),
        (["data.global_batch_size=0"], r"data.global_batch_size=0 must be >= 1"),
        (["model.num_experts=4"], r"MoE archs .* need both > 0"),
    ],
)
def test_validate_impossible_combinations(overrides, message):
    cfg = valid(*overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_validate_lists_every_problem_at_once():
    cfg = valid("actor.tp=3", "actor.pp=3")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "actor.tp=3" in str(info.value) and "actor.pp=3" in str(info.value)


def test_valid_parallel_configs_pass_and_untrained_layouts_are_rejected():
    validate(valid("actor.tp=2", "rollout.engine=vllm", "rollout.tp=2"))
    validate(valid("actor.tp=2", "actor.pp=2"))
    with pytest.raises(ConfigError, match=r"actor.pp=2 with model.tie_word_embeddings=True"):
        validate(valid("actor.pp=2", "model.tie_word_embeddings=true"))
    moe = ["model.arch=qwen3_moe", "model.num_experts=4", "model.moe_intermediate_size=32", "actor.ep=2"]
    validate(valid(*moe))
    with pytest.raises(ConfigError, match=r"model.arch='qwen3_moe' with actor.engine='hf'"):
        validate(valid(*moe[:3], "actor.engine=hf"))


def test_resume_takes_bool_auto_or_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  resume: false\ndata:\n  train_files: null\n")  # as the demo config has it
    cfg = load_config(path, [])
    assert cfg.trainer.resume is False and cfg.data.train_files is None
    assert load_config(path, ["trainer.resume=true"]).trainer.resume is True
    assert load_config(path, ["trainer.resume=runs/x/step_5"]).trainer.resume == "runs/x/step_5"


def test_batch_helpers_and_model_config():
    cfg = valid("data.global_batch_size=6", "rollout.n=5", "actor.ppo_mini_batch_size=3")
    assert rows_per_step(cfg) == 30 and rows_per_mini_batch(cfg) == 15
    mc = model_config(valid("model.num_query_groups=1", "model.tie_word_embeddings=true").model)
    assert (mc.arch, mc.num_key_value_heads, mc.intermediate_size, mc.head_dim) == ("qwen2", 1, 128, 16)
    assert mc.tie_word_embeddings and mc.qkv_bias and not mc.qk_norm
    assert mc.make_vocab_size_divisible_by == 8
    assert model_config(valid("model.arch=qwen3").model).qk_norm


def test_save_config_round_trips(tmp_path):
    cfg = valid("actor.lr=2e-5", "trainer.resume=auto")
    path = save_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path, [])
    assert again == cfg
    assert not list((tmp_path / "run").glob(".*tmp"))
