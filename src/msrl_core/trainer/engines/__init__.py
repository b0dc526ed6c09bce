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
        """The trainable leaves."""

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        """A fresh AdamW on every rank."""

    def zero_grad(self) -> None: ...

    def clip_and_step(self, max_norm: float) -> float:
        """Global grad norm over the model-parallel group; clips to ``max_norm`` (> 0) and steps the
        optimizer when the norm is finite. Returns the norm before clipping."""

    def switch(self, flat: Any, plan: Any, bucket_bytes: int, swap: bool) -> Any:
        """``allgather_swap`` into the rollout engine's HF-layout buffer; returns the ``Swap``."""

    def switch_back(self) -> None:
        """``swap_back()`` + ``wait()`` of the last switch (no-op when already back)."""

    def frozen_copy(self) -> Any:
        """The reference policy: a copy of the current weights with autograd off (``logits`` only)."""

    def optimizer_state(self) -> dict[str, Any]: ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_followers(self, step: int) -> None:
        """Other ranks write their part of the checkpoint of ``step``."""

    def close(self) -> None:
        """Stop other ranks, if any."""


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

        if torch.npu.is_available():  # type: ignore[attr-defined]  # registered by torch_npu
            return "npu"
    return "cpu"
