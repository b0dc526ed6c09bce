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
from dataclasses import dataclass, field
from typing import Callable

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
    """Architecture of a decoder-only model (Llama / Qwen2 / Qwen3 dense, Qwen3-MoE, Qwen2-MoE)."""

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
    def from_hf(cls, hf_config, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE)."""
        c = hf_config
        mt = getattr(c, "model_type", "")
        if mt not in cls.ARCHS:
            raise _err(f"unsupported Hugging Face model_type {mt!r}; supported: {', '.join(cls.ARCHS)}")
        dtype = str(getattr(c, "torch_dtype", None) or getattr(c, "dtype", None) or "float32")
        dtype = dtype.replace("torch.", "")
        return cls(
            arch=mt,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            head_dim=getattr(c, "head_dim", None),
            qkv_bias=bool(getattr(c, "qkv_bias", getattr(c, "attention_bias", False))) or mt == "qwen2",
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            num_experts=getattr(c, "num_experts", 0) or 0,
            moe_intermediate_size=getattr(c, "moe_intermediate_size", 0) or 0,
            shared_expert_intermediate_size=getattr(c, "shared_expert_intermediate_size", 0) or 0,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            dtype=dtype if dtype in _DTYPE_BYTES else "float32",
        )


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
