"""Trainer-side producers for vLLM's weight-transfer API.

- :class:`BucketSource`: a vLLM ``WeightSource`` over streamed named buckets (HF names, full shapes; the
  gather runs inside the iteration, bucket by bucket), so any vLLM backend (its NCCL and IPC ones on GPUs,
  ours everywhere) carries the switch.
- :class:`SwapSource`: vLLM's fused per-rank layout for every inference rank, written by
  :func:`~msrl_core.reshard.allgather_swap` straight into the transport's buffer of each rank (no copy in
  between), optionally swapping the training weights out.
- :class:`StreamSource`: the same layout streamed: chunk ``i`` holds stream bucket ``i`` of every inference
  rank, so the transport buffer is one bucket per rank.
- :class:`TensorsSource`: per-rank tensors a trainer already holds (``{rank: {name: tensor}}``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..errors import ReshardError
from ..plan import ReshardPlan
from .engines import _align

__all__ = ["BucketSource", "StreamSource", "SwapSource", "TensorsSource"]

Buckets = Iterable[Sequence[tuple[str, Any]]]


class BucketSource(WeightSource):
    """vLLM ``WeightSource`` whose iteration streams buckets of ``(HF name, full tensor)``.

    ``buckets``: called once per round, returns the round's buckets (each a list of ``(name, tensor)``; the
    tensors may be views into a reused scratch, valid until the next bucket). ``metadata``: every tensor's
    name, dtype and full shape in iteration order, known without a transfer (from the plan).

    Validity: by default a yielded tensor is valid until the next one is requested, which is what consumers
    that send or copy each tensor as it comes need (our backend; vLLM's NCCL backend; its IPC backend with
    ``packed=True``). ``stable=True`` clones each tensor, for consumers that keep every tensor until the end
    of the round (vLLM's IPC backend with ``packed=False``: the whole model in memory). ``iter_groups()``
    (vLLM's per-layer batches, e.g. sharded RDT) clones the tensors of each group: one layer at a time.
    """

    def __init__(
        self, buckets: Callable[[], Buckets], metadata: Sequence[ParamMeta], *, stable: bool = False
    ) -> None:
        self._buckets = buckets
        self._meta = list(metadata)
        self.stable = stable
        self._grouping = False
        self.last: Any = None  # the last round's bucket iterator (its telemetry, for a BucketStream)

    @classmethod
    def from_stream(
        cls,
        train_params: Any,
        plan: ReshardPlan,
        groups: Mapping[str, Any],
        *,
        stable: bool = False,
        **stream_kw: Any,
    ) -> BucketSource:
        """Each round runs ``stream_buckets(train_params, plan, groups, names="hf", **stream_kw)``: one gather
        scratch and one output bucket, reused (the whole model is never materialised)."""
        from ..stream import stream_buckets

        meta = hf_metadata(plan, stream_kw.get("bucket_bytes", 64 << 20))
        return cls(
            lambda: stream_buckets(train_params, plan, groups, names="hf", **stream_kw), meta, stable=stable
        )

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        want = iter(self._meta)
        self.last = self._buckets()
        for bucket in self.last:
            for name, t in bucket:
                m = next(want, None)
                if m is None or m.name != name or tuple(t.shape) != m.shape or t.dtype != m.dtype:
                    raise ReshardError(
                        f"bucket stream yielded {name!r} {tuple(t.shape)} {t.dtype}, metadata expects "
                        + (f"{m.name!r} {m.shape} {m.dtype}" if m else "nothing more")
                    )
                yield name, (t.clone() if self.stable or self._grouping else t)
        rest = next(want, None)
        if rest is not None:
            raise ReshardError(f"bucket stream ended before {rest.name!r}")

    def iter_groups(self) -> Iterator[tuple[list[str], list[Any]]]:
        self._grouping = True  # a group outlives the stream bucket its first tensors came in
        try:
            yield from super().iter_groups()
        finally:
            self._grouping = False


def hf_metadata(plan: ReshardPlan, bucket_bytes: int) -> list[ParamMeta]:
    """HF names, dtype and full shapes in the order ``stream_buckets(..., names="hf", bucket_bytes=...)``
    yields them (a tensor comes when its last gather bucket is done)."""
    schedule, _ = plan.hf_plan().stream_schedule(bucket_bytes, 0)
    dt = getattr(torch, plan.cfg.dtype)
    return [ParamMeta(n, dt, tuple(shape)) for sb in schedule for n, _, shape in sb.tensors]


class SwapSource:
    """Per-rank source: :func:`allgather_swap` of this trainer rank's shard into the buffer of each inference
    rank it owns (inference rank ``r`` is owned by trainer rank ``r % world``). Every trainer rank makes the
    same number of calls (a rank that owns fewer ranks gathers into a private buffer), since each call runs
    the training groups' collectives. ``swap=True`` swaps the training weights out in the last call;
    :attr:`swap` is then that call's :class:`~msrl_core.reshard.Swap` (``swap_back()`` before training)."""

    def __init__(
        self,
        train_params: Any,
        plan: ReshardPlan,
        groups: Mapping[str, Any],
        *,
        rank: int = 0,
        world: int = 1,
        swap: bool = True,
        **swap_kw: Any,
    ) -> None:
        if plan.layout != "vllm":
            raise ReshardError(f"SwapSource needs a megatron_to_vllm plan, got {plan!r}")
        if not 0 <= rank < world:
            raise ReshardError(f"trainer rank {rank} outside [0, {world})")
        self.plan, self.groups, self.params = plan, groups, train_params
        self.rank, self.world, self.do_swap, self.kw = rank, world, swap, swap_kw
        self.dtype = plan.cfg.dtype
        self.swap: Any = None

    def layouts(self) -> dict[int, tuple[dict[str, tuple[int, tuple[int, ...]]], int]]:
        return {r: self.plan.infer_layout(r) for r in range(self.plan.infer.tp)}

    def owned(self) -> list[int]:
        return [r for r in range(self.plan.infer.tp) if r % self.world == self.rank]

    def fill(self, buffers: Mapping[int, Any]) -> None:
        from ..swap import allgather_swap

        jobs: list[tuple[int, Any]] = [
            (r, buffers[r] if write else torch.empty(self.plan.infer_layout(r)[1], dtype=torch.uint8))
            for r, write in _owned_jobs(self.plan.infer.tp, self.rank, self.world)
        ]
        for i, (r, buf) in enumerate(jobs):
            last = i == len(jobs) - 1
            s = allgather_swap(
                self.params, buf, self.plan, self.groups, infer_rank=r, swap=self.do_swap and last, **self.kw
            )
            if last:
                self.swap = s


def _owned_jobs(tp_i: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """``(inference rank, write?)`` per call on trainer rank ``rank``: it owns ``r % world == rank``; every
    trainer rank makes ``ceil(tp_i / world)`` calls (their gathers are collectives), padding with calls
    whose output it does not write."""
    mine = [(r, True) for r in range(tp_i) if r % world == rank]
    while len(mine) < -(-tp_i // world):
        mine.append((rank % tp_i, False))
    return mine


class StreamSource:
    """Per-rank source, streamed: ``stream_buckets(names="vllm")`` for each inference rank this trainer rank
    owns (``r % world == rank``); chunk ``i`` is stream bucket ``i`` of every inference rank, so the
    transport holds one bucket per rank and every trainer rank synchronises between buckets. That is safe
    only when every inference rank's stream yields after the same gather buckets (checked here: true for
    the usual dense and MoE layouts); otherwise use :class:`SwapSource`."""

    def __init__(
        self,
        train_params: Any,
        plan: ReshardPlan,
        groups: Mapping[str, Any],
        *,
        rank: int = 0,
        world: int = 1,
        bucket_bytes: int = 64 << 20,
        **stream_kw: Any,
    ) -> None:
        if plan.layout != "vllm":
            raise ReshardError(f"StreamSource needs a megatron_to_vllm plan, got {plan!r}")
        if not 0 <= rank < world:
            raise ReshardError(f"trainer rank {rank} outside [0, {world})")
        self.plan, self.groups, self.params = plan, groups, train_params
        self.rank, self.world, self.bucket_bytes, self.kw = rank, world, bucket_bytes, stream_kw
        self.dtype = plan.cfg.dtype
        self._sched = {r: plan.stream_schedule(bucket_bytes, r)[0] for r in range(plan.infer.tp)}
        steps = {tuple(tuple(sb.gather) for sb in s) for s in self._sched.values()}
        if len(steps) != 1:
            raise ReshardError(
                "the inference ranks' streams gather in different steps for this plan and bucket_bytes; "
                "use SwapSource (whole ranks) or another bucket_bytes"
            )

    def chunks(self) -> list[dict[int, tuple[dict[str, tuple[int, tuple[int, ...]]], int]]]:
        n = len(next(iter(self._sched.values())))
        return [
            {
                r: ({name: (off, shape) for name, off, shape in s[i].tensors}, s[i].nbytes)
                for r, s in self._sched.items()
            }
            for i in range(n)
        ]

    def fill_chunks(self, buffers: Mapping[int, Any]) -> Iterator[None]:
        """Fill chunk ``i`` of the ranks this trainer rank owns into ``buffers``, then yield; repeat."""
        from ..broadcast import _bucket_bytes
        from ..stream import stream_buckets

        jobs = [
            (
                r,
                write,
                iter(
                    stream_buckets(
                        self.params,
                        self.plan,
                        self.groups,
                        names="vllm",
                        infer_rank=r,
                        bucket_bytes=self.bucket_bytes,
                        **self.kw,
                    )
                ),
            )
            for r, write in _owned_jobs(self.plan.infer.tp, self.rank, self.world)
        ]
        for i in range(len(next(iter(self._sched.values())))):
            for r, write, it in jobs:
                bucket = next(it)
                if write:
                    nb = self._sched[r][i].nbytes
                    buffers[r][:nb].copy_(_bucket_bytes(bucket, nb))
            yield


class TensorsSource:
    """Per-rank source over tensors already at hand: ``{inference rank: {vLLM name: tensor}}``."""

    def __init__(self, tensors: Mapping[int, Mapping[str, Any]]) -> None:
        if not tensors:
            raise ReshardError("TensorsSource needs at least one inference rank")
        self.tensors = {int(r): dict(d) for r, d in tensors.items()}
        self.dtype = "float32"

    def dtype_of(self, rank: int, name: str) -> str:
        return str(self.tensors[rank][name].dtype).replace("torch.", "")

    def layouts(self) -> dict[int, tuple[dict[str, tuple[int, tuple[int, ...]]], int]]:
        out = {}
        for r, d in self.tensors.items():
            off, lay = 0, {}
            for n, t in d.items():
                lay[n] = (off, tuple(t.shape))
                off = _align(off + t.numel() * t.element_size())
            out[r] = (lay, off)
        return out

    def fill(self, buffers: Mapping[int, Any]) -> None:
        lays = self.layouts()
        for r, d in self.tensors.items():
            for n, t in d.items():
                off, shape = lays[r][0][n]
                buffers[r][off : off + t.numel() * t.element_size()].view(t.dtype).view(shape).copy_(t)
