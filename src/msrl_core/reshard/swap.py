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
from .plan import ReshardPlan, views_of
from .spec import canonical_megatron_name

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


def _group_size(g) -> int:
    import torch.distributed as dist

    return 1 if g is None else dist.get_world_size(group=g)


def _group_rank(g) -> int:
    import torch.distributed as dist

    return 0 if g is None else dist.get_rank(group=g)


def _all_gather_single(out, inp, group) -> None:
    import torch.distributed as dist

    # torch >= 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same semantics)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _current_stream(device) -> Any:
    """The caller's current stream on ``device`` (CUDA / Ascend), None on the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    if device.type == "npu":  # pragma: no cover - torch_npu
        return torch.npu.current_stream(device)  # type: ignore[attr-defined]
    return None


def _agree(ok: bool, groups: Mapping[str, Any], device) -> bool:
    """MIN-all-reduce of the local verdict over each distinct training group (a few bytes)."""
    import torch
    import torch.distributed as dist

    seen: list[Any] = []
    for key in ("tp", "pp", "ep"):
        g = groups.get(key)
        if g is None or any(g is x for x in seen):
            continue
        seen.append(g)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
        ok = bool(flag.item())
    return ok


def _gather_mode(gather: str, group) -> str:
    if gather not in ("auto", "all_gather", "p2p"):
        raise ReshardError(f"gather must be 'auto', 'all_gather' or 'p2p', got {gather!r}")
    if gather != "auto" or group is None:
        return "all_gather" if gather == "auto" else gather
    import torch.distributed as dist

    return "p2p" if str(dist.get_backend(group)) == "gloo" else "all_gather"


def _exchange(gathered, local_bytes: int, me: int, members: int, group) -> None:
    """All-gather as pairwise exchange: send my slot to every peer, receive each peer's slot in place."""
    import torch.distributed as dist

    mine = gathered[me * local_bytes : (me + 1) * local_bytes]
    ops = []
    for k in range(1, members):  # staggered order so every pair posts matching operations
        to, frm = (me + k) % members, (me - k) % members
        ops.append(dist.P2POp(dist.isend, mine, dist.get_global_rank(group, to), group))
        slot = gathered[frm * local_bytes : (frm + 1) * local_bytes]
        ops.append(dist.P2POp(dist.irecv, slot, dist.get_global_rank(group, frm), group))
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _normalize_params(train_params) -> dict[str, Any]:
    items = (
        train_params.named_parameters() if hasattr(train_params, "named_parameters") else train_params.items()
    )
    out: dict[str, Any] = {}
    for name, p in items:
        n = name
        while n.startswith("module."):
            n = n[len("module.") :]
        out[canonical_megatron_name(n)] = p
    return out


def _bytes_view(storage, device):
    import torch

    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


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
            stream = _current_stream(self._storages[0][3])
        self._t0 = time.perf_counter()
        name = "(none)"
        try:
            dsts, srcs = [], []
            for name, st, nbytes, device in self._storages:
                st.resize_(nbytes)
                dsts.append(_bytes_view(st, device))
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
                if _crc(_bytes_view(st, device)) != self._crcs[name]:
                    raise ReshardError(f"verify: training storage of {name!r} differs after swap back")
            self.telemetry["verified_swap"] = True


def _check_groups(plan: ReshardPlan, groups: Mapping[str, Any]) -> None:
    tr = plan.train
    for key, want in (("tp", tr.tp), ("pp", tr.pp), ("ep", tr.ep)):
        g = groups.get(key)
        if g is None and want > 1:
            raise ReshardError(f"groups[{key!r}] is missing; the plan needs a {key} group of size {want}")
        have = _group_size(g)
        if have != want:
            raise ReshardError(f"groups[{key!r}] has size {have}, the plan's training {key} is {want}")


def _check_params(plan: ReshardPlan, params: dict[str, Any], stage: int) -> None:
    import torch

    want = plan.train_shapes(stage)
    missing = [n for n in want if n not in params]
    extra = [n for n in params if n not in want]
    if missing:
        raise ReshardError(
            f"missing training parameter {missing[0]!r} (stage {stage}; {len(missing)} missing)"
        )
    if extra:
        raise ReshardError(
            f"unexpected training parameter {extra[0]!r} (stage {stage}); not in the {plan.cfg.arch} layout"
        )
    dt = getattr(torch, plan.cfg.dtype)
    for n, shape in want.items():
        p = params[n]
        if tuple(p.shape) != tuple(shape):
            raise ReshardError(
                f"training parameter {n!r} has shape {tuple(p.shape)}, the layout expects {tuple(shape)}"
            )
        if p.dtype != dt:
            raise ReshardError(f"training parameter {n!r} has dtype {p.dtype}, the plan expects {dt}")
        if p.untyped_storage().nbytes() == 0:
            raise SwapStateError(
                f"training parameter {n!r} has no storage: a previous allgather_swap was not swapped back"
            )
        if not p.is_contiguous():
            raise ReshardError(f"training parameter {n!r} is not contiguous")


def _infer_flat(plan: ReshardPlan, infer: Any, infer_rank: int):
    import torch

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
        return _bytes_view(st, t0.device), dict(infer)
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
    """
    import torch
    import torch.distributed as dist

    if plan._active is not None:
        raise SwapStateError(
            "a previous allgather_swap on this plan was not swapped back; call swap_back() and wait()"
        )
    t_start = time.perf_counter()
    _check_groups(plan, groups)  # a wrong group is rejected here, before it is used for anything
    params = _normalize_params(train_params)
    local_error: Exception | None = None
    try:
        stage = _group_rank(groups.get("pp"))
        _check_params(plan, params, stage)
        if infer_rank is None:
            infer_rank = (dist.get_rank() if dist.is_initialized() else 0) % plan.infer.tp
        flat, views = _infer_flat(plan, infer, infer_rank)
        modes = {k: _gather_mode(gather, groups.get(k)) for k in ("tp", "ep")}
        buckets = plan.buckets(bucket_bytes)
        cplans = plan.native_plans(bucket_bytes, infer_rank)
    except Exception as e:
        local_error = e
    # every rank of the groups agrees before the first collective: one rank's bad input must not leave the
    # others blocked in an all-gather
    device = next(iter(params.values())).device if params else torch.device("cpu")
    if not _agree(local_error is None, groups, device):
        if local_error is not None:
            raise local_error
        raise ReshardError(
            "another rank of the training groups rejected this switch (see its error); nothing was done here"
        )
    if local_error is not None:
        raise local_error
    assert infer_rank is not None
    engine = engine or _default_engine()
    cur_stream = _current_stream(device)

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
    tele: dict[str, Any] = {
        "layout": plan.layout,
        "infer_rank": infer_rank,
        "buckets": len(buckets),
        "train_bytes": train_bytes,
        "infer_bytes": int(flat.numel()),
        "descriptors": int(sum(len(c) for c in cplans if c is not None)),
    }
    my_buckets = [b for b in buckets if b.stage == stage]
    tele["gather"] = modes["tp"] if plan.train.tp > 1 else modes["ep"]
    scratch_bytes = max(
        (b.gathered_bytes + (b.local_bytes if b.members > 1 and modes[b.group] == "all_gather" else 0))
        for b in buckets
    )
    tele["bucket_bytes"] = bucket_bytes  # requested bytes per member and bucket
    tele["scratch_bytes"] = scratch_bytes  # the one-bucket gather scratch actually allocated
    pp_group = groups.get("pp")
    t_gather = t_copy = t_pack = 0.0
    gathered_total = 0
    cur = None
    scratch = send = None
    try:
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)
        meter.add(scratch_bytes)
        for b, cp in zip(buckets, cplans):
            cur = b
            gb = b.gathered_bytes
            t0 = time.perf_counter()
            if b.stage == stage:
                gathered = scratch[:gb]
                g = groups.get(b.group)
                me = _group_rank(g)
                if b.members > 1 and modes[b.group] == "all_gather":
                    send = scratch[gb : gb + b.local_bytes]
                else:  # p2p (or a group of one): pack straight into this member's slot of the gathered bucket
                    send = scratch[me * b.local_bytes : (me + 1) * b.local_bytes]
                dst_views = [
                    send[off : off + nb].view(params[name].dtype) for name, _, off, nb, _, _ in b.params
                ]
                srcs = [
                    params[name].view(shape[0], -1)[r0:r1].reshape(-1)
                    for name, shape, _, _, r0, r1 in b.params
                ]
                torch._foreach_copy_(dst_views, srcs)
                t_pack += time.perf_counter() - t0
                if b.members > 1:
                    if modes[b.group] == "all_gather":
                        _all_gather_single(gathered, send, group=g)
                    else:
                        _exchange(gathered, b.local_bytes, me, b.members, g)
                    gathered_total += gb - b.local_bytes
            else:
                gathered = scratch[:gb]
            if pp_group is not None:
                dist.broadcast(gathered, src=dist.get_global_rank(pp_group, b.stage), group=pp_group)
                if b.stage != stage:
                    gathered_total += gb
            t1 = time.perf_counter()
            if cp is not None:
                # ordered after the gather/pack queued on the caller's current stream (GPU); host: no-op
                engine.execute(cp, flat, scratch, after=cur_stream).wait(60.0)
            t_copy += time.perf_counter() - t1
            t_gather += t1 - t0
        cur = None
    except Exception as e:
        what = (
            f"bucket {cur.index} (stage {cur.stage}, params {', '.join(cur.names[:4])}"
            + ("...)" if len(cur.names) > 4 else ")")
            if cur
            else "setup"
        )
        raise ReshardError(
            f"allgather_swap failed in {what}: {type(e).__name__}: {e}; training weights untouched"
        ) from e
    finally:
        del scratch, send
    meter.sub(scratch_bytes)
    tele.update(
        bytes_gathered=gathered_total,
        pack_s=t_pack,
        gather_s=t_gather - t_pack,
        copy_s=t_copy,
        my_buckets=len(my_buckets),
    )
    tele["bytes_copied"] = int(sum(c.bytes for c in cplans if c is not None))

    crcs: dict[str, int] = {}
    if verify:
        ref = naive_reshard(params, plan, groups, infer_rank)[0]
        for n, v in views.items():
            if n not in ref or not torch.equal(v, ref[n].to(v.device)):
                raise ReshardError(f"verify: inference tensor {n!r} differs from the reference reshard")
        crcs = {n: _crc(_bytes_view(st, dev)) for n, st, _, dev in storages}
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
                [_bytes_view(st, dev) for _, st, _, dev in storages],
                kind="d2h",
                after=cur_stream,
            ).wait(60.0)
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
                    _bytes_view(st, dev), torch.frombuffer(mirrors[n], dtype=torch.uint8, count=nbytes)
                ).wait(60.0)
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

    params = _normalize_params(train_params)
    tr = plan.train
    stage = _group_rank(groups.get("pp"))
    tp_rank, ep_rank = _group_rank(groups.get("tp")), _group_rank(groups.get("ep"))
    shards: dict[tuple[int, int, int], dict[str, Any]] = {}
    for s in range(tr.pp):
        for name, shape, grp in plan.stage_params[s]:
            if s == stage:
                p = params[name]
                g = groups.get(grp)
                n = _group_size(g)
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
