"""verl tier helpers: a megatron-core GPTModel (python_tests/megatron_harness.py, CPU over gloo) under the
parameter names of megatron-core's Transformer-Engine layer spec, and a verl ``MegatronEngine`` around it.

Why a renaming view: verl builds its Megatron models with the TE layer spec (fused ``linear_qkv`` /
``linear_fc1`` layer norms, ``TEGroupedMLP`` experts ``linear_fc1.weight{j}``), and mbridge's name table
(verl's bridge here, below) knows only those names. TE has no CPU build, so the model is built with the
local spec and shown to mbridge under the TE names: the same parameter objects, the same values;
``named_parameters`` and ``state_dict`` renamed, nothing else. msrl_core's plan accepts both spellings.

Why mbridge (verl's ``vanilla_mbridge=True``) rather than Megatron-Bridge (verl's default): Megatron-Bridge
on PyPI needs Python >= 3.12 from 0.4 on (0.3.x predates the ``export_hf_weights`` verl 0.9.1 calls), and
this machine has Python 3.11. Both feed the same ``get_per_tensor_param`` contract.

The chunk is wrapped in megatron-core's ``DistributedDataParallel`` as in verl's actor engine (contiguous
parameter and gradient buffers: what verl's offload and ours move); it builds on a CPU under msrl_core's
megatron-core CPU layer.
"""

from __future__ import annotations

import os
import re
import sys
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PY_TESTS = os.path.join(os.path.dirname(HERE), "python_tests")
sys.path[:0] = [p for p in (HERE, PY_TESTS) if p not in sys.path]

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def te_name(name: str, dense_fc1: set[str]) -> str:
    """The TE-spec name of a local-spec parameter name (``dense_fc1``: layer prefixes with a dense MLP)."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}.weight{m.group(2)}"
    if name.endswith(".input_layernorm.weight"):
        return name[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
    if name.endswith(".pre_mlp_layernorm.weight"):
        head = name[: -len("pre_mlp_layernorm.weight")]
        if head in dense_fc1:  # TE fuses it into linear_fc1 only for a dense MLP; MoE keeps pre_mlp_layernorm
            return head + "mlp.linear_fc1.layer_norm_weight"
    return name


def te_view(model: Any) -> Any:
    """``model`` shown under TE-spec names (a module whose parameters are the model's own objects)."""
    import torch

    names = [n for n, _ in model.named_parameters()]
    dense = {n[: -len("mlp.linear_fc1.weight")] for n in names if n.endswith(".mlp.linear_fc1.weight")}
    dense = {d for d in dense if ".experts." not in d and ".shared_experts." not in d}

    class TESpecNames(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "inner", model)
            object.__setattr__(self, "decoder", model.decoder)
            object.__setattr__(self, "vocab_size", model.vocab_size)
            object.__setattr__(self, "config", model.config)

        def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
            for n, p in model.named_parameters(prefix, recurse, remove_duplicate):
                yield te_name(n, dense), p

        def parameters(self, recurse: bool = True):
            return model.parameters(recurse)

        def state_dict(self, *a: Any, **k: Any):
            return OrderedDict((te_name(n, dense), v) for n, v in model.state_dict(*a, **k).items())

    return TESpecNames()


def ddp_chunk(module: Any, config: Any) -> Any:
    """``module`` wrapped as verl's actor engine wraps its chunks (``make_megatron_module``, wrap_with_ddp):
    megatron-core DDP with the distributed optimizer's contiguous parameter and gradient buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    return DistributedDataParallel(config, ddp_config, module)


def verl_engine(model: Any, hf_config: Any, ddp: bool = True) -> Any:
    """verl's ``MegatronEngineWithLMHead`` around one chunk, as its own CPU tests build engines
    (``object.__new__`` with the attributes ``get_per_tensor_param`` and ``to`` read): the chunk wrapped in
    DDP as in verl's actor (``ddp=False``: the bare chunk of its forward-only reference engine), the vanilla
    mbridge bridge built from the HF config, no LoRA, no QAT."""
    import torch
    from verl.models.mcore.mbridge import AutoBridge
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    eng = object.__new__(MegatronEngineWithLMHead)
    chunk = te_view(model)
    eng.module = [ddp_chunk(chunk, model.config) if ddp else chunk]
    eng.bridge = AutoBridge.from_config(hf_config, dtype=torch.float32)
    eng.vanilla_bridge = True
    eng.peft_cls = None
    eng._qat_enabled = False
    eng._hf_export_tasks = None
    eng.model_config = SimpleNamespace(hf_config=hf_config, lora={})
    eng.optimizer = None
    eng._is_offload_param = eng._is_offload_optimizer = eng._is_offload_grad = False
    return eng


def collect(gen: Any) -> tuple[dict, list[str]]:
    """``{name: clone}`` of a ``(name, tensor)`` iterator, and the names yielded more than once."""
    out: dict = {}
    twice: list[str] = []
    for n, t in gen:
        if n in out:
            twice.append(n)
        out[n] = t.detach().clone()
    return out, twice
