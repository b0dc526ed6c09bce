"""Trainer configuration: typed defaults, YAML + dotted ``key=value`` overrides (OmegaConf, as verl and
MindSpeed-RL users type them), and validation of every impossible combination before anything starts.

:func:`load_config` types the merged config once (``OmegaConf.to_object``): the rest of the trainer reads a
:class:`TrainerConfig` of plain dataclasses, never casts. With ``model.path`` (a Hugging Face checkpoint
directory) the model section comes from its ``config.json`` (:mod:`msrl_core.trainer.hf_dir`); a key set in
the YAML or an override that contradicts it is an error naming both values.

Batch units follow verl: ``data.global_batch_size`` and ``actor.ppo_mini_batch_size`` count prompts; each
prompt gives ``rollout.n`` rows (responses); ``actor.micro_batch_size`` counts rows. Use
:func:`rows_per_step` and :func:`rows_per_mini_batch` instead of recomputing them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from msrl_core.reshard.layout import ModelConfig
from msrl_core.trainer.algorithm import AGG_MODES, KL_KINDS, check_clip_ratios
from msrl_core.trainer.errors import ConfigError
from msrl_core.trainer.reward import load_reward_fn

# The allowed values of the choice keys, in one table (validate() and the docs read it).
CHOICES: Mapping[str, tuple[str, ...]] = {
    "model.arch": tuple(ModelConfig.ARCHS),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "actor.engine": ("megatron", "hf"),
    "actor.kl_loss_type": tuple(KL_KINDS),
    "actor.loss_agg_mode": tuple(AGG_MODES),
    "rollout.engine": ("hf", "vllm"),
    "algorithm.adv_estimator": ("grpo",),
    "dock.backend": ("local", "ray"),
    "trainer.device": ("auto", "cpu", "cuda", "npu"),
    "trainer.workers": ("local", "ray"),
}


@dataclass
class ModelSection:
    """The one description of the model: a Qwen2/Llama-style decoder built in code, or (``path``) the
    Hugging Face checkpoint directory whose ``config.json`` fills every other key of this section. Every
    engine (Megatron, the HF engine, the HF sampler, vLLM) reads its norm epsilon, RoPE base and positions
    from here."""

    arch: str = "qwen2"
    vocab_size: int = 128
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (Qwen3 sets its own)
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool | None = None  # None: the architecture's (Qwen2: true; Llama, Qwen3: false)
    norm_epsilon: float = 1e-6
    num_experts: int = 0  # 0: dense
    moe_intermediate_size: int = 0
    moe_router_topk: int = 2  # experts per token (config.json's num_experts_per_tok); MoE only
    moe_norm_topk_prob: bool = True  # renormalise the top-k routing weights (norm_topk_prob); MoE only
    dtype: str = "float32"
    make_vocab_size_divisible_by: int = 8  # Megatron pads the embedding to a multiple of this
    path: str | None = None


@dataclass
class ActorSection:
    """The trained policy: engine, parallel sizes, optimiser and GRPO loss knobs (verl's names)."""

    engine: str = "megatron"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1  # data-parallel replicas (world = dp x tp x pp x ep worker processes)
    lr: float = 1e-6
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    ppo_mini_batch_size: int = 8  # prompts per optimiser step (rows: x rollout.n)
    micro_batch_size: int = 8  # rows per forward/backward (gradient accumulation inside a mini-batch)
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28  # clip-higher (DAPO); set equal to clip_ratio_low for plain PPO
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"


@dataclass
class RolloutSection:
    """Sampling: engine, its TP size, ``n`` responses per prompt and the length budget."""

    engine: str = "hf"
    tp: int = 1
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_length: int = 64
    max_response_length: int = 64
    gpu_memory_utilization: float = 0.5  # vLLM only (rejected with rollout.engine=hf)
    claim_groups: int = 2  # prompt groups a rollout worker claims at once (smaller: earlier overlap)


@dataclass
class AlgorithmSection:
    """Advantage estimator (GRPO) and whether advantages are divided by the group's std."""

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True


@dataclass
class RewardSection:
    """The reward function, ``pkg.module:function`` or ``path/file.py:function``: either
    ``fn(prompt, response, answer)`` or verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)`` (chosen by its signature); it returns a number or a dict with a ``"score"``."""

    fn: str = "msrl_core.trainer.reward:rule_reward"


@dataclass
class DataSection:
    """Prompt files (JSONL or Parquet), their keys, the batch size in prompts and the held-out split."""

    train_files: str | None = None  # required (the demo writes its generated task and sets it)
    val_files: str | None = None  # None: hold out val_fraction of train_files
    prompt_key: str = "prompt"
    answer_key: str | None = None  # None: "answer", else verl's "reward_model.ground_truth"
    global_batch_size: int = 8  # prompts per step
    seed: int = 1
    val_fraction: float = 0.1


@dataclass
class DockSection:
    """Where the stages exchange rows: in-process (``local``) or Ray actors."""

    backend: str = "local"
    warehouses: int = 1
    ray_address: str | None = None  # None: start a loopback Ray when none runs


@dataclass
class ReshardSection:
    """allgather-swap bucket size in MiB per member."""

    bucket_mb: int = 64
    swap: bool = True  # swap the training weights out to host during rollout (False: keep both copies)


@dataclass
class TrainerSection:
    """Run control: steps, run directory, checkpoint/validation cadence, resume, seed, device."""

    steps: int = 100
    output_dir: str = "runs/msrl"
    save_every: int = 0  # 0: only the final checkpoint
    val_every: int = 10  # 0: no validation
    resume: bool | str | None = False  # false/null: fresh; true/"auto": latest in output_dir; else a dir
    seed: int = 1
    device: str = "auto"
    tensorboard: bool = False
    step_timeout_s: float = 600.0  # deadline of one step's stages; a stuck worker fails the step
    workers: str = "local"  # where the training ranks run: local processes, or Ray actors in placement groups
    nnodes: int = 1  # Ray placement groups, one per node (verl's trainer.nnodes)
    devices_per_node: int = 0  # ranks per node (verl's n_gpus_per_node); 0: world / nnodes


@dataclass
class TrainerConfig:
    """The whole ``msrl train`` configuration."""

    model: ModelSection = field(default_factory=ModelSection)
    actor: ActorSection = field(default_factory=ActorSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    reward: RewardSection = field(default_factory=RewardSection)
    data: DataSection = field(default_factory=DataSection)
    dock: DockSection = field(default_factory=DockSection)
    reshard: ReshardSection = field(default_factory=ReshardSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)


#: The default configuration (read-only); :func:`load_config` merges YAML and overrides on a fresh copy.
DEFAULTS: DictConfig = OmegaConf.structured(TrainerConfig)
OmegaConf.set_readonly(DEFAULTS, True)


def _schema(cls: type = TrainerConfig, prefix: str = "") -> dict[str, Any]:
    """Flat map of every dotted key to its annotated type; sections map to their dataclass."""
    out: dict[str, Any] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = hints[f.name]
        out[key] = tp
        if dataclasses.is_dataclass(tp):
            out.update(_schema(tp, key + "."))  # type: ignore[arg-type]
    return out


_SCHEMA = _schema()
_LEAVES = [k for k, v in _SCHEMA.items() if not dataclasses.is_dataclass(v)]


def _type_name(tp: Any) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        names = ["null" if a is type(None) else _type_name(a) for a in get_args(tp)]
        return " or ".join(names)
    return getattr(tp, "__name__", str(tp))


def _nearest(key: str) -> str:
    """The valid key a user most likely meant: same leaf in another section, else the closest spelling."""
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in _LEAVES if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(key, list(_SCHEMA), n=1, cutoff=0.0)
    return close[0]


def _unknown(key: str) -> ConfigError:
    return ConfigError(f"unknown config key {key!r}; did you mean {_nearest(key)!r}?")


def _check_keys(node: Any, prefix: str, source: str) -> None:
    """Reject keys the schema does not have, and scalars where a section is expected, before merging."""
    if not isinstance(node, Mapping):
        return
    for k, v in node.items():
        key = f"{prefix}{k}"
        if key not in _SCHEMA:
            while isinstance(v, Mapping) and v:  # name the full dotted key the user wrote
                k, v = next(iter(v.items()))
                key = f"{key}.{k}"
            raise ConfigError(f"{source}: " + str(_unknown(key)))
        tp = _SCHEMA[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, Mapping):
                allowed = ", ".join(f.name for f in dataclasses.fields(tp))
                raise ConfigError(f"{source}: {key!r} is a section (keys: {allowed}), got the value {v!r}")
            _check_keys(v, key + ".", source)


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value (e.g. actor.lr=1e-6)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {exc}") from exc


def _merge_error(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None)
    if key in _SCHEMA:
        value = getattr(exc, "value", None)
        return ConfigError(
            f"{source}: {key}={value!r} has the wrong type; expected {_type_name(_SCHEMA[key])}"
        )
    return ConfigError(f"{source}: {str(exc).splitlines()[0]}")


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``overrides`` (``dotted.key=value``), typed
    once into a :class:`TrainerConfig`; with ``model.path`` the model section is read from the checkpoint.

    Unknown keys and wrong types raise :class:`ConfigError` naming the key (and nearest valid key, or the
    value and expected type). The result is resolved and type-checked but not yet :func:`validate`-d.
    """
    cfg = OmegaConf.structured(TrainerConfig)
    layers: list[tuple[str, Any]] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = OmegaConf.load(p)
        except Exception as exc:  # yaml.YAMLError and OmegaConf errors; both mean an unreadable file
            raise ConfigError(f"cannot parse config file {str(p)!r}: {exc}") from exc
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got a list")
        layers.append((f"config file {str(p)!r}", loaded))
    if overrides:
        layers.append(("override", _parse_overrides(overrides)))
    explicit: dict[str, str] = {}  # model.* keys the YAML or an override sets, and where
    for source, layer in layers:
        raw = OmegaConf.to_container(layer, resolve=False)
        _check_keys(raw, "", source)
        if isinstance(raw, Mapping) and isinstance(raw.get("model"), Mapping):
            explicit.update({k: source for k in raw["model"]})
        try:
            cfg = OmegaConf.merge(cfg, layer)  # type: ignore[assignment]
        except OmegaConfBaseException as exc:
            raise _merge_error(exc, source) from exc
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve interpolation: {str(exc).splitlines()[0]}") from exc
    typed: TrainerConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    if typed.model.path:
        from msrl_core.trainer.hf_dir import fill_model_section

        fill_model_section(typed.model, explicit)
    return typed


def from_yaml(text: str) -> TrainerConfig:
    """A :class:`TrainerConfig` from the YAML :func:`save_config` wrote (a follower rank's copy)."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainerConfig), OmegaConf.create(text))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def get(cfg: TrainerConfig, key: str) -> Any:
    """The value of a dotted key (``"actor.lr"``)."""
    return functools.reduce(getattr, key.split("."), cfg)


def rows_per_step(cfg: TrainerConfig) -> int:
    """Rows (responses) generated and trained per step: prompts per step x ``rollout.n``."""
    return cfg.data.global_batch_size * cfg.rollout.n


def rows_per_mini_batch(cfg: TrainerConfig) -> int:
    """Rows per optimiser step: ``actor.ppo_mini_batch_size`` prompts x ``rollout.n``."""
    return cfg.actor.ppo_mini_batch_size * cfg.rollout.n


#: Architectures with a QKV bias (and the only ones where Hugging Face can express one).
QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe")


def model_config(model: ModelSection) -> ModelConfig:
    """The one model description (``msrl_core.models.ModelConfig``) of the model section: what every engine,
    the reshard plan and the checkpoint writer read."""
    m = model
    return ModelConfig(
        arch=m.arch,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.head_dim,
        intermediate_size=m.ffn_hidden_size,
        vocab_size=m.vocab_size,
        qkv_bias=m.arch in QKV_BIAS_ARCHS if m.qkv_bias is None else m.qkv_bias,
        tie_word_embeddings=m.tie_word_embeddings,
        num_experts=m.num_experts,
        moe_intermediate_size=m.moe_intermediate_size,
        moe_router_topk=m.moe_router_topk if m.num_experts else 0,
        moe_norm_topk_prob=m.moe_norm_topk_prob if m.num_experts else None,
        qk_norm=m.arch in ("qwen3", "qwen3_moe"),
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        dtype=m.dtype,
        rope_theta=m.rope_theta,
        norm_epsilon=m.norm_epsilon,
        max_position_embeddings=m.max_position_embeddings,
    )


# Keys that count something and must be >= 1, and those that may also be 0 (0 = off / dense).
_AT_LEAST_ONE = [
    "model.vocab_size",
    "model.hidden_size",
    "model.ffn_hidden_size",
    "model.num_layers",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.max_position_embeddings",
    "actor.dp",
    "actor.tp",
    "actor.pp",
    "actor.ep",
    "actor.ppo_mini_batch_size",
    "actor.micro_batch_size",
    "actor.ppo_epochs",
    "rollout.tp",
    "rollout.n",
    "rollout.max_prompt_length",
    "rollout.max_response_length",
    "data.global_batch_size",
    "dock.warehouses",
    "reshard.bucket_mb",
    "trainer.nnodes",
    "trainer.steps",
    "rollout.claim_groups",
    "model.make_vocab_size_divisible_by",
]
_AT_LEAST_ZERO = (
    "model.num_experts",
    "model.moe_intermediate_size",
    "trainer.save_every",
    "trainer.val_every",
    "trainer.devices_per_node",
)


def _divides(problems: list[str], a_key: str, a: int, b_key: str, b: int) -> None:
    if a >= 1 and b % a:
        allowed = [d for d in range(1, b + 1) if b % d == 0] if b >= 1 else []
        problems.append(f"{a_key}={a} does not divide {b_key}={b}; allowed: {allowed}")


def _check_scalars(cfg: TrainerConfig, problems: list[str]) -> None:
    """Choice keys hold an allowed value; counts are positive."""
    for key, allowed in CHOICES.items():
        value = get(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for keys, minimum in ((_AT_LEAST_ONE, 1), (_AT_LEAST_ZERO, 0)):
        for key in keys:
            value = get(cfg, key)
            if value < minimum:
                problems.append(f"{key}={value} must be >= {minimum}")


def _check_model(cfg: TrainerConfig, problems: list[str]) -> None:
    """Head counts divide, MoE sizes match the arch, prompt + response fit the positions."""
    m, r = cfg.model, cfg.rollout
    _divides(problems, "model.num_attention_heads", m.num_attention_heads, "model.hidden_size", m.hidden_size)
    _divides(
        problems,
        "model.num_query_groups",
        m.num_query_groups,
        "model.num_attention_heads",
        m.num_attention_heads,
    )
    moe_arch = m.arch in ("qwen3_moe", "qwen2_moe")
    if (m.num_experts > 0, m.moe_intermediate_size > 0) != (moe_arch, moe_arch):
        problems.append(
            f"model.arch={m.arch!r}, model.num_experts={m.num_experts}, model.moe_intermediate_size="
            f"{m.moe_intermediate_size}: MoE archs (qwen3_moe, qwen2_moe) need both > 0, dense archs both 0"
        )
    if m.qkv_bias and m.arch not in QKV_BIAS_ARCHS:
        problems.append(
            f"model.qkv_bias=True with model.arch={m.arch!r}: only {', '.join(QKV_BIAS_ARCHS)} have a QKV "
            "bias in the Hugging Face layout; use model.qkv_bias=false"
        )
    if m.num_experts == 0 and (
        m.moe_router_topk != ModelSection.moe_router_topk
        or m.moe_norm_topk_prob != ModelSection.moe_norm_topk_prob
    ):
        problems.append(
            f"model.moe_router_topk={m.moe_router_topk}, model.moe_norm_topk_prob={m.moe_norm_topk_prob} "
            "apply to MoE models only (model.num_experts > 0)"
        )
    elif m.num_experts and not 1 <= m.moe_router_topk <= m.num_experts:
        problems.append(
            f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts={m.num_experts}]"
        )
    if r.max_prompt_length + r.max_response_length > m.max_position_embeddings:
        problems.append(
            f"rollout.max_prompt_length={r.max_prompt_length} + rollout.max_response_length="
            f"{r.max_response_length} exceeds model.max_position_embeddings={m.max_position_embeddings}"
        )
    if m.rope_theta <= 0 or m.norm_epsilon <= 0:
        problems.append(
            f"model.rope_theta={m.rope_theta} and model.norm_epsilon={m.norm_epsilon} must be > 0"
        )


def _check_parallel(cfg: TrainerConfig, problems: list[str]) -> None:
    """TP divides the heads and KV groups, PP the layers, EP the experts; HF engines run unsharded."""
    m, a, r = cfg.model, cfg.actor, cfg.rollout
    for side in ("actor", "rollout"):
        tp = getattr(cfg, side).tp
        _divides(problems, f"{side}.tp", tp, "model.num_attention_heads", m.num_attention_heads)
        _divides(problems, f"{side}.tp", tp, "model.num_query_groups", m.num_query_groups)
    _divides(problems, "actor.pp", a.pp, "model.num_layers", m.num_layers)
    if a.ep > 1 and m.num_experts == 0:
        problems.append(f"actor.ep={a.ep} needs an MoE model (model.num_experts > 0); use actor.ep=1")
    elif a.ep > 1:
        _divides(problems, "actor.ep", a.ep, "model.num_experts", m.num_experts)
    if a.pp > 1 and m.tie_word_embeddings:
        problems.append(
            f"actor.pp={a.pp} with model.tie_word_embeddings=True: the trainer's pipeline runs untied "
            "embeddings only; use actor.pp=1"
        )
    if m.num_experts > 0 and a.engine != "megatron":
        problems.append(
            f"model.arch={m.arch!r} with actor.engine={a.engine!r}: MoE models train on the Megatron engine "
            "(actor.engine=megatron, actor.ep to shard the experts)"
        )
    if r.engine == "hf" and r.gpu_memory_utilization != RolloutSection.gpu_memory_utilization:
        problems.append(
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} applies to rollout.engine='vllm' "
            "only; remove it or use rollout.engine=vllm"
        )
    if a.engine == "hf" and (a.tp, a.pp, a.ep) != (1, 1, 1):
        problems.append(f"actor.engine='hf' trains with tp=pp=ep=1; got tp={a.tp}, pp={a.pp}, ep={a.ep}")
    if r.engine == "hf" and r.tp != 1:
        problems.append(f"rollout.engine='hf' samples with rollout.tp=1; got rollout.tp={r.tp}")
    _check_placement(cfg, problems)


def _check_placement(cfg: TrainerConfig, problems: list[str]) -> None:
    """Data parallelism runs on the Megatron engine's workers; the nodes hold the world exactly."""
    a, t = cfg.actor, cfg.trainer
    world = a.dp * a.tp * a.pp * a.ep
    if a.dp > 1 and a.engine != "megatron":
        problems.append(f"actor.dp={a.dp} needs actor.engine='megatron' (the HF engine runs one replica)")
    if a.dp > 1 and a.ep > 1:
        problems.append(
            f"actor.dp={a.dp} with actor.ep={a.ep}: data parallelism of MoE experts is not built; "
            "use one of them"
        )
    if a.dp > cfg.data.global_batch_size:
        problems.append(
            f"actor.dp={a.dp} exceeds data.global_batch_size={cfg.data.global_batch_size}: every replica "
            "needs at least one prompt group per step"
        )
    if t.workers == "local" and t.nnodes != 1:
        problems.append(
            f"trainer.nnodes={t.nnodes} needs trainer.workers='ray' (local workers run on one node)"
        )
    per_node = t.devices_per_node or (world // t.nnodes if world % t.nnodes == 0 else 0)
    if per_node * t.nnodes != world:
        problems.append(
            f"trainer.nnodes={t.nnodes} x trainer.devices_per_node={t.devices_per_node} must hold the world "
            f"actor.dp x tp x pp x ep = {world} exactly"
        )
    if t.workers == "ray" and a.engine != "megatron":
        problems.append(
            "trainer.workers='ray' places the Megatron engine's ranks; actor.engine='hf' runs in the driver"
        )


def _check_batches(cfg: TrainerConfig, problems: list[str]) -> None:
    """Prompts per step split into whole mini-batches; rows per mini-batch into whole micro-batches."""
    a, r, d = cfg.actor, cfg.rollout, cfg.data
    if r.n < 2 and cfg.algorithm.adv_estimator == "grpo":
        problems.append(f"rollout.n={r.n}: GRPO compares samples of one prompt and needs rollout.n >= 2")
    _divides(
        problems,
        "actor.ppo_mini_batch_size",
        a.ppo_mini_batch_size,
        "data.global_batch_size",
        d.global_batch_size,
    )
    _divides(
        problems,
        "actor.micro_batch_size",
        a.micro_batch_size,
        "actor.ppo_mini_batch_size*rollout.n (rows per mini-batch)",
        a.ppo_mini_batch_size * r.n,
    )


def _check_ranges(cfg: TrainerConfig, problems: list[str]) -> None:
    """Optimiser, loss and sampling values in range; data, dock and reward settings usable."""
    a, r, d = cfg.actor, cfg.rollout, cfg.data
    try:
        check_clip_ratios(a.clip_ratio_low, a.clip_ratio_high)
    except ValueError as exc:
        problems.append(f"actor.{exc}")
    if a.lr <= 0 or a.clip_grad <= 0 or a.weight_decay < 0:
        problems.append(
            f"actor.lr={a.lr} and actor.clip_grad={a.clip_grad} must be > 0, "
            f"actor.weight_decay={a.weight_decay} >= 0"
        )
    if a.kl_loss_coef < 0:
        problems.append(f"actor.kl_loss_coef={a.kl_loss_coef} must be >= 0 (0 turns the KL loss off)")
    if r.temperature <= 0:
        problems.append(f"rollout.temperature={r.temperature} must be > 0 (validation decodes greedily)")
    if not 0 < r.top_p <= 1:
        problems.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if not 0 < r.gpu_memory_utilization <= 1:
        problems.append(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]")
    if not d.train_files:
        problems.append("data.train_files is not set; give a JSONL or Parquet file of prompts")
    if not 0 <= d.val_fraction < 1:
        problems.append(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    if cfg.trainer.step_timeout_s <= 0:
        problems.append(f"trainer.step_timeout_s={cfg.trainer.step_timeout_s} must be > 0")
    if cfg.dock.ray_address and cfg.dock.backend != "ray":
        problems.append(f"dock.ray_address={cfg.dock.ray_address!r} needs dock.backend='ray'")
    try:
        load_reward_fn(cfg.reward.fn)  # imports the user's module now, not mid-run
    except ConfigError as exc:
        problems.append(str(exc))


def validate(cfg: TrainerConfig) -> None:
    """Raise :class:`ConfigError` listing every impossible combination (values and what is allowed)."""
    problems: list[str] = []
    _check_scalars(cfg, problems)
    if not problems:  # the relations below divide by the counts
        for check in (_check_model, _check_parallel, _check_batches, _check_ranges):
            check(cfg, problems)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def to_yaml(cfg: TrainerConfig) -> str:
    """The config as YAML (what ``config.yaml`` holds and :func:`from_yaml` reads back)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: TrainerConfig, run_dir: str | os.PathLike[str]) -> Path:
    """Write the resolved ``cfg`` to ``run_dir/config.yaml`` (atomically) and return its path."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "config.yaml"
    tmp = out / ".config.yaml.tmp"
    tmp.write_text(to_yaml(cfg), encoding="utf-8")
    os.replace(tmp, target)
    return target


__all__ = [
    "CHOICES",
    "DEFAULTS",
    "ConfigError",
    "TrainerConfig",
    "from_yaml",
    "get",
    "load_config",
    "model_config",
    "rows_per_mini_batch",
    "rows_per_step",
    "save_config",
    "to_yaml",
    "validate",
]
