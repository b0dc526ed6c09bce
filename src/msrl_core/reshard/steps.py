"""The steps every switch shares (allgather-swap and the streamed buckets): normalise and check the training
parameters, agree on the verdict and the settings across the training groups, and gather one bucket.

Rule: no rank raises before the agreement. Every local check runs inside :func:`prepare`, whose verdict
and settings fingerprint go through one small all-reduce per distinct training group, so one rank's bad input
(or different ``bucket_bytes`` / ``gather`` / ``verify``) raises a clear error on every rank instead of
leaving the others blocked in a collective.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from msrl_core.copy import current_stream  # noqa: F401  (the caller's stream for after=; used by the switch)

from .errors import ReshardError, SwapStateError, SwitchAborted, SwitchTimeout
from .plan import Bucket, ReshardPlan, rebase_onto_params
from .spec import canonical_megatron_name

DEFAULT_TIMEOUT = 300.0
#: gathered bytes between two status agreements of a switch (one per bucket when buckets are this large)
AGREE_BYTES = 16 << 20


def group_size(g) -> int:
    import torch.distributed as dist

    return 1 if g is None else dist.get_world_size(group=g)


def group_rank(g) -> int:
    import torch.distributed as dist

    return 0 if g is None else dist.get_rank(group=g)


def bytes_view(storage, device):
    """A flat uint8 tensor over a whole untyped storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class Deadline:
    """One ``timeout`` for a whole switch: every wait inside it gets the time that is left."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ReshardError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.end = time.monotonic() + self.timeout

    def left(self) -> float:
        return max(0.001, self.end - time.monotonic())


def training_groups(groups: Mapping[str, Any]) -> list[Any]:
    """The distinct non-None groups among tp, pp, ep (the ranks that walk one switch together)."""
    seen: list[Any] = []
    for key in ("tp", "pp", "ep"):
        g = groups.get(key)
        if g is not None and not any(g is x for x in seen):
            seen.append(g)
    return seen


def agree(
    ok: bool, groups: Mapping[str, Any], device, fingerprint: int = 0, deadline: Deadline | None = None
) -> tuple[bool, bool]:
    """MIN-all-reduce of the local verdict and MIN/MAX of a settings fingerprint over every distinct training
    group (one small all-reduce per group; sequential over the groups, so a verdict reaches every rank of
    the TP x PP x EP grid). Returns ``(all ok, all fingerprints equal)``."""
    ok, same, _ = agree_values(ok, groups, device, fingerprint, 0, deadline)
    return ok, same


def agree_values(
    ok: bool, groups: Mapping[str, Any], device, fingerprint: int, propose: int, deadline: Deadline | None
) -> tuple[bool, bool, int]:
    """:func:`agree`, plus the minimum over the ranks of ``propose`` (in the same all-reduce)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor(
        [1 if ok else 0, fingerprint, -fingerprint, propose], dtype=torch.int64, device=device
    )
    for g in training_groups(groups):
        _collective(partial(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=g, async_op=True), deadline)
    lo, hi = int(flag[1]), -int(flag[2])
    return bool(flag[0].item()), lo == hi == fingerprint, int(flag[3])


def auto_bucket_bytes(device: Any, members: int) -> int:
    """``bucket_bytes="auto"``: 1/16 of the free memory of ``device`` (CUDA: ``mem_get_info``; host:
    ``MemAvailable``) over the gather group's members, in whole MiB within [1, 256] MiB. A pipelined switch
    (two scratches) then takes at most 1/8 of what was free."""
    import torch

    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
    else:
        free = 1 << 30
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
        except OSError:
            pass
    b = free // 16 // max(1, members)
    return int(min(256 << 20, max(1 << 20, b)) >> 20 << 20)


def fingerprint(*settings: Any) -> int:
    return zlib.crc32(repr(settings).encode())


def gather_mode(gather: str, group) -> str:
    if gather not in ("auto", "all_gather", "p2p"):
        raise ReshardError(f"gather must be 'auto', 'all_gather' or 'p2p', got {gather!r}")
    if gather != "auto" or group is None:
        return "all_gather" if gather == "auto" else gather
    import torch.distributed as dist

    return "p2p" if str(dist.get_backend(group)) == "gloo" else "all_gather"


def normalize_params(train_params) -> dict[str, Any]:
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


def check_groups(plan: ReshardPlan, groups: Mapping[str, Any]) -> None:
    tr = plan.train
    for key, want in (("tp", tr.tp), ("pp", tr.pp), ("ep", tr.ep)):
        g = groups.get(key)
        if g is None and want > 1:
            raise ReshardError(f"groups[{key!r}] is missing; the plan needs a {key} group of size {want}")
        have = group_size(g)
        if have != want:
            raise ReshardError(f"groups[{key!r}] has size {have}, the plan's training {key} is {want}")


def check_params(plan: ReshardPlan, params: dict[str, Any], stage: int) -> None:
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


@dataclass(frozen=True)
class Prepared:
    """The validated, agreed inputs of one switch."""

    params: dict[str, Any]
    stage: int
    infer_rank: int
    modes: dict[str, str]  # gather mode per group key ("tp", "ep")
    device: Any
    deadline: Deadline
    bucket_bytes: int  # as passed, or the agreed minimum of the ranks' "auto" choices


def prepare(
    what: str,
    train_params: Any,
    plan: ReshardPlan,
    groups: Mapping[str, Any],
    *,
    infer_rank: int | None,
    bucket_bytes: int | str,
    gather: str,
    timeout: float,
    settings: tuple = (),
    extra_check: Callable[[dict[str, Any], int], None] | None = None,
) -> Prepared:
    """Run every local check, then agree on the verdict and the settings across the training groups.

    ``settings`` are values every rank must pass alike (they enter the fingerprint with the plan, the
    bucket size and the gather mode); ``bucket_bytes="auto"``: every rank proposes
    :func:`auto_bucket_bytes` and the smallest proposal is used; ``extra_check(params, infer_rank)`` adds
    caller-specific checks. On disagreement every rank raises: the rank with the bad input its own error,
    the others a ``ReshardError`` saying another rank rejected the switch."""
    import torch
    import torch.distributed as dist

    local_error: Exception | None = None
    params: dict[str, Any] = {}
    stage = 0
    modes: dict[str, str] = {}
    deadline = None
    try:
        params = normalize_params(train_params)
        deadline = Deadline(timeout)
        check_groups(plan, groups)
        if bucket_bytes != "auto" and (
            not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0
        ):
            raise ReshardError(f"bucket_bytes must be a positive int or 'auto', got {bucket_bytes!r}")
        stage = group_rank(groups.get("pp"))
        check_params(plan, params, stage)
        if infer_rank is None:
            infer_rank = (dist.get_rank() if dist.is_initialized() else 0) % plan.infer.tp
        if not isinstance(infer_rank, int) or not 0 <= infer_rank < plan.infer.tp:
            raise ReshardError(f"infer_rank must be in [0, {plan.infer.tp}), got {infer_rank!r}")
        modes = {k: gather_mode(gather, groups.get(k)) for k in ("tp", "ep")}
        if extra_check is not None:
            extra_check(params, infer_rank)
    except Exception as e:
        local_error = e
    device = next(iter(params.values())).device if params else torch.device("cpu")
    fp = fingerprint(what, repr(plan), bucket_bytes, gather, settings)
    propose = 0
    if bucket_bytes == "auto":
        propose = auto_bucket_bytes(device, max(plan.train.tp, plan.train.ep))
    try:
        ok, same, chosen = agree_values(local_error is None, groups, device, fp, propose, deadline)
    except SwitchAborted:
        raise
    except Exception as e:  # the group itself is unusable (wrong object, destroyed, ...)
        raise ReshardError(f"{what}: the agreement all-reduce over the training groups failed: {e}") from (
            local_error or e
        )
    if local_error is not None:
        raise local_error
    if not ok:
        raise ReshardError(
            f"another rank of the training groups rejected this {what} (see its error); nothing was done here"
        )
    if not same:
        raise ReshardError(
            f"{what}: the ranks of the training groups passed different settings (plan, bucket_bytes, "
            f"gather or verify must be equal on every rank); here: plan={plan!r}, "
            f"bucket_bytes={bucket_bytes}, gather={gather!r}, settings={settings!r}"
        )
    assert infer_rank is not None and deadline is not None
    size = chosen if bucket_bytes == "auto" else bucket_bytes
    assert isinstance(size, int)
    return Prepared(params, stage, infer_rank, modes, device, deadline, size)


def _collective(start: Callable[[], Any], deadline: Deadline | None) -> None:
    """Start an async collective and wait for it within the switch's deadline: a hang becomes
    :class:`SwitchTimeout`, any other failure of the collective (a peer died) :class:`SwitchAborted`."""
    from datetime import timedelta

    try:
        work = start()
        if deadline is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=deadline.left()))
    except Exception as e:
        text = str(e).lower()
        if deadline is not None and (deadline.left() <= 0.001 or "timed out" in text or "timeout" in text):
            raise SwitchTimeout(
                f"a collective of the switch did not finish within the timeout ({deadline.timeout:g} s): "
                f"{e}; the process group may be unusable now"
            ) from e
        raise SwitchAborted(
            f"a collective of the switch failed ({type(e).__name__}: {e}); a peer may have died"
        ) from e


def _same(x: Any) -> Any:
    return x


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def _all_gather_single(out, inp, group, deadline: Deadline | None) -> None:
    import torch.distributed as dist

    # torch >= 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same semantics)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _collective(lambda: fn(out, inp, group=group, async_op=True), deadline)


def _exchange(gathered, local_bytes: int, me: int, members: int, group, deadline: Deadline | None) -> None:
    """All-gather as pairwise exchange: send my slot to every peer, receive each peer's slot in place."""
    import torch.distributed as dist

    mine = gathered[me * local_bytes : (me + 1) * local_bytes]
    ops = []
    for k in range(1, members):  # staggered order so every pair posts matching operations
        to, frm = (me + k) % members, (me - k) % members
        ops.append(dist.P2POp(dist.isend, mine, dist.get_global_rank(group, to), group))
        slot = gathered[frm * local_bytes : (frm + 1) * local_bytes]
        ops.append(dist.P2POp(dist.irecv, slot, dist.get_global_rank(group, frm), group))
    _run_p2p(ops, deadline)


def _run_p2p(ops: list[Any], deadline: Deadline | None) -> None:
    """Post a batch of point-to-point operations and wait for each within the deadline."""
    import torch.distributed as dist

    works: list[Any] = []

    def start() -> Any:
        works.extend(dist.batch_isend_irecv(ops))
        return _Done()

    _collective(start, deadline)
    for w in works:
        _collective(partial(_same, w), deadline)


def scratch_bytes(buckets: list[Bucket], modes: Mapping[str, str]) -> int:
    """The one-bucket gather scratch: the largest gathered bucket (+ a send buffer on the collective path)."""
    return max(
        (b.gathered_bytes + (b.local_bytes if b.members > 1 and modes[b.group] == "all_gather" else 0))
        for b in buckets
    )


class Gatherer:
    """Gathers buckets into a caller-owned scratch: pack the local shards, exchange over the bucket's group,
    broadcast over the PP group. Counts the bytes received and the time per phase.

    A local failure (the pack) does not skip the collectives: the rank still takes its part in them (with
    whatever its slot holds), so no peer is left waiting, and the error is returned for the ranks'
    per-bucket agreement. ``fail`` is a test hook: ``fail(bucket)`` runs before the pack (the switch also
    calls ``fail(None)`` after allocating its scratch).

    The pack: on an accelerator one ``torch._foreach_copy_`` on the current stream (ordered before the
    collective that reads it); on a CPU device, with ``engine``, one ``copy_many`` batch (``after`` the
    caller's stream) on the copy engine's own threads. torch's intra-op pool would split every bucket over
    threads that the rest of the process (and the other ranks on the node) keep busy: a 1 MiB bucket took
    4-7 ms in the e2e bench on the loaded 2-core machine, 10-20x a single thread's memcpy."""

    def __init__(
        self,
        prep: Prepared,
        groups: Mapping[str, Any],
        fail: Callable[[Bucket], None] | None = None,
        engine: Any = None,
        after: Any = None,
    ):
        self.prep, self.groups, self.fail = prep, groups, fail
        self.engine = engine if prep.device.type == "cpu" else None
        self.after = after  # the caller's stream: the engine's pack is ordered after it, like every copy
        self.pp_group = groups.get("pp")
        self.received = 0
        self.pack_s = self.exchange_s = 0.0

    def gather(self, b: Bucket, scratch, deadline: Deadline | None = None) -> tuple[Any, Exception | None]:
        """Fill ``scratch[:b.gathered_bytes]`` with bucket ``b`` gathered over its group; returns the view
        and the local error of the pack (None when it worked)."""
        import torch
        import torch.distributed as dist

        prep, gb = self.prep, b.gathered_bytes
        gathered = scratch[:gb]
        error: Exception | None = None
        t0 = time.perf_counter()
        if b.stage == prep.stage:
            g = self.groups.get(b.group)
            me = group_rank(g)
            collective = b.members > 1 and prep.modes[b.group] == "all_gather"
            # p2p (or a group of one): pack straight into this member's slot of the gathered bucket
            send = scratch[gb : gb + b.local_bytes] if collective else gathered[me * b.local_bytes :]
            try:
                if self.fail is not None:
                    self.fail(b)  # test hook: a failure injected at this bucket
                params = prep.params
                dst_views = [
                    send[off : off + nb].view(params[name].dtype) for name, _, off, nb, _, _ in b.params
                ]
                srcs = [
                    params[name].view(shape[0], -1)[r0:r1].reshape(-1)
                    for name, shape, _, _, r0, r1 in b.params
                ]
                if self.engine is not None:
                    self.engine.copy_many(dst_views, srcs, after=self.after).wait(
                        DEFAULT_TIMEOUT if deadline is None else deadline.left()
                    )
                else:
                    torch._foreach_copy_(dst_views, srcs)
            except Exception as e:
                error = e
            t1 = time.perf_counter()
            self.pack_s += t1 - t0
            t0 = t1
            if b.members > 1:
                if collective:
                    _all_gather_single(gathered, send[: b.local_bytes], g, deadline)
                else:
                    _exchange(gathered, b.local_bytes, me, b.members, g, deadline)
                self.received += gb - b.local_bytes
        if self.pp_group is not None:
            src = dist.get_global_rank(self.pp_group, b.stage)
            _collective(
                lambda: dist.broadcast(gathered, src=src, group=self.pp_group, async_op=True), deadline
            )
            if b.stage != prep.stage:
                self.received += gb
        self.exchange_s += time.perf_counter() - t0
        return gathered, error

    def exchange_params(
        self, b: Bucket, scratch, own: bool, deadline: Deadline | None = None
    ) -> tuple[Any, Exception | None]:
        """Bucket ``b`` exchanged point to point over its group (PP 1) without a pack for the peers: every
        peer receives this rank's row chunks straight from the parameters, one message per chunk, into its
        slot for this rank. Every rank of the group calls this for the same buckets (the messages match
        chunk by chunk). ``own``: this rank reads its own slot, so it is kept and packed locally; otherwise
        the slots are compacted (member ``m`` > this rank at slot ``m - 1``) and this rank's is not
        allocated: ``(members - 1) * local_bytes`` of scratch. Returns the gathered view and the local
        error (the rank still takes its part in the exchange, sending whatever its buffer holds)."""
        import torch
        import torch.distributed as dist

        prep, lb, members = self.prep, b.local_bytes, b.members
        g = self.groups.get(b.group)
        assert g is not None, f"bucket {b.index}: no {b.group} group for an exchange of {members} members"
        me = group_rank(g)
        gathered = scratch[: (members if own else members - 1) * lb]

        def at(m: int) -> int:
            return (m if own or m < me else m - 1) * lb

        error: Exception | None = None
        chunks: list[Any] | None = None
        t0 = time.perf_counter()
        try:
            if self.fail is not None:
                self.fail(b)
            params = prep.params
            chunks = [
                params[name].detach().view(shape[0], -1)[r0:r1].reshape(-1).view(torch.uint8)
                for name, shape, _, _, r0, r1 in b.params
            ]
            if own:
                mine = gathered[me * lb : (me + 1) * lb]
                dsts = [mine[off : off + nb] for _, _, off, nb, _, _ in b.params]
                if self.engine is not None:
                    self.engine.copy_many(dsts, chunks, after=self.after).wait(
                        DEFAULT_TIMEOUT if deadline is None else deadline.left()
                    )
                else:
                    torch._foreach_copy_(dsts, chunks)
        except Exception as e:
            error, chunks = e, None
        t1 = time.perf_counter()
        self.pack_s += t1 - t0
        ops = []
        for k in range(1, members):  # staggered order so every pair posts matching operations
            to, frm = (me + k) % members, (me - k) % members
            for i, (_, _, off, nb, _, _) in enumerate(b.params):
                # after a local failure: a buffer of the right size (the ranks' agreement then aborts)
                src = chunks[i] if chunks is not None else gathered[at(frm) + off : at(frm) + off + nb]
                ops.append(dist.P2POp(dist.isend, src, dist.get_global_rank(g, to), g))
            for _, _, off, nb, _, _ in b.params:
                slot = gathered[at(frm) + off : at(frm) + off + nb]
                ops.append(dist.P2POp(dist.irecv, slot, dist.get_global_rank(g, frm), g))
        _run_p2p(ops, deadline)
        self.received += (members - 1) * lb
        self.exchange_s += time.perf_counter() - t1
        return gathered, error


def nothing_to_gather(plan: ReshardPlan) -> bool:
    """Training TP, EP and PP are all 1: every bucket is this rank's own shards, nothing crosses ranks."""
    tr = plan.train
    return tr.tp == 1 and tr.ep == 1 and tr.pp == 1


def direct_descriptors(plan: ReshardPlan, bucket_bytes: int, infer_rank: int) -> dict[str, Any]:
    """With :func:`nothing_to_gather`, per training parameter the copy descriptors of the plan's buckets
    rebased from the packed bucket onto the parameter's own bytes: the fused copy then reads the training
    tensors directly (no pack into a scratch, no scratch). Same descriptors, same bytes copied."""
    import numpy as np

    if not nothing_to_gather(plan):
        raise ReshardError(f"direct copies need training TP, EP and PP 1; the plan trains with {plan.train}")
    out: dict[str, list[Any]] = {}
    for b, d in zip(plan.buckets(bucket_bytes), plan.bucket_descriptors(bucket_bytes, infer_rank)):
        for name, sel in rebase_onto_params(b, d).items():
            out.setdefault(name, []).append(sel)
    return {n: np.concatenate(v) for n, v in out.items()}


def bucket_label(b: Bucket | None) -> str:
    if b is None:
        return "setup"
    names = ", ".join(b.names[:4]) + ("..." if len(b.names) > 4 else "")
    return f"bucket {b.index} (stage {b.stage}, params {names})"
