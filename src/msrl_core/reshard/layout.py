"""Layout specs: where every element of every weight lives on the Megatron side and the inference side.

Everything here is pure metadata (names, shapes, row maps). Tensors are described as 2-D ``[rows, cols]``
matrices (1-D tensors are ``[n, 1]``); a layout transform is a list of *pieces*: a run of rows (and a
column range) of one Hugging Face tensor written at a row offset of a target tensor. The plan builder
(``plan.py``) turns pieces into strided copy descriptors against the gathered training buffer.

Megatron side (megatron-core ``GPTModel``, local or TE layer spec names, SequentialMLP experts):

- column-parallel weights are split evenly on dim 0 of the *Megatron* row order, row-parallel on dim 1;
- ``linear_qkv`` rows are interleaved per query group ``[q_1 .. q_{np/ng}, k, v]`` (a rank may hold a
  partial group when ``tp > num_query_groups``);
- ``linear_fc1`` (stride 2) holds ``[gate_r; up_r]`` on rank r;
- word embeddings / output layer are vocab-parallel over the padded vocab
  ``ceil(V / (divisible_by * tp)) * divisible_by * tp``; rows ``>= V`` are dropped;
- experts are contiguous per EP rank (``local_experts.{j}`` is global expert ``ep_rank * E_local + j``);
- layer indices are stage-local (``decoder.layers.{i - stage_offset}``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

__all__ = ["ModelConfig", "Parallel", "Source", "HFTensor", "Piece", "Target", "megatron_padded_vocab"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
VLLM_VOCAB_PADDING = 64  # vllm DEFAULT_VOCAB_PADDING_SIZE


def _err(msg: str) -> ValueError:
    from .errors import ReshardError

    return ReshardError(msg)


@dataclass(frozen=True)
class Parallel:
    """Parallel sizes of one side. ``etp`` (expert tensor parallel) defaults to ``tp`` when ``ep == 1``
    and to 1 when ``ep > 1`` (Megatron's usual MoE setting on small groups)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "ep"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise _err(f"Parallel.{k} must be a positive int, got {v!r}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp if self.ep == 1 else 1)

    @property
    def expert_tp(self) -> int:
        assert self.etp is not None
        return self.etp


@dataclass(frozen=True)
class ModelConfig:
    """The one description of a decoder-only model (Llama / Qwen2 / Qwen3 dense, Qwen3-MoE, Qwen2-MoE): what
    the reshard plan, the Megatron builder (:func:`msrl_core.models.build_gpt`), the checkpoint loader and the
    trainer's engines read. Build it from a Hugging Face ``config.json`` with :meth:`from_pretrained`.

    ``rope_theta`` (a float, as in ``config.json``), ``norm_epsilon`` (``rms_norm_eps``) and
    ``max_position_embeddings`` describe the forward; ``moe_router_topk`` (``num_experts_per_tok``, default 2
    for an MoE) and ``moe_norm_topk_prob`` (``norm_topk_prob``: renormalise the top-k probabilities; default
    True for Qwen3-MoE, False for Qwen2-MoE) the router; ``dtype`` the training parameters."""

    arch: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    make_vocab_size_divisible_by: int = 128
    dtype: str = "float32"
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6
    max_position_embeddings: int = 2048
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool | None = None

    ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")

    def __post_init__(self) -> None:
        if self.arch not in self.ARCHS:
            raise _err(f"unknown arch {self.arch!r}; supported: {', '.join(self.ARCHS)}")
        if self.dtype not in _DTYPE_BYTES:
            raise _err(f"unsupported dtype {self.dtype!r}; supported: {sorted(_DTYPE_BYTES)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise _err(
                    f"hidden_size {self.hidden_size} not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; pass head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise _err(
                f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.is_moe and (self.num_experts < 1 or self.moe_intermediate_size < 1):
            raise _err(f"{self.arch} needs num_experts and moe_intermediate_size")
        for k in ("rope_theta", "norm_epsilon"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise _err(f"{k} must be a positive number, got {v!r}")
            object.__setattr__(self, k, float(v))
        if not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings < 1:
            raise _err(
                f"max_position_embeddings must be a positive int, got {self.max_position_embeddings!r}"
            )
        if self.is_moe:
            if self.moe_router_topk == 0:
                object.__setattr__(self, "moe_router_topk", min(2, self.num_experts))
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise _err(
                    f"moe_router_topk must be in [1, num_experts={self.num_experts}], "
                    f"got {self.moe_router_topk}"
                )
            if self.moe_norm_topk_prob is None:
                object.__setattr__(self, "moe_norm_topk_prob", self.arch == "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen3_moe", "qwen2_moe")

    @property
    def hd(self) -> int:
        assert self.head_dim is not None
        return self.head_dim

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @classmethod
    def from_hf(
        cls,
        hf_config: Any,
        make_vocab_size_divisible_by: int = 128,
        dtype: str | None = None,
        source: str = "",
    ) -> ModelConfig:
        """Build from a Hugging Face config: a transformers ``PretrainedConfig`` or the dict of a
        ``config.json`` (``source``: the file, named in errors). Architectures: Llama, Qwen2, Qwen3,
        Qwen3-MoE, Qwen2-MoE. ``dtype``: the training dtype (default: the config's ``dtype``).

        A feature the Megatron layout cannot express (RoPE scaling, a sliding window, an activation other than
        SiLU, an output-projection or MLP bias, dense layers inside an MoE) is a
        :class:`~msrl_core.reshard.errors.CheckpointError` naming the key and its value."""
        from .errors import CheckpointError

        d = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
        where = f" in {source}" if source else ""
        mt = d.get("model_type")
        if mt not in cls.ARCHS:
            arch = d.get("architectures")
            raise CheckpointError(
                f"unsupported architecture: model_type {mt!r} (architectures {arch!r}){where}; supported "
                f"model_type: {', '.join(cls.ARCHS)}"
            )

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise CheckpointError(f"{mt} config{where} has no {key!r}")
            return d[key]

        def refuse(key: str, ok: Callable[[Any], bool], why: str) -> None:
            if key in d and d[key] is not None and not ok(d[key]):
                raise CheckpointError(f"{mt} config{where}: {key}={d[key]!r} is not supported ({why})")

        refuse("hidden_act", lambda v: v == "silu", "the Megatron layout is SwiGLU: hidden_act 'silu'")
        refuse("use_sliding_window", lambda v: not v, "no sliding-window attention")
        refuse("mlp_bias", lambda v: not v, "no MLP bias")
        if mt in ("llama", "qwen3", "qwen3_moe"):
            refuse("attention_bias", lambda v: not v, "Megatron has a QKV bias but no output-projection bias")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        refuse(
            "rope_parameters" if "rope_parameters" in d else "rope_scaling",
            lambda v: (v or {}).get("rope_type", (v or {}).get("type", "default")) == "default",
            "only the default RoPE (no scaling)",
        )
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        moe: dict[str, Any] = {}
        if mt in ("qwen3_moe", "qwen2_moe"):
            refuse("decoder_sparse_step", lambda v: v == 1, "every layer must be an MoE layer")
            refuse("mlp_only_layers", lambda v: not v, "every layer must be an MoE layer")
            ne = d.get("num_experts", d.get("num_local_experts"))
            if ne is None:
                raise CheckpointError(f"{mt} config{where} has no 'num_experts'")
            moe = dict(
                num_experts=int(ne),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                moe_router_topk=int(need("num_experts_per_tok")),
                moe_norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
            )
        if dtype is None:
            dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32").replace("torch.", "")
            dtype = dtype if dtype in _DTYPE_BYTES else "float32"
        nh = int(need("num_attention_heads"))
        try:
            return cls(
                arch=mt,
                hidden_size=int(need("hidden_size")),
                num_layers=int(need("num_hidden_layers")),
                num_attention_heads=nh,
                num_key_value_heads=int(d.get("num_key_value_heads") or nh),
                intermediate_size=int(need("intermediate_size")),
                vocab_size=int(need("vocab_size")),
                head_dim=d.get("head_dim"),
                qkv_bias=mt == "qwen2" or (mt == "qwen2_moe" and bool(d.get("qkv_bias", True))),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qk_norm=mt in ("qwen3", "qwen3_moe"),
                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                dtype=dtype,
                rope_theta=float(theta),
                norm_epsilon=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
                **moe,
            )
        except CheckpointError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{mt} config{where}: {e}") from e

    @classmethod
    def from_pretrained(
        cls, path: str, make_vocab_size_divisible_by: int = 128, dtype: str | None = None
    ) -> ModelConfig:
        """Build from ``path/config.json`` of a Hugging Face checkpoint directory (see :meth:`from_hf`)."""
        import json
        import os

        from .errors import CheckpointError

        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise CheckpointError(f"no Hugging Face config: {f} does not exist")
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {f}: {e}") from e
        if not isinstance(d, dict):
            raise CheckpointError(f"{f} does not hold a JSON object")
        return cls.from_hf(d, make_vocab_size_divisible_by, dtype, source=f)


def megatron_padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to a multiple of ``divisible_by * tp``."""
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


RowMap = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray]"]


@dataclass
class Source:
    """Where the rows/cols of one HF tensor live on the training side.

    ``mode``: ``rows`` — ``row_map(hf_rows) -> (member, local_row)``, every column local;
    ``cols`` — rows identical, columns split evenly over ``members`` group members;
    ``whole`` — the full tensor on member ``member`` (replicated params: member 0; EP experts: owner).
    ``group`` is the gather group: ``tp`` (training TP group) or ``ep`` (expert-parallel group).
    """

    param: str  # stage-local Megatron parameter name
    stage: int
    group: str
    local_shape: tuple[int, int]
    mode: str
    members: int = 1
    row_map: RowMap | None = None
    member: int = 0


@dataclass
class HFTensor:
    name: str
    shape: tuple[int, ...]  # real HF shape
    src: Source

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1


@dataclass
class Piece:
    """Write HF tensor ``hf`` rows ``[row0, row0 + nrows)`` x cols ``[col0, col0 + ncols)`` into the
    target at row ``dst_row`` / col ``dst_col``."""

    hf: str
    row0: int
    nrows: int
    col0: int
    ncols: int
    dst_row: int
    dst_col: int = 0


@dataclass
class Target:
    """One inference-side tensor of one inference rank."""

    name: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[-1] if len(self.shape) > 1 else 1

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


def replace(obj, **kw):
    return dataclasses.replace(obj, **kw)
