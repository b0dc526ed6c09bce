"""Streamed named buckets: the switch as an iterator of ``[(name, tensor), ...]`` buckets in HF names (full
shapes) or vLLM per-rank names (``qkv_proj``, ``gate_up_proj``, ``w13_weight`` ...), so an engine's
``load_weights`` (or SGLang-style ``update_weights_from_tensor``, or a trainer's own sender) consumes the
switch bucket by bucket without the whole model materialised on any rank.

Memory: one gather scratch (the largest gathered bucket, as in :func:`allgather_swap`) and one output scratch
(the largest stream bucket: ``bucket_bytes`` of inference tensors, or one tensor when a single tensor is
larger), both reused for every bucket. The yielded tensors are views into the output scratch: they are valid
until the next bucket is requested; copy what must outlive that.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ReshardError, SwitchAborted
from .plan import ReshardPlan, StreamBucket
from .steps import (
    DEFAULT_TIMEOUT,
    Deadline,
    Gatherer,
    Prepared,
    agree,
    bucket_label,
    current_stream,
    prepare,
    scratch_bytes,
)

__all__ = ["BucketStream", "StreamTelemetry", "stream_buckets"]


@dataclass
class StreamTelemetry:
    """What one stream did. Bytes are on the training device unless named host."""

    layout: str
    infer_rank: int
    buckets: int  # stream buckets yielded (when finished)
    gather_buckets: int
    gather_scratch_bytes: int  # the reused gather scratch
    output_scratch_bytes: int  # the reused output bucket the yielded views live in
    bytes_yielded: int = 0
    bytes_gathered: int = 0  # received from other ranks
    pack_s: float = 0.0
    gather_s: float = 0.0
    copy_s: float = 0.0
    total_s: float = 0.0  # first to last bucket, the consumer's time between buckets included
    finished: bool = False


class BucketStream:
    """Iterator of buckets ``[(name, tensor), ...]`` (see :func:`stream_buckets`). Every rank of the training
    groups must consume it to the end (each bucket runs collectives); ``telemetry`` fills in as it goes."""

    def __init__(
        self,
        plan: ReshardPlan,
        groups: Mapping[str, Any],
        prep: Prepared,
        bucket_bytes: int,
        engine: Any,
        timeout: float,
    ) -> None:
        self.plan, self._groups, self._prep = plan, groups, prep
        self._bucket_bytes, self._engine, self._timeout = bucket_bytes, engine, timeout
        self.schedule: list[StreamBucket] = plan.stream_schedule(bucket_bytes, prep.infer_rank)[0]
        self._buckets = plan.buckets(bucket_bytes)
        self.telemetry = StreamTelemetry(
            layout=plan.layout,
            infer_rank=prep.infer_rank,
            buckets=0,
            gather_buckets=len(self._buckets),
            gather_scratch_bytes=scratch_bytes(self._buckets, prep.modes),
            output_scratch_bytes=max(sb.nbytes for sb in self.schedule),
        )
        self._gen = self._run()

    def __iter__(self) -> Iterator[list[tuple[str, Any]]]:
        return self

    def __next__(self) -> list[tuple[str, Any]]:
        return next(self._gen)

    def __len__(self) -> int:
        return len(self.schedule)

    def _run(self) -> Iterator[list[tuple[str, Any]]]:
        import torch

        prep, tele = self._prep, self.telemetry
        dtype = getattr(torch, self.plan.cfg.dtype)
        es = self.plan.itemsize
        cplans = self.plan.native_plans(self._bucket_bytes, prep.infer_rank, stream=True)
        cur_stream = current_stream(prep.device)
        gatherer = Gatherer(prep, self._groups, engine=self._engine, after=cur_stream)
        t_start = time.perf_counter()
        scratch = torch.empty(tele.gather_scratch_bytes, dtype=torch.uint8, device=prep.device)
        out = torch.empty(tele.output_scratch_bytes, dtype=torch.uint8, device=prep.device)
        for sb in self.schedule:
            deadline = Deadline(self._timeout)  # per bucket: the consumer's time between buckets is its own
            for off, nb in sb.zero:
                out[off : off + nb].zero_()
            for k in sb.gather:
                cur = self._buckets[k]
                gathered, err = gatherer.gather(cur, scratch, deadline)
                t1 = time.perf_counter()
                if err is None and cplans[k] is not None:
                    try:
                        self._engine.execute(cplans[k], out, gathered, after=cur_stream).wait(deadline.left())
                    except Exception as e:
                        err = e
                tele.copy_s += time.perf_counter() - t1
                # the ranks agree after every gather bucket: a failure on one raises on all of them here
                ok, _ = agree(err is None, self._groups, prep.device, 0, deadline)
                if err is not None:
                    raise SwitchAborted(
                        f"stream_buckets failed in {bucket_label(cur)} on this rank: {type(err).__name__}: "
                        f"{err}; training weights untouched"
                    ) from err
                if not ok:
                    raise SwitchAborted(
                        f"stream_buckets aborted at {bucket_label(cur)}: another rank of the training groups "
                        "failed there (see its error); training weights untouched"
                    )
            tele.bytes_gathered, tele.pack_s, tele.gather_s = (
                gatherer.received,
                gatherer.pack_s,
                gatherer.exchange_s,
            )
            tele.buckets += 1
            tele.bytes_yielded += sum(int(_numel(shape)) * es for _, _, shape in sb.tensors)
            tele.total_s = time.perf_counter() - t_start
            yield [
                (name, out[off : off + _numel(shape) * es].view(dtype).view(shape))
                for name, off, shape in sb.tensors
            ]
        tele.finished = True
        tele.total_s = time.perf_counter() - t_start


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def stream_buckets(
    train_params: Any,
    plan: ReshardPlan,
    groups: Mapping[str, Any],
    *,
    names: str | None = None,
    infer_rank: int | None = None,
    bucket_bytes: int | str = 64 << 20,
    gather: str = "auto",
    engine: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> BucketStream:
    """The switch as an iterator of named buckets: ``for b in stream_buckets(...): model.load_weights(b)``.

    ``names``: ``"hf"`` (HF checkpoint names and full shapes; per-expert MoE tensors) or ``"vllm"`` (vLLM's
    per-rank fused tensors of ``infer_rank``, the ``megatron_to_vllm`` plan); default: ``plan.layout``.
    ``"hf"`` works from any plan; ``"vllm"`` needs a ``megatron_to_vllm`` plan (it holds the inference sizes).
    ``infer_rank``: the inference TP rank whose slices to yield (default: global rank % TP_i).
    ``engine``: the copy engine (default: that of ``default_switcher(plan)``).
    ``bucket_bytes``: gather bytes per member and output bytes per yielded bucket (a tensor larger than it
    is yielded in a bucket of its own), or ``"auto"`` (from free device memory, as in ``allgather_swap``).
    ``timeout``: seconds for each bucket's gather and copy.

    The training weights are only read (no swap-out). Checks and the ranks' agreement run here, before
    this returns; every rank of the training groups must then consume the iterator to the end. The yielded
    tensors are views into one reused output scratch, valid until the next bucket is requested.
    """
    owner = plan
    names_error: ReshardError | None = None  # raised after the ranks' agreement, like every other check
    if names is None:
        names = plan.layout
    if names not in ("hf", "vllm"):
        names_error = ReshardError(f"names must be 'hf' or 'vllm', got {names!r}")
    elif names == "vllm" and plan.layout != "vllm":
        names_error = ReshardError(
            "names='vllm' needs a megatron_to_vllm(cfg, train, infer) plan (it holds the inference TP/EP); "
            f"got {plan!r}"
        )
    elif names != plan.layout:
        plan = plan.hf_plan()

    def check(params: dict[str, Any], rank: int) -> None:
        if names_error is not None:
            raise names_error

    prep = prepare(
        "stream_buckets",
        train_params,
        plan,
        groups,
        infer_rank=infer_rank,
        bucket_bytes=bucket_bytes,
        gather=gather,
        timeout=timeout,
        settings=(names,),
        extra_check=check,
    )
    if engine is None:
        from .swap import default_switcher

        engine = default_switcher(owner).engine
    return BucketStream(plan, groups, prep, prep.bucket_bytes, engine, timeout)
