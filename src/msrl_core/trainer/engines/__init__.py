"""Engines behind small adapters.

Training engines (``actor.engine``) hold this rank's weights in the **Megatron layout** — the layout
``msrl_core.allgather_swap`` reads — and give logits for right-padded token batches:

- ``megatron``: a megatron-core ``GPTModel`` (TP/PP over torch.distributed; gloo on a CPU through
  ``megatron_cpu``), the production engine;
- ``hf``: a Hugging Face transformers model (TP 1) whose trainable leaves are the Megatron-layout tensors;
  its HF weights are derived from them on every forward with the reshard reference rules (differentiable
  torch slicing), so the same ``allgather_swap`` plan serves both engines.

Rollout engines (``rollout.engine``): ``hf`` (a built-in sampler over the resharded HF-layout weights, the
CPU default) and ``vllm`` (needs vLLM and the reshard issue's live-engine loader).
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainEngine(Protocol):
    """What the stages need from a training engine."""

    model_config: Any  # msrl_core.reshard.ModelConfig
    parallel: Any  # msrl_core.reshard.Parallel
    groups: dict[str, Any]  # {"tp", "pp", "ep"} process groups for allgather_swap (None for size 1)

    def logits(self, tokens: Any) -> Any:
        """``[B, T]`` right-padded int64 tokens -> ``[B, T, vocab_size]`` float32 logits (autograd on)."""

    def train_params(self) -> Any:
        """This rank's Megatron-layout parameters (module or name -> tensor) for ``allgather_swap``."""

    def parameters(self) -> list[Any]:
        """The trainable leaves (optimizer and grad clipping)."""

    def grad_norm_and_clip(self, max_norm: float) -> float:
        """Global grad norm over the model-parallel group; clips in place when ``max_norm > 0``."""

    def frozen_copy(self) -> TrainEngine:
        """An independent copy of the current weights with autograd off (the reference policy)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def select_device(requested: str = "auto") -> str:
    """``cuda`` when a GPU is visible, ``npu`` when torch_npu is installed and sees an NPU, else ``cpu``."""
    import importlib.util

    import torch

    if requested not in ("auto", "cpu", "cuda", "npu"):
        raise ValueError(f"trainer.device must be auto, cpu, cuda or npu; got {requested!r}")
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return "npu"
    return "cpu"
