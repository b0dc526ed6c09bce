"""Streamed named buckets: the switch as an iterator of ``[(name, tensor), ...]`` buckets in HF names (full
shapes) or vLLM per-rank names (``qkv_proj``, ``gate_up_proj``, ``w13_weight`` ...), so an engine's
``load_weights`` (or SGLang-style ``update_weights_from_tensor``, or a trainer's own sender) consumes the
switch bucket by bucket without the whole model materialised on any rank.

Memory: one gather scratch (the largest gathered bucket, as in :func:`allgather_swap`) and one output scratch
(the largest stream bucket: ``bucket_bytes`` of inference tensors, or one tensor when a single tensor is
larger), both reused for every bucket. The yielded tensors are views into the output scratch: they are valid
until the next bucket is requested; copy what must outlive that.

With ``inplace=True`` a tensor that this rank holds as one contiguous range of its own parameter (training
TP 1 dense weights, an EP rank's own experts, replicated norms: ``ReshardPlan.inplace_targets``) is
yielded as a view of that parameter, with no gather and no copy; a gather bucket that no rank needs for
anything else is skipped by every rank; a bucket with nothing to exchange (group of one, PP 1) is copied
straight from the parameters (no pack, no gather scratch); a tensor that is one contiguous range of a
gathered bucket (another EP rank's expert) is yielded as a view of the gather scratch (no output copy);
the scratches are sized to what is still gathered and copied, and are not allocated when nothing is.
The parameter views alias the live training weights: a consumer must copy them (verl's sender does)
before the weights change and never write into them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ReshardError, SwitchAborted
from .plan import ReshardPlan, StreamBucket, rebase_onto_params
from .steps import (
    DEFAULT_TIMEOUT,
    Deadline,
    Gatherer,
    Prepared,
    agree,
    bucket_label,
    current_stream,
    group_rank,
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
    gather_buckets: int  # gather buckets walked (gathered, or copied straight from the parameters)
    gather_scratch_bytes: int  # the reused gather scratch (0: not allocated)
    output_scratch_bytes: int  # the reused output bucket the yielded views live in (0: not allocated)
    skipped_buckets: int = 0  # inplace: gather buckets no rank needs
    direct_buckets: int = 0  # inplace: buckets copied from the parameters (nothing to exchange)
    inplace_tensors: int = 0  # inplace: tensors yielded as views of this rank's parameters
    scratch_views: int = 0  # inplace: tensors yielded as views of the gather scratch (no output copy)
    bytes_inplace: int = 0
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
        inplace: bool = False,
    ) -> None:
        self.plan, self._groups, self._prep = plan, groups, prep
        self._bucket_bytes, self._engine, self._timeout = bucket_bytes, engine, timeout
        buckets = plan.buckets(bucket_bytes)
        self._views: dict[str, tuple[str, int]] = {}
        self._walk = list(range(len(buckets)))  # the gather buckets every rank walks, in order
        self._direct: dict[int, list[tuple[str, Any]]] = {}  # bucket -> (param, CopyPlan): no exchange
        self._p2p: dict[int, bool] = {}  # bucket -> this rank reads its own slot (else compacted)
        if inplace:
            tp_rank, ep_rank = group_rank(groups.get("tp")), group_rank(groups.get("ep"))
            self._views = plan.inplace_targets(prep.infer_rank, prep.stage, tp_rank, ep_rank)
            needed = plan.needed_buckets(bucket_bytes)
            self._walk = [k for k in self._walk if k in needed]
        views = frozenset(self._views) if inplace else None
        self.schedule: list[StreamBucket] = plan.stream_schedule(bucket_bytes, prep.infer_rank, views)[0]
        self._cplans = plan.native_plans(bucket_bytes, prep.infer_rank, stream=True, inplace=views)
        if inplace and plan.train.pp == 1:
            from msrl_core import CopyPlan

            rebased = plan.stream_schedule(bucket_bytes, prep.infer_rank, views)[1]
            self._cplans = list(self._cplans)
            for k in self._walk:
                b = buckets[k]
                if b.members == 1:  # nothing crosses ranks: copy from the parameters themselves
                    d = rebase_onto_params(b, rebased[k])
                    self._direct[k] = [(n, CopyPlan(x)) for n, x in d.items()]
                elif prep.modes[b.group] == "p2p":  # every rank alike: sent from the parameters, no pack
                    me, lb = group_rank(groups.get(b.group)), b.local_bytes
                    rd = rebased[k]
                    own = bool(len(rd)) and bool(((rd[:, 0] >= me * lb) & (rd[:, 0] < (me + 1) * lb)).any())
                    own = own or any(
                        me * lb <= off < (me + 1) * lb
                        for sb in self.schedule
                        for _, off, _ in sb.gathered
                        if sb.gather and sb.gather[-1] == k
                    )
                    self._p2p[k] = own
                    if not own and len(rd):  # compacted slots: the members after this rank move down one
                        rd = rd.copy()
                        rd[rd[:, 0] >= (me + 1) * lb, 0] -= lb
                        self._cplans[k] = CopyPlan(rd)
        self._buckets = buckets
        gathered = [buckets[k] for k in self._walk if k not in self._direct and k not in self._p2p]
        p2p_bytes = [
            (b.members - (0 if self._p2p[b.index] else 1)) * b.local_bytes
            for b in buckets
            if b.index in self._p2p
        ]
        self.telemetry = StreamTelemetry(
            layout=plan.layout,
            infer_rank=prep.infer_rank,
            buckets=0,
            gather_buckets=len(self._walk),
            gather_scratch_bytes=max([scratch_bytes(gathered, prep.modes) if gathered else 0, *p2p_bytes]),
            output_scratch_bytes=max(sb.nbytes for sb in self.schedule),
            skipped_buckets=len(buckets) - len(self._walk),
            direct_buckets=len(self._direct),
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
        cplans = self._cplans
        walk = set(self._walk)
        cur_stream = current_stream(prep.device)
        gatherer = Gatherer(prep, self._groups, engine=self._engine, after=cur_stream)
        t_start = time.perf_counter()

        def alloc(n: int) -> Any:
            return torch.empty(n, dtype=torch.uint8, device=prep.device) if n else None

        scratch = alloc(tele.gather_scratch_bytes)
        out = alloc(tele.output_scratch_bytes)
        flat = {n: prep.params[n].detach().reshape(-1) for n in {p for p, _ in self._views.values()}}
        for sb in self.schedule:
            deadline = Deadline(self._timeout)  # per bucket: the consumer's time between buckets is its own
            for off, nb in sb.zero:
                out[off : off + nb].zero_()
            for k in sb.gather:
                if k not in walk:
                    continue  # no rank needs this bucket: every tensor it holds is in place where it is read
                cur = self._buckets[k]
                t1 = time.perf_counter()
                if k in self._direct:
                    err = self._copy_direct(k, out, cur_stream, deadline)
                else:
                    if k in self._p2p:
                        gathered, err = gatherer.exchange_params(cur, scratch, self._p2p[k], deadline)
                    else:
                        gathered, err = gatherer.gather(cur, scratch, deadline)
                    t1 = time.perf_counter()
                    if err is None and cplans[k] is not None:
                        try:
                            self._engine.execute(cplans[k], out, gathered, after=cur_stream).wait(
                                deadline.left()
                            )
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
            views = []
            for name, shape in sb.inplace:
                param, off = self._views[name]
                views.append((name, flat[param][off : off + _numel(shape)].view(shape)))
            tele.inplace_tensors += len(views)
            tele.scratch_views += len(sb.gathered)
            tele.bytes_yielded += sum(int(_numel(shape)) * es for _, _, shape in sb.gathered)
            tele.bytes_inplace += sum(int(_numel(shape)) * es for _, shape in sb.inplace)
            tele.bytes_yielded += sum(int(_numel(shape)) * es for _, _, shape in sb.tensors)
            tele.bytes_yielded += sum(int(_numel(shape)) * es for _, shape in sb.inplace)
            tele.total_s = time.perf_counter() - t_start
            yield (
                [
                    (name, out[off : off + _numel(shape) * es].view(dtype).view(shape))
                    for name, off, shape in sb.tensors
                ]
                + [
                    (name, scratch[o : o + _numel(shape) * es].view(dtype).view(shape))
                    for name, o, shape in ((n, self._scratch_at(sb, off), sh) for n, off, sh in sb.gathered)
                ]
                + views
            )
        tele.finished = True
        tele.total_s = time.perf_counter() - t_start

    def _scratch_at(self, sb: StreamBucket, off: int) -> int:
        """Where a view of the gather scratch lies: its plan offset, moved down one slot in a compacted
        exchange for the members after this rank."""
        k = sb.gather[-1]
        if self._p2p.get(k, True):
            return off
        b = self._buckets[k]
        me = group_rank(self._groups.get(b.group))
        return off - b.local_bytes if off >= (me + 1) * b.local_bytes else off

    def _copy_direct(self, k: int, out: Any, stream: Any, deadline: Deadline) -> Exception | None:
        """Bucket ``k`` has nothing to exchange: one fused copy per parameter straight into the output."""
        tickets: list[Any] = []
        err: Exception | None = None
        try:
            for name, cplan in self._direct[k]:
                tickets.append(
                    self._engine.execute(cplan, out, self._prep.params[name].detach(), after=stream)
                )
        except Exception as e:
            err = e
        for t in tickets:  # never leave a copy running into the scratch; the first error is the one reported
            try:
                t.wait(deadline.left())
            except Exception as e:
                err = err or e
        return err


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
    inplace: bool = False,
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

    ``inplace``: yield the tensors this rank holds contiguously in its own parameters as views of them (no
    gather, no copy, no scratch; see the module docstring). Those views alias the training weights: valid
    until the weights change (the next optimizer step or offload), never to be written. Every rank must
    pass the same value.
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
    if names_error is None and not isinstance(inplace, bool):
        names_error = ReshardError(f"inplace must be True or False, got {inplace!r}")

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
        settings=(names, inplace),
        extra_check=check,
    )
    if engine is None:
        from .swap import default_switcher

        engine = default_switcher(owner).engine
    return BucketStream(plan, groups, prep, prep.bucket_bytes, engine, timeout, inplace)
