"""allgather-swap execution: bucketed all-gather over the caller's process groups, one fused strided copy
per bucket into the flat inference buffer, swap-out of the training weights to persistent pinned host
mirrors (storage freed, tensor objects kept), and the asynchronous swap back.

Accounting: on every runtime the switch reports *accounted* device bytes: the live storages of the training
parameters, the inference buffer and the gather scratch, summed at every step (``peak_bytes``). On CUDA
``torch.cuda.max_memory_allocated`` is reported beside it (``cuda_peak_bytes``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from typing import Any

from .errors import ReshardError, SwapStateError
from .plan import INFER_RANK_ATTR, ReshardPlan, views_of
from .steps import (
    DEFAULT_TIMEOUT,
    Gatherer,
    bucket_label,
    bytes_view,
    current_stream,
    group_rank,
    group_size,
    normalize_params,
    prepare,
    scratch_bytes,
)

__all__ = ["Swap", "allgather_swap", "naive_reshard"]

_POOL: Any = None
_ENGINE: Any = None


def _default_engine():
    global _ENGINE
    if _ENGINE is None:
        from msrl_core import CopyEngine

        _ENGINE = CopyEngine()
    return _ENGINE


def _default_pool():
    global _POOL
    if _POOL is None:
        from msrl_core import PinnedPool

        _POOL = PinnedPool()
    return _POOL


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


class Swap:
    """Result of :func:`allgather_swap`. ``telemetry`` is a dict; ``swap_back(stream)`` starts the host→device
    copies (asynchronous), ``wait()`` finishes them and orders the caller's stream after them."""

    def __init__(self, plan, storages, mirrors, engine, infer_views, telemetry, verify, crcs) -> None:
        self.plan = plan
        self._storages = storages  # [(name, storage, nbytes, device)]
        self._mirrors = mirrors
        self._engine = engine
        self.inference = infer_views
        self.telemetry = telemetry
        self._verify = verify
        self._crcs = crcs
        self._state = "swapped_out"
        self._tickets: list[Any] = []
        self._stream: Any = None
        self._t0 = 0.0

    @property
    def state(self) -> str:
        return self._state

    def swap_back(self, stream: Any = None) -> Swap:
        """Re-materialise the training storages and copy the host mirrors back, on the engine's H2D lane,
        after work already queued on ``stream`` (default: the current stream of the weights' device).
        Returns immediately; call :meth:`wait` before training."""
        if self._state != "swapped_out":
            raise SwapStateError(
                f"swap_back called twice (state is {self._state!r}); the weights are already back"
            )
        import torch

        if stream is None and self._storages:
            # On a GPU the caching allocator may hand the re-materialised storages blocks that kernels
            # still queued on the current stream are using: the copies must start after that work.
            stream = current_stream(self._storages[0][3])
        self._t0 = time.perf_counter()
        name = "(none)"
        try:
            dsts, srcs = [], []
            for name, st, nbytes, device in self._storages:
                st.resize_(nbytes)
                dsts.append(bytes_view(st, device))
                srcs.append(torch.frombuffer(self._mirrors[name], dtype=torch.uint8, count=nbytes))
            name = "(all storages, one batch)"
            self._tickets.append(self._engine.copy_many(dsts, srcs, kind="h2d", after=stream))
        except Exception as e:
            raise ReshardError(f"swap_back failed at parameter {name!r}: {e}") from e
        self._stream = stream
        self._state = "swapping_in"
        return self

    def wait(self, timeout: float = 60.0) -> None:
        if self._state == "swapped_out":
            raise SwapStateError("wait() before swap_back(): nothing is in flight")
        if self._state == "back":
            return
        for t in self._tickets:
            t.wait(timeout)
        if self._stream is not None and self._tickets:
            self._engine.order_stream(self._tickets[-1], self._stream, timeout)
        self._tickets.clear()
        dt = time.perf_counter() - self._t0
        nb = sum(s[2] for s in self._storages)
        self.telemetry["swap_in_s"] = dt
        self.telemetry["swap_in_gbps"] = nb / dt / 1e9 if dt > 0 else float("inf")
        self._state = "back"
        if self.plan._active is self:
            self.plan._active = None
        if self._verify:
            for name, st, _, device in self._storages:
                if _crc(bytes_view(st, device)) != self._crcs[name]:
                    raise ReshardError(f"verify: training storage of {name!r} differs after swap back")
            self.telemetry["verified_swap"] = True


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


def allgather_swap(
    train_params: Any,
    infer: Any,
    plan: ReshardPlan,
    groups: Mapping[str, Any],
    bucket_bytes: int = 64 << 20,
    *,
    infer_rank: int | None = None,
    swap: bool = True,
    verify: bool = False,
    engine: Any = None,
    pool: Any = None,
    gather: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
) -> Swap:
    """Fill the inference weights from the training shards and swap the training weights out.

    ``train_params``: this rank's Megatron parameters (a module or ``{name: tensor}``, stage-local names).
    ``infer``: the flat buffer from ``plan.allocate_inference()`` or its dict of views.
    ``groups``: ``{"tp": ..., "pp": ..., "ep": ...}`` torch.distributed process groups (None for size 1).
    On any error before the swap-out the training weights are untouched; an error during the swap-out
    restores the storages already freed. The error names the parameter or bucket.
    ``gather``: ``"all_gather"`` (one ``all_gather_single`` per bucket), ``"p2p"`` (the same exchange as
    pairwise ``isend``/``irecv`` straight into the gathered bucket, no send buffer), or ``"auto"``: p2p on
    gloo groups (gloo's all-gather stages through extra copies; p2p is 1.5-2.5x faster on CPU), the
    collective elsewhere (NCCL/HCCL).
    ``timeout``: seconds for the whole switch; every wait inside it gets the time that is left.
    """
    import torch

    t_start = time.perf_counter()
    target: list[Any] = []

    def check(params: dict[str, Any], rank: int) -> None:
        if plan._active is not None:
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
        settings=(bool(swap), bool(verify)),
        extra_check=check,
    )
    flat, views = target
    params, device, deadline = prep.params, prep.device, prep.deadline
    engine = engine or _default_engine()
    cur_stream = current_stream(device)
    buckets = plan.buckets(bucket_bytes)
    cplans = plan.native_plans(bucket_bytes, prep.infer_rank)

    # unique training storages (params may share a contiguous buffer)
    storages: list[tuple[str, Any, int, Any]] = []
    seen: set[int] = set()
    for n, p in params.items():
        st = p.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            storages.append((n, st, st.nbytes(), p.device))
    train_bytes = sum(s[2] for s in storages)
    meter = _Meter()
    meter.add(train_bytes)
    meter.add(flat.numel())
    scratch_nb = scratch_bytes(buckets, prep.modes)
    tele: dict[str, Any] = {
        "layout": plan.layout,
        "infer_rank": prep.infer_rank,
        "buckets": len(buckets),
        "train_bytes": train_bytes,
        "infer_bytes": int(flat.numel()),
        "descriptors": int(sum(len(c) for c in cplans if c is not None)),
        "gather": prep.modes["tp"] if plan.train.tp > 1 else prep.modes["ep"],
        "bucket_bytes": bucket_bytes,  # requested bytes per member and bucket
        "scratch_bytes": scratch_nb,  # the one-bucket gather scratch actually allocated
    }
    gatherer = Gatherer(prep, groups)
    t_copy = 0.0
    cur = None
    scratch = None
    try:
        scratch = torch.empty(scratch_nb, dtype=torch.uint8, device=device)
        meter.add(scratch_nb)
        for b, cp in zip(buckets, cplans):
            cur = b
            gathered = gatherer.gather(b, scratch)
            t1 = time.perf_counter()
            if cp is not None:
                # ordered after the gather/pack queued on the caller's current stream (GPU); host: no-op
                engine.execute(cp, flat, gathered, after=cur_stream).wait(deadline.left())
            t_copy += time.perf_counter() - t1
        cur = None
    except Exception as e:
        raise ReshardError(
            f"allgather_swap failed in {bucket_label(cur)}: {type(e).__name__}: {e}; "
            "training weights untouched"
        ) from e
    finally:
        del scratch
    meter.sub(scratch_nb)
    tele.update(
        bytes_gathered=gatherer.received,
        pack_s=gatherer.pack_s,
        gather_s=gatherer.exchange_s,
        copy_s=t_copy,
        my_buckets=sum(1 for b in buckets if b.stage == prep.stage),
    )
    tele["bytes_copied"] = int(sum(c.bytes for c in cplans if c is not None))

    crcs: dict[str, int] = {}
    if verify:
        ref = naive_reshard(params, plan, groups, prep.infer_rank)[0]
        for n, v in views.items():
            if n not in ref or not torch.equal(v, ref[n].to(v.device)):
                raise ReshardError(f"verify: inference tensor {n!r} differs from the reference reshard")
        crcs = {n: _crc(bytes_view(st, dev)) for n, st, _, dev in storages}
        tele["verified_infer"] = True

    mirrors = plan.mirrors
    if swap:
        pool = pool or _default_pool()
        t0 = time.perf_counter()
        done: list[tuple[str, Any, int, Any]] = []
        at = storages[0][0]
        try:
            for n, _, nbytes, _ in storages:
                at = n
                m = mirrors.get(n)
                if m is None or m.nbytes < nbytes:
                    m = mirrors[n] = pool.allocate(nbytes)
            t_copy0 = time.perf_counter()
            at = "(all storages, one batch)"
            # every storage in one job: one submission and one ticket, however many parameters
            engine.copy_many(
                [torch.frombuffer(mirrors[n], dtype=torch.uint8, count=nb) for n, _, nb, _ in storages],
                [bytes_view(st, dev) for _, st, _, dev in storages],
                kind="d2h",
                after=cur_stream,
            ).wait(deadline.left())
            t_copied = time.perf_counter()
            for n, st, nbytes, dev in storages:
                at = n
                st.resize_(0)
                done.append((n, st, nbytes, dev))
                meter.sub(nbytes)
        except Exception as e:
            for n, st, nbytes, dev in done:  # restore what was freed
                st.resize_(nbytes)
                engine.copy(
                    bytes_view(st, dev), torch.frombuffer(mirrors[n], dtype=torch.uint8, count=nbytes)
                ).wait(deadline.left())
            raise ReshardError(
                f"swap-out failed at parameter {at!r}: {type(e).__name__}: {e}; training weights restored"
            ) from e
        dt = time.perf_counter() - t0
        dc = t_copied - t_copy0
        tele.update(swap_out_s=dt, swap_out_gbps=train_bytes / dt / 1e9 if dt > 0 else float("inf"))
        # the device->host copies alone (swap_out_s adds mirror lookup and freeing the storages)
        tele.update(swap_out_copy_s=dc, swap_out_copy_gbps=train_bytes / dc / 1e9 if dc > 0 else float("inf"))
        tele["freed_bytes"] = sum(nb for _, st, nb, _ in storages if st.nbytes() == 0)
    else:
        tele["freed_bytes"] = 0
    tele["peak_bytes"] = meter.peak
    tele["final_bytes"] = meter.cur
    tele["total_s"] = time.perf_counter() - t_start
    if device.type == "cuda":
        tele["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    s = Swap(plan, storages, mirrors, engine, views, tele, verify, crcs)
    if swap:
        plan._active = s
    else:
        s._state = "back"
    return s


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
