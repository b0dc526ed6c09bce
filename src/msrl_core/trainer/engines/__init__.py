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

Devices (``trainer.device``): :func:`select_device` resolves it, :func:`torch_device` gives a rank its
``torch.device``, :func:`process_group_backend` the backend of its process groups. The engines' ``device``
attribute is the ``torch.device`` their tensors live on. The CUDA and NPU paths are written but have not
run (no accelerator on the machines this was built on).
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainEngine(Protocol):
    """What the stages need from a training engine."""

    model_config: Any  # msrl_core.reshard.ModelConfig
    parallel: Any  # msrl_core.reshard.Parallel
    device: Any  # torch.device of this rank's weights and of the logits
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

    def load_followers(self, path: Any) -> None:
        """Other ranks load their part of the checkpoint at ``path`` (after :meth:`init_optimizer`)."""

    def close(self) -> None:
        """Stop other ranks, if any."""


#: ``trainer.device`` values; ``auto`` resolves to the first available of :data:`AUTO_ORDER`.
DEVICES = ("auto", "cpu", "cuda", "npu")
AUTO_ORDER = ("cuda", "npu", "cpu")
#: torch.distributed backend of the engines' process groups per device.
PG_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def npu_available() -> bool:
    """An Ascend NPU is visible (torch_npu imported only when it is installed)."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  # registers torch.npu

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def available_devices() -> list[str]:
    """The devices this machine can run the engines on, in :data:`AUTO_ORDER` (``cpu`` always)."""
    import torch

    found = {"cuda": torch.cuda.is_available(), "npu": npu_available(), "cpu": True}
    return [d for d in AUTO_ORDER if found[d]]


def select_device(requested: str = "auto", available: list[str] | None = None) -> str:
    """``trainer.device`` resolved against ``available`` (default: :func:`available_devices`): ``auto`` is
    cuda, then npu, then cpu; an explicit device that is not available is a ValueError naming it and what
    is available."""
    if requested not in DEVICES:
        raise ValueError(f"trainer.device must be one of {list(DEVICES)}; got {requested!r}")
    avail = available_devices() if available is None else list(available)
    if requested == "auto":
        return next(d for d in AUTO_ORDER if d in avail)
    if requested not in avail:
        raise ValueError(
            f"trainer.device={requested!r} is not available on this machine (available: {avail}); "
            "use trainer.device=auto or one of those"
        )
    return requested


def process_group_backend(device: str) -> str:
    """``gloo`` on the CPU, ``nccl`` on CUDA, ``hccl`` on an NPU."""
    try:
        return PG_BACKENDS[device]
    except KeyError:
        raise ValueError(
            f"no process-group backend for device {device!r}; known: {sorted(PG_BACKENDS)}"
        ) from None


def torch_device(device: str, index: int = 0) -> Any:
    """The ``torch.device`` a rank of ``device`` uses (accelerator ``index``, made current), or the CPU."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    dev = torch.device(device, index)
    getattr(torch, device).set_device(dev)  # torch.cuda / torch.npu (registered by torch_npu)
    return dev
