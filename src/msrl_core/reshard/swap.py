"""allgather-swap execution: bucketed all-gather over the caller's process groups, one fused strided copy
per bucket into the flat inference buffer, swap-out of the training weights to persistent pinned host
mirrors (storage freed, tensor objects kept), and the asynchronous swap back. With nothing to gather
(training TP, EP and PP all 1) the buckets' descriptors run straight from each parameter's storage: one
fused copy per parameter, no pack, no scratch, no collective.

One :class:`Switcher` per plan owns what outlives a switch: the pinned host mirrors, the copy engine and
pinned pool it uses (injectable), and the state (the :class:`Swap` not yet swapped back). The switch runs as
named steps (:meth:`Switcher.switch`): prepare and agree, reshard the buckets (a status agreement per
``AGREE_BYTES`` of gathered buckets and after the last), verify, swap out and agree again, guard the
swapped-out parameters.

Memory: ``SwapTelemetry`` separates device bytes (training shard, inference buffer, gather scratch) from host
bytes (pinned mirrors, pool). ``peak_bytes`` is the accounted sum; ``measured_peak_bytes`` (``measure=True``)
is measured: the allocations made during the switch (``torch.cuda.max_memory_allocated`` on CUDA, a tally of
every storage torch allocates on the CPU, see ``memory.py``) on top of the shard and the inference buffer.
"""

from __future__ import annotations

import contextlib
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import ReshardError, SwapStateError, SwitchAborted
from .guard import ReadGuard
from .memory import MemoryProbe
from .mirrors import EngineAndPool, HostMirrors, Storage, unique_storages
from .plan import INFER_RANK_ATTR, Bucket, ReshardPlan, views_of
from .steps import (
    AGREE_BYTES,
    DEFAULT_TIMEOUT,
    Deadline,
    Gatherer,
    Prepared,
    agree,
    bucket_label,
    bytes_view,
    current_stream,
    direct_descriptors,
    group_rank,
    group_size,
    normalize_params,
    nothing_to_gather,
    prepare,
    scratch_bytes,
)

__all__ = ["Swap", "SwapTelemetry", "Switcher", "allgather_swap", "default_switcher", "naive_reshard"]


@dataclass
class SwapTelemetry(Mapping):
    """What one switch did. Also a read-only mapping (``t["freed_bytes"]``, ``dict(t)``).

    Device bytes are on the training device (on the host runtime that is host RAM: ``device_is_host``).
    """

    layout: str
    infer_rank: int
    gather: str  # "all_gather" | "p2p" | "none" (training TP, EP, PP 1: direct copies from the parameters)
    bucket_bytes: int  # requested bytes per member and bucket
    buckets: int
    my_buckets: int
    descriptors: int
    pipelined: bool
    # device bytes
    train_bytes: int
    infer_bytes: int
    scratch_bytes: int  # the gather scratch allocated: one bucket, two when pipelined, none when direct
    freed_bytes: int = 0
    peak_bytes: int = 0  # accounted: live training storages + inference buffer + scratch, at every step
    final_bytes: int = 0
    measured_peak_bytes: int | None = None  # measure=True: shard + inference + measured switch allocations
    measured_switch_bytes: int | None = None  # measure=True: the allocations alone (peak above the entry)
    cuda_peak_bytes: int | None = None
    device_is_host: bool = False
    # host bytes
    mirror_bytes: int = 0  # pinned mirrors held for this plan
    mirror_new_bytes: int = 0  # pinned bytes this switch allocated (the first switch: the whole shard)
    pool_reserved_bytes: int = 0
    # traffic and time
    bytes_gathered: int = 0
    bytes_copied: int = 0
    pack_s: float = 0.0
    gather_s: float = 0.0
    copy_s: float = 0.0
    total_s: float = 0.0
    swap_out_s: float = 0.0
    swap_out_gbps: float = 0.0
    swap_out_copy_s: float = 0.0
    swap_out_copy_gbps: float = 0.0
    swap_in_s: float = 0.0
    swap_in_gbps: float = 0.0
    verified_infer: bool = False
    verified_swap: bool = False

    def __getitem__(self, key: str) -> Any:
        if key in self._names():
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        yield from self._names()

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _crc(t) -> int:
    import torch

    # clone first: Tensor.numpy() on the training storage would make it non-resizable for good
    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes())


class _Meter:
    def __init__(self) -> None:
        self.cur = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.cur += n
        self.peak = max(self.peak, self.cur)

    def sub(self, n: int) -> None:
        self.cur -= n


def _buffer_rank(infer: Any) -> int | None:
    """The inference rank a buffer from ``plan.allocate_inference(r)`` was laid out for (None: unknown)."""
    t = infer if not isinstance(infer, Mapping) else next(iter(infer.values()), None)
    return getattr(t, INFER_RANK_ATTR, None)


def _infer_flat(plan: ReshardPlan, infer: Any, infer_rank: int):
    import torch

    have = _buffer_rank(infer)
    if have is not None and have != infer_rank:
        raise ReshardError(
            f"the inference buffer was allocated for infer_rank {have} (plan.allocate_inference({have})), "
            f"but this switch fills infer_rank {infer_rank}: pass infer_rank={have} or allocate for "
            f"{infer_rank}"
        )
    layout, total = plan.infer_layout(infer_rank)
    if isinstance(infer, torch.Tensor):
        if infer.dtype != torch.uint8 or infer.numel() < total or not infer.is_contiguous():
            raise ReshardError(f"inference buffer must be a contiguous uint8 tensor of >= {total} bytes")
        return infer, views_of(infer, layout, getattr(torch, plan.cfg.dtype))
    if isinstance(infer, Mapping):
        missing = [n for n in layout if n not in infer]
        if missing:
            raise ReshardError(f"inference tensor {missing[0]!r} missing from infer_params")
        t0 = infer[next(iter(layout))]
        st = t0.untyped_storage()
        base = st.data_ptr()
        for n, (off, shape) in layout.items():
            t = infer[n]
            if (
                t.untyped_storage().data_ptr() != base
                or t.data_ptr() - base != off
                or tuple(t.shape) != tuple(shape)
            ):
                raise ReshardError(
                    f"inference tensor {n!r} is not the view at byte {off}, shape {tuple(shape)} of one flat "
                    "buffer; allocate with plan.allocate_inference()"
                )
        return bytes_view(st, t0.device), dict(infer)
    raise ReshardError(f"infer must be a flat uint8 tensor or a dict of views, got {type(infer).__name__}")


class Swap:
    """Result of a switch. ``telemetry`` is a :class:`SwapTelemetry`; ``swap_back(stream)`` starts the
    host→device copies (asynchronous), ``wait()`` finishes them and orders the caller's stream after them.
    ``state``: ``"swapped_out"`` → ``"swapping_in"`` → ``"back"``."""

    def __init__(
        self,
        switcher: Switcher,
        storages: list[Storage],
        engine: Any,
        infer_views: dict[str, Any],
        telemetry: SwapTelemetry,
        crcs: dict[str, int] | None,
        guard: ReadGuard | None,
        timeout: float,
    ) -> None:
        self.plan = switcher.plan
        self._switcher = switcher
        self._storages = storages
        self._engine = engine
        self.inference = infer_views
        self.telemetry = telemetry
        self._crcs = crcs
        self._guard = guard
        self._timeout = timeout
        self._state = "swapped_out" if guard is not None else "back"
        self._tickets: list[Any] = []
        self._stream: Any = None
        self._t0 = 0.0

    @property
    def state(self) -> str:
        return self._state

    def swap_back(self, stream: Any = None) -> Swap:
        """Re-materialise the training storages and copy the host mirrors back, on the engine's H2D lane,
        after work already queued on ``stream`` (default: the current stream of the weights' device).
        Returns immediately; call :meth:`wait` before training (the parameters stay unreadable until then)."""
        if self._state != "swapped_out":
            raise SwapStateError(
                f"swap_back called twice (state is {self._state!r}); the weights are already back"
            )
        if stream is None and self._storages:
            # On a GPU the caching allocator may hand the re-materialised storages blocks that kernels
            # still queued on the current stream are using: the copies must start after that work.
            stream = current_stream(self._storages[0].device)
        self._t0 = time.perf_counter()
        try:
            self._tickets.append(self._switcher._copy_in(self._storages, self._engine, stream))
        except Exception as e:
            raise ReshardError(f"swap_back failed: {type(e).__name__}: {e}") from e
        self._stream = stream
        self._state = "swapping_in"
        return self

    def wait(self, timeout: float | None = None) -> None:
        """Finish the swap back (``timeout`` seconds, default: the switch's); then the parameters are
        readable again. With ``verify=True`` the training storages are checked against their CRCs."""
        if self._state == "swapped_out":
            raise SwapStateError("wait() before swap_back(): nothing is in flight")
        if self._state == "back":
            return
        deadline = Deadline(self._timeout if timeout is None else timeout)
        for t in self._tickets:
            t.wait(deadline.left())
        if self._stream is not None and self._tickets:
            self._engine.order_stream(self._tickets[-1], self._stream, deadline.left())
        self._tickets.clear()
        dt = time.perf_counter() - self._t0
        nb = sum(s.nbytes for s in self._storages)
        self.telemetry.swap_in_s = dt
        self.telemetry.swap_in_gbps = nb / dt / 1e9 if dt > 0 else float("inf")
        self._state = "back"
        if self._guard is not None:
            self._guard.remove()
        if self._switcher.active is self:
            self._switcher.active = None
        if self._crcs is not None:
            for s in self._storages:
                if _crc(bytes_view(s.storage, s.device)) != self._crcs[s.name]:
                    raise ReshardError(f"verify: training storage of {s.name!r} differs after swap back")
            self.telemetry.verified_swap = True


class Switcher(EngineAndPool):
    """Owns what outlives one switch of ``plan``: the persistent pinned host mirrors (by parameter name), the
    copy engine and pinned pool (injected, or its own), and the :class:`Swap` not yet swapped back.

    ``switch(...)`` is :func:`allgather_swap`; ``stream(...)`` is :func:`stream_buckets` on this engine."""

    def __init__(self, plan: ReshardPlan, *, engine: Any = None, pool: Any = None) -> None:
        super().__init__(engine, pool)
        self.plan = plan
        self._host = HostMirrors(lambda: self.pool)
        self.active: Swap | None = None
        # nothing to gather: per (bucket_bytes, infer_rank) one copy plan per parameter (pure, built once)
        self._direct: dict[tuple[int, int], list[tuple[str, Any]]] = {}

    @property
    def mirrors(self) -> dict[str, Any]:
        """The persistent pinned host mirrors, by parameter name."""
        return self._host.mirrors

    @property
    def mirror_bytes(self) -> int:
        return self._host.nbytes

    def stream(self, train_params: Any, groups: Mapping[str, Any], **kw: Any):
        from .stream import stream_buckets

        return stream_buckets(train_params, self.plan, groups, engine=self.engine, **kw)

    # -- the switch, step by step --------------------------------------------------------------------
    def switch(
        self,
        train_params: Any,
        infer: Any,
        groups: Mapping[str, Any],
        bucket_bytes: int | str = 64 << 20,
        *,
        infer_rank: int | None = None,
        swap: bool = True,
        verify: bool = False,
        gather: str = "auto",
        pipeline: bool = False,
        measure: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        engine: Any = None,
        pool: Any = None,
        _fail: Callable[[Bucket | None], None] | None = None,
    ) -> Swap:
        """See :func:`allgather_swap` (the same arguments; ``engine`` / ``pool`` override this switcher's for
        one call)."""
        t_start = time.perf_counter()
        plan = self.plan
        target: list[Any] = []

        def check(params: dict[str, Any], rank: int) -> None:
            if self.active is not None:
                raise SwapStateError(
                    "a previous allgather_swap on this plan was not swapped back; call swap_back() and wait()"
                )
            target.extend(_infer_flat(plan, infer, rank))

        if infer_rank is None:  # a buffer from allocate_inference(r) carries its rank
            infer_rank = _buffer_rank(infer)
        prep = prepare(
            "allgather_swap",
            train_params,
            plan,
            groups,
            infer_rank=infer_rank,
            bucket_bytes=bucket_bytes,
            gather=gather,
            timeout=timeout,
            settings=(bool(swap), bool(verify), bool(pipeline)),
            extra_check=check,
        )
        flat, views = target
        engine = engine or self.engine
        pool = pool or self.pool
        storages = unique_storages(prep.params)
        bucket_bytes = prep.bucket_bytes
        tele = self._new_telemetry(prep, flat, storages, bucket_bytes, pipeline)
        meter = _Meter()
        meter.add(tele.train_bytes + tele.infer_bytes)
        # measured: the reshard and the swap-out; not verify (a debugging mode that builds a full reference)
        probes = [MemoryProbe(prep.device), MemoryProbe(prep.device)]
        with probes[0] if measure else _nullcontext():
            if nothing_to_gather(plan):
                self._copy_direct(prep, groups, flat, bucket_bytes, engine, tele, _fail)
            else:
                self._reshard_buckets(prep, groups, flat, bucket_bytes, engine, pipeline, tele, meter, _fail)
        crcs = None
        local_error: Exception | None = None
        try:
            if verify:
                crcs = self._verify(prep, groups, views, storages, tele)
            if swap:
                with probes[1] if measure else _nullcontext():
                    self._swap_out(prep, storages, engine, pool, tele, meter)
        except Exception as e:
            local_error = e
        # agree after the swap-out too: all ranks swapped out, or all restore and raise
        self._agree_swap_out(prep, groups, storages, engine, local_error, swap)
        if measure:
            tele.measured_switch_bytes = max(p.peak_bytes for p in probes)
            tele.measured_peak_bytes = tele.train_bytes + tele.infer_bytes + tele.measured_switch_bytes
        tele.peak_bytes, tele.final_bytes = meter.peak, meter.cur
        tele.mirror_bytes = self.mirror_bytes
        tele.pool_reserved_bytes = int(pool.stats()["reserved"]) if swap else 0
        tele.total_s = time.perf_counter() - t_start
        if prep.device.type == "cuda":
            import torch

            tele.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(prep.device))
        guard = None
        if swap:
            guard = ReadGuard()
            guard.install(prep.params)
        s = Swap(self, storages, engine, views, tele, crcs, guard, timeout)
        if swap:
            self.active = s
        return s

    def _new_telemetry(
        self, prep: Prepared, flat, storages, bucket_bytes: int, pipeline: bool
    ) -> SwapTelemetry:
        plan = self.plan
        buckets = plan.buckets(bucket_bytes)
        direct = nothing_to_gather(plan)
        cplans = (
            [c for _, c in self._direct_plans(bucket_bytes, prep.infer_rank)]
            if direct
            else plan.native_plans(bucket_bytes, prep.infer_rank)
        )
        return SwapTelemetry(
            layout=plan.layout,
            infer_rank=prep.infer_rank,
            gather="none" if direct else prep.modes["tp"] if plan.train.tp > 1 else prep.modes["ep"],
            bucket_bytes=bucket_bytes,
            buckets=len(buckets),
            my_buckets=sum(1 for b in buckets if b.stage == prep.stage),
            descriptors=int(sum(len(c) for c in cplans if c is not None)),
            pipelined=pipeline and not direct,
            train_bytes=sum(s.nbytes for s in storages),
            infer_bytes=int(flat.numel()),
            scratch_bytes=0 if direct else scratch_bytes(buckets, prep.modes) * (2 if pipeline else 1),
            device_is_host=prep.device.type == "cpu",
            bytes_copied=int(sum(c.bytes for c in cplans if c is not None)),
        )

    def _direct_plans(self, bucket_bytes: int, infer_rank: int) -> list[tuple[str, Any]]:
        key = (bucket_bytes, infer_rank)
        if key not in self._direct:
            from msrl_core import CopyPlan

            descs = direct_descriptors(self.plan, bucket_bytes, infer_rank)
            self._direct[key] = [(n, CopyPlan(d)) for n, d in descs.items()]
        return self._direct[key]

    def _copy_direct(
        self,
        prep: Prepared,
        groups: Mapping[str, Any],
        flat,
        bucket_bytes: int,
        engine: Any,
        tele: SwapTelemetry,
        fail: Callable[[Bucket | None], None] | None,
    ) -> None:
        """Nothing to gather (training TP, EP, PP 1): one fused copy per parameter straight from its storage
        into the inference buffer, all submitted before the first wait; no pack, no scratch, no collective.
        The ranks (of size-1 groups) still agree once, as after a bucket."""
        deadline = prep.deadline
        cur_stream = current_stream(prep.device)
        t0 = time.perf_counter()
        tickets: list[Any] = []
        at = "setup"
        failed: Exception | None = None
        try:
            if fail is not None:
                fail(None)
            for name, cplan in self._direct_plans(bucket_bytes, prep.infer_rank):
                at = f"parameter {name!r}"
                # ordered after the kernels queued on the caller's current stream that produced the weights
                tickets.append(engine.execute(cplan, flat, prep.params[name].detach(), after=cur_stream))
            at = "the direct copies"
            for t in tickets:
                t.wait(deadline.left())
        except Exception as e:
            failed = e
            for t in tickets:  # never leave a copy running into the buffer after the switch returned
                with contextlib.suppress(Exception):  # the first error is the one reported
                    t.wait(deadline.left())
        tele.copy_s = time.perf_counter() - t0
        ok, _ = agree(failed is None, groups, prep.device, 0, deadline)
        if failed is not None:
            raise SwitchAborted(
                f"allgather_swap failed at {at} (direct copy, nothing to gather) on this rank: "
                f"{type(failed).__name__}: {failed}; training weights untouched on every rank"
            ) from failed
        if not ok:
            raise SwitchAborted(
                "allgather_swap aborted: another rank of the training groups failed its direct copy (see its "
                "error); training weights untouched on every rank"
            )

    def _reshard_buckets(
        self,
        prep: Prepared,
        groups: Mapping[str, Any],
        flat,
        bucket_bytes: int,
        engine: Any,
        pipeline: bool,
        tele: SwapTelemetry,
        meter: _Meter,
        fail: Callable[[Bucket | None], None] | None,
    ) -> None:
        """Gather every bucket and copy it into the inference buffer. The ranks agree on a status (one tiny
        all-reduce) after every ``AGREE_BYTES`` of gathered buckets and after the last one, so a failure on
        one rank at bucket k raises on every rank at the next agreement (the failed rank keeps taking part in
        the gathers until then, copying nothing). Per 1 MiB bucket the agreement cost as much as the gather
        on gloo (e2e TP 2 profile: 32 agreements 0.071 s, 29 exchanges 0.064 s of a 0.19 s switch).
        ``pipeline``: two gather scratches; bucket k+1 is gathered while the fused copy of bucket k runs."""
        import torch

        plan, deadline = self.plan, prep.deadline
        buckets = plan.buckets(bucket_bytes)
        cplans = plan.native_plans(bucket_bytes, prep.infer_rank)
        cur_stream = current_stream(prep.device)
        gatherer = Gatherer(prep, groups, fail, engine, after=cur_stream)
        one = tele.scratch_bytes // (2 if pipeline else 1)
        scratches: list[Any] = []
        pending: tuple[Any, Bucket] | None = None  # the copy in flight (pipelined)
        t_copy = 0.0

        def finish(p: tuple[Any, Bucket]) -> tuple[Bucket, Exception] | None:
            nonlocal t_copy
            t1 = time.perf_counter()
            try:
                p[0].wait(deadline.left())
            except Exception as e:
                return p[1], e
            finally:
                t_copy += time.perf_counter() - t1
            return None

        failed: tuple[Bucket, Exception] | None = None
        b: Bucket | None = None
        try:
            for _ in range(2 if pipeline else 1):
                scratches.append(torch.empty(one, dtype=torch.uint8, device=prep.device))
                meter.add(one)
            if fail is not None:
                fail(None)
        except Exception as e:
            failed = (buckets[0], e)
        try:
            ok, _ = agree(failed is None, groups, prep.device, 0, deadline)  # the scratch exists everywhere
            since = 0  # bytes gathered since the last agreement
            for k, b in enumerate(buckets if ok else []):
                gathered, err = gatherer.gather(b, scratches[k % len(scratches)], deadline)
                if err is not None:
                    failed = failed or (b, err)
                if pending is not None:
                    failed = failed or finish(pending)
                    pending = None
                if failed is None and cplans[k] is not None:
                    t1 = time.perf_counter()
                    try:
                        # ordered after the gather/pack queued on the caller's current stream (GPU)
                        ticket = engine.execute(cplans[k], flat, gathered, after=cur_stream)
                        pending = (ticket, b)
                    except Exception as e:
                        failed = (b, e)
                    t_copy += time.perf_counter() - t1
                    if pending is not None and not pipeline:
                        failed = failed or finish(pending)
                        pending = None
                # the ranks agree once per AGREE_BYTES gathered (every bucket when buckets are that large) and
                # after the last bucket; a rank that failed keeps taking part in the gathers until then
                since += b.gathered_bytes
                if since >= AGREE_BYTES or k == len(buckets) - 1:
                    since = 0
                    ok, _ = agree(failed is None, groups, prep.device, 0, deadline)
                if not ok:
                    break
            else:
                if (
                    pipeline and ok
                ):  # every rank agrees once more on the last copy (whether or not it had one)
                    if pending is not None:
                        failed = failed or finish(pending)
                        pending = None
                    ok, _ = agree(failed is None, groups, prep.device, 0, deadline)
        finally:
            if pending is not None:
                finish(pending)  # never leave a copy running into a scratch that is about to be freed
        meter.sub(one * len(scratches))
        del scratches
        tele.bytes_gathered = gatherer.received
        tele.pack_s, tele.gather_s, tele.copy_s = gatherer.pack_s, gatherer.exchange_s, t_copy
        if failed is not None:
            fb, err = failed
            raise SwitchAborted(
                f"allgather_swap failed in {bucket_label(fb)} of {len(buckets)} on this rank: "
                f"{type(err).__name__}: {err}; training weights untouched on every rank"
            ) from err
        if not ok:
            raise SwitchAborted(
                f"allgather_swap aborted at {bucket_label(b)} of {len(buckets)}: another rank of the "
                "training groups failed there (see its error); training weights untouched on every rank"
            )

    def _verify(self, prep: Prepared, groups, views, storages, tele: SwapTelemetry) -> dict[str, int]:
        import torch

        ref = naive_reshard(prep.params, self.plan, groups, prep.infer_rank)[0]
        for n, v in views.items():
            if n not in ref or not torch.equal(v, ref[n].to(v.device)):
                raise ReshardError(f"verify: inference tensor {n!r} differs from the reference reshard")
        tele.verified_infer = True
        return {s.name: _crc(bytes_view(s.storage, s.device)) for s in storages}

    def _swap_out(self, prep: Prepared, storages, engine, pool, tele: SwapTelemetry, meter: _Meter) -> None:
        """Copy every training storage to its pinned mirror (one batch), then free the storages. A failure
        restores what was already freed and raises."""
        stream = current_stream(prep.device)
        r = self._host.swap_out(storages, engine, prep.deadline, stream, "parameter", pool)
        meter.sub(tele.train_bytes)
        nb = tele.train_bytes
        tele.mirror_new_bytes = r.new_bytes
        tele.swap_out_s, tele.swap_out_gbps = (
            r.seconds,
            nb / r.seconds / 1e9 if r.seconds > 0 else float("inf"),
        )
        # the device->host copies alone (swap_out_s adds mirror lookup and freeing the storages)
        dc = r.copy_seconds
        tele.swap_out_copy_s, tele.swap_out_copy_gbps = dc, nb / dc / 1e9 if dc > 0 else float("inf")
        tele.freed_bytes = sum(s.nbytes for s in storages if s.storage.nbytes() == 0)

    def _agree_swap_out(
        self, prep, groups, storages, engine, local_error: Exception | None, swap: bool
    ) -> None:
        """After the swap-out every rank must be swapped out, or none: a rank whose swap-out (or verify)
        failed has restored itself; the others restore here, and every rank raises."""
        ok, _ = agree(local_error is None, groups, prep.device, 0, prep.deadline)
        if ok:
            return
        if local_error is not None:
            raise local_error
        if swap:  # into re-materialised storages: after the work queued on the caller's stream (GPU)
            self._copy_in(storages, engine, current_stream(prep.device)).wait(prep.deadline.left())
        raise SwitchAborted(
            "allgather_swap: another rank of the training groups failed its verify or swap-out (see its "
            "error); the training weights are restored here"
        )

    def _copy_in(self, storages: list[Storage], engine: Any, stream: Any) -> Any:
        return self._host.copy_in(storages, engine, stream)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_DEFAULT_SWITCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_switcher(plan: ReshardPlan) -> Switcher:
    """The :class:`Switcher` that :func:`allgather_swap` uses for ``plan`` when none is passed: created on
    first use with its own engine and pool, kept while the plan lives. Pass ``switcher=`` to own one."""
    sw = _DEFAULT_SWITCHERS.get(plan)
    if sw is None:
        sw = _DEFAULT_SWITCHERS[plan] = Switcher(plan)
    return sw


def allgather_swap(
    train_params: Any,
    infer: Any,
    plan: ReshardPlan,
    groups: Mapping[str, Any],
    bucket_bytes: int | str = 64 << 20,
    *,
    infer_rank: int | None = None,
    swap: bool = True,
    verify: bool = False,
    engine: Any = None,
    pool: Any = None,
    gather: str = "auto",
    pipeline: bool = False,
    measure: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    switcher: Switcher | None = None,
) -> Swap:
    """Fill the inference weights from the training shards and swap the training weights out.

    ``train_params``: this rank's Megatron parameters (a module or ``{name: tensor}``, stage-local names).
    ``infer``: the flat buffer from ``plan.allocate_inference(r)`` or its dict of views; it carries ``r``,
    which is then the default ``infer_rank`` (otherwise global rank % TP_i); another ``infer_rank`` raises.
    ``groups``: ``{"tp": ..., "pp": ..., "ep": ...}`` torch.distributed process groups (None for size 1).
    ``gather``: ``"all_gather"`` (one ``all_gather_single`` per bucket), ``"p2p"`` (the same exchange as
    pairwise ``isend``/``irecv`` straight into the gathered bucket, no send buffer), or ``"auto"``: p2p on
    gloo groups (gloo's all-gather stages through extra copies; p2p is 1.5-2.5x faster on CPU), the
    collective elsewhere (NCCL/HCCL). With training TP, EP and PP all 1 nothing is gathered: one fused copy
    per parameter straight into ``infer`` (``telemetry.gather == "none"``; ``pipeline``: nothing to overlap).
    ``bucket_bytes``: bytes per member and bucket, or ``"auto"``: chosen from free device memory (1/16 of
    it over the group's members, 1-256 MiB, the smallest of the ranks' choices; ``telemetry.bucket_bytes``).
    ``pipeline``: gather bucket k+1 while the fused copy of bucket k runs (two gather scratches).
    ``measure``: measure the switch's allocations (``telemetry.measured_peak_bytes``, see ``memory.py``).
    ``timeout``: seconds for the whole switch; every wait inside it gets the time that is left.
    ``switcher``: the :class:`Switcher` owning the mirrors and state (default: :func:`default_switcher`).

    Every check runs before the ranks agree (one tiny all-reduce), and the ranks also agree during the
    buckets (per 16 MiB gathered, and after the last) and after the swap-out: one rank's bad input or failure
    raises on every rank (``ReshardError`` / :class:`SwitchAborted`), with the training weights untouched or
    restored everywhere. Between the switch and ``wait()`` the swapped-out parameters must not be read: torch
    functions on them raise ``SwapStateError`` (see ``guard.py``).
    """
    sw = switcher or default_switcher(plan)
    if sw.plan is not plan:
        raise ReshardError(f"switcher belongs to {sw.plan!r}, not to {plan!r}")
    return sw.switch(
        train_params,
        infer,
        groups,
        bucket_bytes,
        infer_rank=infer_rank,
        swap=swap,
        verify=verify,
        gather=gather,
        pipeline=pipeline,
        measure=measure,
        timeout=timeout,
        engine=engine,
        pool=pool,
    )


def naive_reshard(train_params: Any, plan: ReshardPlan, groups: Mapping[str, Any], infer_rank: int = 0):
    """Baseline: one all-gather per parameter (fresh tensors), torch cat/reshape/slicing to the target layout,
    everything kept. Returns ``(targets, accounted_bytes)``; accounted = live storages (training shard +
    gathered parameters + intermediates + outputs)."""
    import torch
    import torch.distributed as dist

    from . import reference

    params = normalize_params(train_params)
    tr = plan.train
    stage = group_rank(groups.get("pp"))
    tp_rank, ep_rank = group_rank(groups.get("tp")), group_rank(groups.get("ep"))
    shards: dict[tuple[int, int, int], dict[str, Any]] = {}
    for s in range(tr.pp):
        for name, shape, grp in plan.stage_params[s]:
            if s == stage:
                p = params[name]
                g = groups.get(grp)
                n = group_size(g)
                parts = [torch.empty_like(p) for _ in range(n)] if n > 1 else [p]
                if n > 1:
                    dist.all_gather(parts, p.contiguous(), group=g)
            else:
                n = tr.tp if grp == "tp" else tr.ep
                parts = [torch.empty(shape, dtype=getattr(torch, plan.cfg.dtype)) for _ in range(n)]
            if tr.pp > 1:
                src = dist.get_global_rank(groups["pp"], s)
                for t in parts:
                    dist.broadcast(t, src=src, group=groups["pp"])
            for m, t in enumerate(parts):
                key = (s, m, ep_rank) if grp == "tp" else (s, tp_rank, m)
                shards.setdefault(key, {})[name] = t
    # members of the other group: replicated/expert params come from member 0 in the reference
    for (s, a, b), d in list(shards.items()):
        for key in ((s, a, 0), (s, 0, b)):
            if key != (s, a, b):
                shards.setdefault(key, {}).update({k: v for k, v in d.items() if k not in shards[key]})
    hf = reference.megatron_to_hf(plan.cfg, tr, shards)
    out = hf if plan.layout == "hf" else reference.hf_to_vllm(plan.cfg, plan.infer, infer_rank, hf)
    live: dict[int, int] = {}
    for t in (
        list(params.values())
        + [t for d in shards.values() for t in d.values()]
        + list(hf.values())
        + list(out.values())
    ):
        st = t.untyped_storage()
        live[st.data_ptr()] = st.nbytes()
    return out, int(sum(live.values()))
