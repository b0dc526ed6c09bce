"""Test-only shim: run megatron-core 0.16.1 on a CPU over gloo.

megatron-core hard-codes a few ``torch.cuda`` calls (``current_device()`` to place RoPE frequencies and
router tensors, the CUDA RNG tracker). ``patch()`` redirects them to the CPU inside test worker processes.
It is never imported by the library.
"""

from __future__ import annotations

import contextlib
import warnings

import torch


class _CpuStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def patch() -> None:
    warnings.filterwarnings("ignore")
    c = torch.cuda
    c.current_device = lambda: "cpu"
    c.is_available = lambda: False
    c.current_stream = lambda *a, **k: _CpuStream()
    c.synchronize = lambda *a, **k: None
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    c.manual_seed = lambda seed: torch.manual_seed(seed)
    c.device_count = lambda: 0
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied-embedding setup moves weights with .cuda()
    c.nvtx = type(
        "nvtx",
        (),
        {
            "range_push": staticmethod(lambda *a: None),
            "range_pop": staticmethod(lambda: None),
            "range": staticmethod(lambda *a, **k: contextlib.nullcontext()),
        },
    )
    import functools

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tutils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    from megatron.core.transformer.moe import moe_utils

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
