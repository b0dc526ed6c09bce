"""Megatron-core training engines on msrl_core, trainer-neutral (verl's adapter, ``integrations/verl.py``,
is built on it; slime-style trainers can call it directly):

- :class:`HFWeightExport`: the model chunks of one rank as an iterator of ``(hf_name, tensor)`` in the
  Hugging Face checkpoint layout, produced by :func:`~msrl_core.reshard.stream_buckets` (one bucketed
  gather and one fused copy per bucket) instead of one gather per parameter;
- :class:`MirrorOffload`: the weights (and optionally the optimizer state and fp32 master weights, through
  :class:`~msrl_core.reshard.TrainingStateOffload`) moved to persistent pinned host mirrors and back, in
  one batched copy each way, instead of pageable per-buffer copies.

Both read Megatron's ``parallel_state`` for the groups and work on what a Megatron engine holds: a list of
model chunks, each possibly wrapped (DDP, ``Float16Module``); parameter names lose their ``module.``
prefixes and TE-spec names are accepted (see ``reshard/spec.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from msrl_core.reshard import ModelConfig, Parallel, ReshardError, ReshardPlan, stream_buckets, to_hf
from msrl_core.reshard.guard import ReadGuard
from msrl_core.reshard.mirrors import EngineAndPool, HostMirrors, Storage, unique_storages
from msrl_core.reshard.offload import OffloadedState, TrainingStateOffload
from msrl_core.reshard.steps import DEFAULT_TIMEOUT, Deadline, bytes_view, current_stream

__all__ = [
    "HFWeightExport",
    "MirrorOffload",
    "OffloadStats",
    "chunk_params",
    "megatron_layout",
    "parallel_groups",
    "unwrap",
]


def unwrap(chunk: Any) -> Any:
    """The innermost module of a chunk (DDP → ``Float16Module`` → ``GPTModel``)."""
    import torch

    m = chunk
    while isinstance(getattr(m, "module", None), torch.nn.Module):
        m = m.module
    return m


def chunk_params(chunks: Sequence[Any]) -> dict[str, Any]:
    """``{name: parameter}`` of one rank's only chunk (virtual pipeline stages are not supported)."""
    if len(chunks) != 1:
        raise ReshardError(
            f"got {len(chunks)} model chunks (virtual pipeline parallelism); msrl_core supports exactly one "
            "chunk per rank"
        )
    return dict(unwrap(chunks[0]).named_parameters())


def _parallel_state() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def megatron_layout(chunks: Sequence[Any], hf_config: Any, ps: Any = None) -> tuple[ModelConfig, Parallel]:
    """The :class:`ModelConfig` (from the HF config; the dtype and the padded vocabulary from the Megatron
    model itself) and the training :class:`Parallel` (from ``parallel_state``)."""
    if ps is None:
        ps = _parallel_state()
    params = chunk_params(chunks)
    model = unwrap(chunks[0])
    tp = ps.get_tensor_model_parallel_world_size()
    train = Parallel(
        tp=tp,
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params.values()})
    if len(dtypes) != 1:
        raise ReshardError(f"the model's parameters have several dtypes {dtypes}; msrl_core needs one")
    padded = getattr(model, "vocab_size", None)  # GPTModel keeps the padded vocabulary on every stage
    if not isinstance(padded, int) or padded % tp or padded < hf_config.vocab_size:
        raise ReshardError(
            f"cannot tell the Megatron vocabulary size: model.vocab_size={padded!r}, TP {tp}, "
            f"HF vocab_size {hf_config.vocab_size}"
        )
    cfg = ModelConfig.from_hf(hf_config, make_vocab_size_divisible_by=padded // tp)
    return dataclasses.replace(cfg, dtype=dtypes[0]), train


def parallel_groups(train: Parallel, ps: Any = None) -> dict[str, Any]:
    """The torch.distributed groups ``stream_buckets`` needs (``None`` for a size-1 dimension)."""
    if ps is None:
        ps = _parallel_state()
    return {
        "tp": ps.get_tensor_model_parallel_group() if train.tp > 1 else None,
        "pp": ps.get_pipeline_model_parallel_group() if train.pp > 1 else None,
        "ep": ps.get_expert_model_parallel_group() if train.ep > 1 else None,
    }


class HFWeightExport:
    """HF-named weights of a Megatron engine through ``stream_buckets``. Owns the plan (built once per
    model layout; plans are immutable metadata) and the last stream's telemetry.

    ``bucket_bytes``: gather bytes per member and output bytes per bucket (see ``stream_buckets``).
    ``inplace`` (default): a tensor this rank holds contiguously in one of its own parameters (TP 1 dense
    weights, its own experts, replicated norms) is yielded as a view of that parameter, with no gather, no
    copy and no scratch, as verl's mbridge export does at TP 1; the stream's scratches are sized to what is
    still gathered (``stream_buckets(inplace=True)``). Those views alias the training weights: a consumer
    copies them before the weights change and never writes into them (verl's senders copy every tensor
    into their own buffer). ``copy``: yield a clone of every tensor (for a consumer that keeps tensors
    past the next one without copying them); otherwise the other tensors are views of the stream's reused
    output bucket, valid until the iterator moves past the bucket's last tensor."""

    def __init__(
        self,
        *,
        bucket_bytes: int = 64 << 20,
        copy: bool = False,
        inplace: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        engine: Any = None,
    ) -> None:
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
            raise ReshardError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if not isinstance(inplace, bool):
            raise ReshardError(f"inplace must be True or False, got {inplace!r}")
        self.bucket_bytes, self.copy, self.timeout, self.engine = bucket_bytes, copy, timeout, engine
        self.inplace = inplace
        self._plans: dict[tuple[ModelConfig, Parallel], ReshardPlan] = {}
        self.telemetry: Any = None  # StreamTelemetry of the last stream

    def plan(self, cfg: ModelConfig, train: Parallel) -> ReshardPlan:
        key = (cfg, train)
        if key not in self._plans:
            self._plans[key] = to_hf(cfg, train)
        return self._plans[key]

    def weights(self, chunks: Sequence[Any], hf_config: Any, ps: Any = None) -> Iterator[tuple[str, Any]]:
        """``(hf_name, tensor)`` for every tensor of the HF checkpoint, on every rank of the training groups
        (each rank must consume the iterator to the end: every bucket runs collectives). The checks and the
        ranks' agreement run here, before the iterator is returned."""
        cfg, train = megatron_layout(chunks, hf_config, ps)
        plan = self.plan(cfg, train)
        stream = stream_buckets(
            chunk_params(chunks),  # the unwrapped module's parameters (a wrapper may rename nothing)
            plan,
            parallel_groups(train, ps),
            names="hf",
            bucket_bytes=self.bucket_bytes,
            engine=self.engine,
            timeout=self.timeout,
            inplace=self.inplace,
        )
        self.telemetry = stream.telemetry
        return self._flatten(stream)

    def _flatten(self, stream: Any) -> Iterator[tuple[str, Any]]:
        for bucket in stream:
            for name, t in bucket:
                yield name, (t.clone() if self.copy else t)


@dataclass
class OffloadStats:
    """What the last offload / load of :class:`MirrorOffload` moved, in bytes and seconds."""

    weight_bytes: int = 0
    grad_bytes_freed: int = 0  # gradients are freed without a copy (as verl does) and zeroed on load
    # TrainingStateOffload's freed bytes by kind
    optimizer_bytes: dict[str, int] = field(default_factory=dict)
    host_mirror_bytes: int = 0
    host_new_bytes: int = 0  # pinned bytes the last weight offload allocated (0 once the mirrors exist)
    offload_s: float = 0.0
    load_s: float = 0.0


class MirrorOffload(EngineAndPool):
    """The weights of one engine's model chunks (and its optimizer state) on persistent pinned host
    mirrors while they are not needed on the device.

    ``offload_model`` copies every parameter storage (a DDP parameter buffer is one storage) to its mirror
    in one batch, frees the device storages (the parameter objects survive, guarded against reads) and frees
    the gradient storages without copying them; ``load_model`` copies the weights back in one batch and,
    with ``grad=True``, re-materialises the gradients as zeros. ``offload_optimizer`` / ``load_optimizer``
    move the optimizer state and the fp32 master weights through :class:`TrainingStateOffload`. Every call
    is local to the rank and idempotent (offloading what is offloaded does nothing)."""

    def __init__(self, *, engine: Any = None, pool: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(engine, pool)
        self.timeout = timeout
        self._host = HostMirrors(lambda: self.pool)
        self._weights: list[Storage] = []
        self._guard: ReadGuard | None = None
        self._grads: list[Storage] = []  # freed gradient storages, re-materialised (zeros) on load
        self._state_offload: TrainingStateOffload | None = None
        self._state: OffloadedState | None = None
        self.stats = OffloadStats()

    @property
    def model_offloaded(self) -> bool:
        return self._guard is not None

    @property
    def optimizer_offloaded(self) -> bool:
        return self._state is not None

    def offload_model(self, chunks: Sequence[Any]) -> None:
        params = chunk_params(chunks)
        t0 = time.perf_counter()
        if not self.model_offloaded:
            storages = unique_storages(params)
            if storages:
                deadline = Deadline(self.timeout)
                stream = current_stream(storages[0].device)
                r = self._host.swap_out(storages, self.engine, deadline, stream, "parameter")
                self.stats.host_new_bytes = r.new_bytes
            self._weights = storages
            self._guard = ReadGuard()
            self._guard.install(params)
            self.stats.weight_bytes = sum(s.nbytes for s in storages)
        grads = {}
        for n, p in params.items():
            for kind in ("main_grad", "grad"):
                g = getattr(p, kind, None)
                if g is not None:
                    grads[f"{n}.{kind}"] = g
        freed = unique_storages(grads)  # only storages that still hold bytes
        for s in freed:
            s.storage.resize_(0)
        self._grads += freed
        self.stats.grad_bytes_freed = sum(s.nbytes for s in self._grads)
        self.stats.host_mirror_bytes = self._host.nbytes
        _release_cached(params)
        self.stats.offload_s = time.perf_counter() - t0

    def load_model(self, chunks: Sequence[Any], *, grad: bool = True) -> None:
        chunk_params(chunks)  # the same one-chunk check as offload_model
        t0 = time.perf_counter()
        if self.model_offloaded:
            assert self._guard is not None
            if self._weights:
                deadline = Deadline(self.timeout)
                stream = current_stream(self._weights[0].device)
                try:
                    ticket = self._host.copy_in(self._weights, self.engine, stream)
                    ticket.wait(deadline.left())
                    self.engine.order_stream(ticket, stream, deadline.left())
                except Exception as e:
                    raise ReshardError(f"weight load failed: {type(e).__name__}: {e}") from e
            self._guard.remove()
            self._guard, self._weights = None, []
        if grad and self._grads:
            for s in self._grads:
                s.storage.resize_(s.nbytes)
                bytes_view(s.storage, s.device).zero_()
            self._grads = []
        self.stats.load_s = time.perf_counter() - t0

    def offload_optimizer(self, optimizer: Any, chunks: Sequence[Any]) -> None:
        if optimizer is None or self.optimizer_offloaded:
            return
        if self._state_offload is None:
            self._state_offload = TrainingStateOffload(
                grads=False, optimizer_state=True, master_weights=True, engine=self.engine, pool=self.pool
            )
        params = chunk_params(chunks)
        self._state = self._state_offload.offload(params, _Merged(optimizer), timeout=self.timeout)
        self.stats.optimizer_bytes = dict(self._state.telemetry.freed_bytes)
        _release_cached(params)

    def load_optimizer(self) -> None:
        if self._state is None:
            return
        self._state.swap_back()
        self._state.wait()
        self._state = None


def _release_cached(params: dict[str, Any]) -> None:
    """Give the freed device memory back to the device (torch's caching allocator keeps it otherwise, and the
    colocated inference engine, another process, could not use it), as verl's offload does."""
    import torch

    dev = next(iter(params.values())).device if params else None
    mod = getattr(torch, dev.type, None) if dev is not None and dev.type != "cpu" else None
    if mod is not None and hasattr(mod, "empty_cache"):
        mod.empty_cache()


class _Merged:
    """The torch optimizers inside a Megatron optimizer (a ``ChainedOptimizer`` holds several, each
    wrapping one in ``.optimizer``) seen as one: their param groups and per-parameter state."""

    def __init__(self, optimizer: Any) -> None:
        import torch

        inner: list[Any] = []
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            o = getattr(opt, "optimizer", opt)
            if isinstance(o, torch.optim.Optimizer):
                inner.append(o)
        self.param_groups = [g for o in inner for g in o.param_groups]
        self.state = {p: s for o in inner for p, s in o.state.items()}
