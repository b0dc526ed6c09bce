"""Megatron-core on a CPU: the compatibility layer that lets megatron-core 0.16 run over gloo without an
accelerator.

megatron-core hard-codes a few ``torch.cuda`` calls: ``current_device()`` to place RoPE frequencies and
router tensors, the CUDA RNG tracker, ``Tensor.cuda()`` when tying embeddings, NVTX ranges, a CUDA causal
mask, and it leaves some Transformer-Engine fused MoE kernels undefined. ``activate()`` redirects them to the
CPU. It changes process-wide state (``torch.cuda`` functions), so it is meant for a process that trains on
the CPU: it is a no-op when a CUDA or Ascend NPU device is present (unless forced: the trainer forces it
with ``trainer.device=cpu``), and it is idempotent.

The trainer's Megatron engine calls it before building a ``GPTModel`` when the device is the CPU; the
reshard tests call it in their worker processes.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

_ACTIVE = False


class _CpuStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def accelerator_present() -> bool:
    """True when a CUDA GPU or an Ascend NPU (torch_npu imported only if installed) is visible."""
    import importlib.util

    import torch

    if torch.cuda.is_available():
        return True
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        npu: Any = getattr(torch, "npu", None)
        return bool(npu is not None and npu.is_available())
    return False


def is_active() -> bool:
    return _ACTIVE


def activate(force: bool = False) -> bool:
    """Patch torch.cuda and megatron-core for the CPU. Returns True when the patch is (now) active, False
    when an accelerator is present (nothing changed). ``force=True`` patches even then: for a process that
    was told to train on the CPU (``trainer.device=cpu``) on a machine that has a GPU."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if accelerator_present() and not force:
        return False
    import torch

    c: Any = torch.cuda
    c.current_device = lambda: "cpu"
    c.is_available = lambda: False
    c.current_stream = lambda *a, **k: _CpuStream()
    c.synchronize = lambda *a, **k: None
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    c.manual_seed = lambda seed: torch.manual_seed(seed)
    c.device_count = lambda: 0
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # tied embeddings: .cuda()
    c.nvtx = type(
        "nvtx",
        (),
        {
            "range_push": staticmethod(lambda *a: None),
            "range_pop": staticmethod(lambda: None),
            "range": staticmethod(lambda *a, **k: contextlib.nullcontext()),
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions import fused_softmax
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer import utils as tutils
        from megatron.core.transformer.moe import moe_utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tutils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    for name in (
        "te_general_gemm",
        "fused_topk_with_score_function",
        "fused_permute",
        "fused_unpermute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
    ):
        if not hasattr(moe_utils, name):  # megatron-core 0.16.1 leaves these undefined without TE
            setattr(moe_utils, name, None)
    _ACTIVE = True
    return True
