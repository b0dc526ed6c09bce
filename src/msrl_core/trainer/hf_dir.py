"""``model.path``: a Hugging Face checkpoint directory as the trainer's model.

- :func:`fill_model_section`: ``config.json`` (through ``msrl_core.models.ModelConfig``) fills the model
  section; a key the YAML or an override set to another value is a :class:`ConfigError` naming both values.
  The directory must hold ``config.json`` and the weights (``model.safetensors``, or
  ``model.safetensors.index.json`` with every shard it names) holding every tensor the model needs.
- :func:`load_megatron_shard`: this rank's Megatron-layout weights, read with
  ``msrl_core.models.load_hf_checkpoint`` (the reshard plan run in reverse).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from msrl_core.trainer.errors import ConfigError

#: model section key -> the ``msrl_core.models.ModelConfig`` field that config.json gives it.
SECTION_FIELDS = {
    "arch": "arch",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
    "qkv_bias": "qkv_bias",
    "norm_epsilon": "norm_epsilon",
    "num_experts": "num_experts",
    "moe_intermediate_size": "moe_intermediate_size",
    "moe_router_topk": "moe_router_topk",
    "moe_norm_topk_prob": "moe_norm_topk_prob",
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _models() -> Any:
    try:
        import msrl_core.models as models
    except ImportError as e:
        raise ConfigError(f"model.path needs msrl_core.models, which this build lacks ({e})") from None
    return models


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (single file, or the shards its index names); a
    missing file is a :class:`ConfigError` naming it."""
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ConfigError(f"model.path={str(path)!r}: {INDEX} is not a safetensors index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                f"model.path={str(path)!r} is a partial checkpoint: {INDEX} names {missing}, "
                "which do not exist"
            )
        return files
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise ConfigError(
        f"model.path={str(path)!r} holds no weights: neither {SINGLE} nor {INDEX} "
        f"(files there: {sorted(p.name for p in path.iterdir())[:12]})"
    )


def read_model_config(path: str, **kw: Any) -> Any:
    """``msrl_core.models.ModelConfig`` of the checkpoint at ``path`` (config.json); errors name the path."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model.path={path!r} is not a directory (a Hugging Face checkpoint directory)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path={path!r} has no config.json: not a Hugging Face checkpoint directory")
    models = _models()
    try:
        return models.ModelConfig.from_pretrained(str(p), **kw)
    except ValueError as e:  # CheckpointError: unknown architecture, unsupported feature
        raise ConfigError(f"model.path={path!r}: {e}") from None


def fill_model_section(model: Any, explicit: dict[str, str]) -> None:
    """Set every key of :data:`SECTION_FIELDS` of the section ``model`` from its checkpoint's config.json;
    ``explicit`` (key -> where it was set) are the keys the user wrote: each must agree with config.json."""
    mc = read_model_config(
        model.path, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by, dtype=model.dtype
    )
    problems = []
    for key, field in SECTION_FIELDS.items():
        value = getattr(mc, field)
        if key in ("moe_router_topk", "moe_norm_topk_prob") and not mc.num_experts:
            continue  # a dense model: the section's defaults stand
        if key in explicit and key != "path" and getattr(model, key) != value:
            problems.append(
                f"model.{key}={getattr(model, key)!r} ({explicit[key]}) contradicts {value!r} in "
                f"{Path(model.path) / 'config.json'}; remove the setting or make it equal"
            )
        setattr(model, key, value)
    if problems:
        raise ConfigError("\n  ".join(problems))
    weight_files(Path(model.path))


def load_megatron_shard(model: Any, parallel: Any) -> dict[str, Any]:
    """The single-rank Megatron-layout tensors of the checkpoint at ``model.path`` (the HF engine's)."""
    import torch

    from msrl_core.reshard import to_hf
    from msrl_core.trainer.config import model_config

    models = _models()
    mc = model_config(model)
    shapes = to_hf(mc, parallel).train_shapes(0)
    shards = {k: torch.zeros(v, dtype=getattr(torch, mc.dtype)) for k, v in shapes.items()}
    try:
        models.load_hf_checkpoint(shards, model.path, models.ShardLayout(train=parallel), config=mc)
    except ValueError as e:  # CheckpointError: a missing or mis-shaped tensor
        raise ConfigError(f"model.path={model.path!r}: {e}") from None
    return shards
