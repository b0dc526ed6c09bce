"""The bucketed reshard plan: which training parameters go into which gather bucket, where every inference
tensor lives in the flat inference buffer, and per bucket one fused strided copy plan (descriptor array)
from the gathered bucket into the inference buffer.

Gathered bucket layout (what ``all_gather_into_tensor`` produces over the bucket's group):
``[member 0: p_a | p_b | ... | member 1: p_a | p_b | ... ]``, every parameter at a 64-byte aligned offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ReshardError
from .layout import HFTensor, ModelConfig, Parallel, Target
from .spec import (
    check_infer,
    check_train,
    hf_targets,
    hf_tensors,
    megatron_stage_params,
    megatron_targets,
    vllm_targets,
)

__all__ = [
    "Bucket",
    "ReshardPlan",
    "StreamBucket",
    "execute_numpy",
    "megatron_to_vllm",
    "rebase_onto_params",
    "to_hf",
]

ALIGN = 64
INFER_RANK_ATTR = (
    "msrl_infer_rank"  # set on the buffer and views of allocate_inference(r): the rank they are for
)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Bucket:
    index: int
    stage: int
    group: str  # "tp" | "ep"
    members: int
    # (name, local shape, byte offset, nbytes, first row, end row): a row chunk of a parameter
    params: list[tuple[str, tuple[int, ...], int, int, int, int]] = field(default_factory=list)
    local_bytes: int = 0

    @property
    def gathered_bytes(self) -> int:
        return self.members * self.local_bytes

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(p[0] for p in self.params))


@dataclass(frozen=True)
class StreamBucket:
    """One bucket of :func:`~msrl_core.reshard.stream_buckets`: the gather buckets it consumes and the named
    inference tensors it yields, laid out from byte 0 of the stream's output scratch.

    ``tensors``: ``(name, byte offset, shape)``; ``zero``: ``(byte offset, nbytes)`` of tensors the copies do
    not cover completely (vLLM's zero vocab-padding rows), cleared before the copies since the scratch is
    reused; ``nbytes``: the output bytes of this bucket; ``inplace``: ``(name, shape)`` of the tensors that
    are yielded as views of this rank's own training parameters (no copy; see
    :meth:`ReshardPlan.inplace_targets`); ``gathered``: ``(name, byte offset, shape)`` of tensors that are
    one contiguous range of the bucket's last gathered bucket, yielded as views of the gather scratch.
    Both are empty unless the schedule was built with ``inplace``."""

    gather: tuple[int, ...]
    tensors: tuple[tuple[str, int, tuple[int, ...]], ...]
    zero: tuple[tuple[int, int], ...]
    nbytes: int
    inplace: tuple[tuple[str, tuple[int, ...]], ...] = ()
    gathered: tuple[tuple[str, int, tuple[int, ...]], ...] = ()


class ReshardPlan:
    """Megatron (``train``) -> inference (``infer``) layout, ``layout`` = ``"vllm"`` or ``"hf"``.

    Immutable metadata: rank-independent until :meth:`bucket_descriptors` picks an inference rank;
    descriptor arrays and native copy plans are built once per ``(bucket_bytes, infer_rank)`` and memoised
    (pure functions of the plan). What a switch leaves behind (pinned mirrors, the swap not yet swapped
    back) lives in a :class:`~msrl_core.reshard.Switcher`.
    """

    def __init__(self, cfg: ModelConfig, train: Parallel, infer: Parallel, layout: str) -> None:
        if layout not in ("vllm", "hf"):
            raise ReshardError(f"layout must be 'vllm' or 'hf', got {layout!r}")
        check_train(cfg, train)
        check_infer(cfg, infer)
        self.cfg, self.train, self.infer, self.layout = cfg, train, infer, layout
        self.itemsize = cfg.itemsize
        self.hf: dict[str, HFTensor] = hf_tensors(cfg, train)
        self.stage_params = [megatron_stage_params(cfg, train, s) for s in range(train.pp)]
        self._targets: dict[int, list[Target]] = {}
        self._buckets: dict[int, list[Bucket]] = {}
        self._descs: dict[tuple[int, int], list[np.ndarray]] = {}
        self._native: dict[tuple[Any, ...], list[Any]] = {}
        self._stream: dict[tuple[Any, ...], tuple[list[StreamBucket], list[np.ndarray]]] = {}
        self._inplace: dict[tuple[int, int, int, int], dict[str, tuple[str, int]]] = {}
        self._needed: dict[int, frozenset[int]] = {}
        self._hf_plan: ReshardPlan | None = None
        self._reverse: dict[tuple[int, int, int], list[Target]] = {}
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False) and not name.startswith("_"):
            raise AttributeError(
                f"ReshardPlan is immutable (setting {name!r}); build a new plan, or keep switch state in a "
                "Switcher"
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"ReshardPlan({self.cfg.arch}, train={self.train}, infer={self.infer}, layout={self.layout!r})"

    def hf_plan(self) -> ReshardPlan:
        """The plan of this model and training layout into the HF checkpoint layout (this one if it is)."""
        if self.layout == "hf":
            return self
        if self._hf_plan is None:
            self._hf_plan = ReshardPlan(self.cfg, self.train, Parallel(tp=1), "hf")
        return self._hf_plan

    # -- parameters ------------------------------------------------------------------------------
    def train_shapes(self, stage: int) -> dict[str, tuple[int, ...]]:
        return {n: s for n, s, _ in self.stage_params[stage]}

    def train_bytes(self, stage: int) -> int:
        return sum(int(np.prod(s)) * self.itemsize for _, s, _ in self.stage_params[stage])

    def megatron_targets(self, stage: int, tp_rank: int = 0, ep_rank: int = 0) -> list[Target]:
        """The plan run in reverse: this training rank's Megatron parameters (stage-local names, local shapes)
        as targets built from pieces of the HF checkpoint tensors (see ``spec.megatron_targets``). What
        :func:`msrl_core.models.load_hf_checkpoint` reads from a checkpoint; the same rules as the forward."""
        key = (stage, tp_rank, ep_rank)
        if key not in self._reverse:
            self._reverse[key] = megatron_targets(self.cfg, self.train, self.hf, stage, tp_rank, ep_rank)
        return self._reverse[key]

    # -- inference side --------------------------------------------------------------------------
    def targets(self, infer_rank: int = 0) -> list[Target]:
        if infer_rank not in self._targets:
            if self.layout == "hf":
                self._targets[infer_rank] = hf_targets(self.cfg, self.hf)
            else:
                self._targets[infer_rank] = vllm_targets(self.cfg, self.hf, self.infer, infer_rank)
        return self._targets[infer_rank]

    def name_map(self, infer_rank: int = 0) -> dict[str, list[tuple[str, int, str]]]:
        """Inference tensor -> ``[(HF name, PP stage, stage-local Megatron name), ...]`` it is built from."""
        out: dict[str, list[tuple[str, int, str]]] = {}
        for t in self.targets(infer_rank):
            srcs = out.setdefault(t.name, [])
            for pc in t.pieces:
                src = self.hf[pc.hf].src
                item = (pc.hf, src.stage, src.param)
                if item not in srcs:
                    srcs.append(item)
        return out

    def infer_layout(self, infer_rank: int = 0) -> tuple[dict[str, tuple[int, tuple[int, ...]]], int]:
        """``{name: (byte offset, shape)}`` in the flat inference buffer, and its total bytes."""
        off, out = 0, {}
        for t in self.targets(infer_rank):
            out[t.name] = (off, t.shape)
            off = _align(off + t.numel * self.itemsize)
        return out, off

    def allocate_inference(self, infer_rank: int = 0, device: Any = "cpu") -> tuple[Any, dict[str, Any]]:
        """A zeroed flat buffer and the named views into it (what an engine would alias). Both carry
        ``infer_rank`` (attribute ``msrl_infer_rank``): a switch for another rank refuses them."""
        import torch

        layout, total = self.infer_layout(infer_rank)
        flat = torch.zeros(total, dtype=torch.uint8, device=device)
        views = views_of(flat, layout, _torch_dtype(self.cfg.dtype))
        for t in (flat, *views.values()):
            setattr(t, INFER_RANK_ATTR, infer_rank)
        return flat, views

    # -- buckets ---------------------------------------------------------------------------------
    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """All buckets of all stages in the global order every rank walks (stage-major). A parameter larger
        than ``bucket_bytes`` is split into row chunks, so the gather scratch stays ``members * bucket_bytes``
        (a single row larger than the bucket is the only exception)."""
        if bucket_bytes <= 0:
            raise ReshardError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if bucket_bytes in self._buckets:
            return self._buckets[bucket_bytes]
        sizes = {"tp": self.train.tp, "ep": self.train.ep}
        out: list[Bucket] = []
        for s, params in enumerate(self.stage_params):
            for g in ("tp", "ep"):
                cur: Bucket | None = None
                for name, shape, grp in params:
                    if grp != g:
                        continue
                    rows = shape[0]
                    row_bytes = int(np.prod(shape[1:])) * self.itemsize
                    step = max(1, bucket_bytes // row_bytes)
                    for r0 in range(0, rows, step):
                        r1 = min(rows, r0 + step)
                        nb = (r1 - r0) * row_bytes
                        if cur is None or (cur.params and cur.local_bytes + nb > bucket_bytes):
                            cur = Bucket(len(out), s, g, sizes[g])
                            out.append(cur)
                        cur.params.append((name, shape, cur.local_bytes, nb, r0, r1))
                        cur.local_bytes = _align(cur.local_bytes + nb)
        self._buckets[bucket_bytes] = out
        return out

    # -- descriptors -----------------------------------------------------------------------------
    def bucket_descriptors(self, bucket_bytes: int, infer_rank: int = 0) -> list[np.ndarray]:
        """Per bucket an ``(N, 6)`` int64 array ``(src_off, dst_off, rows, row_bytes, src_pitch, dst_pitch)``:
        src = the gathered bucket, dst = the flat inference buffer of ``infer_rank``."""
        key = (bucket_bytes, infer_rank)
        if key in self._descs:
            return self._descs[key]
        buckets = self.buckets(bucket_bytes)
        chunks: dict[tuple[int, str], list[tuple[int, int, int, int]]] = {}
        for b in buckets:
            for name, _, off, _, r0, _ in b.params:
                chunks.setdefault((b.stage, name), []).append((r0, b.index, off, b.local_bytes))
        where = {
            k: np.asarray(v, dtype=np.int64) for k, v in chunks.items()
        }  # rows: r0, bucket, off, member_bytes
        layout, _ = self.infer_layout(infer_rank)
        es = self.itemsize
        per_bucket: list[list[np.ndarray]] = [[] for _ in buckets]
        for t in self.targets(infer_rank):
            toff, _ = layout[t.name]
            for pc in t.pieces:
                if pc.nrows == 0:
                    continue
                src = self.hf[pc.hf].src
                ch = where[(src.stage, src.param)]
                lcols = src.local_shape[1]
                rows = np.arange(pc.row0, pc.row0 + pc.nrows, dtype=np.int64)
                if src.mode == "cols":
                    d = _cols_descs(pc, rows, lcols, ch, toff, t.cols, es)
                else:
                    if src.mode == "whole":
                        member, lrow = np.full_like(rows, src.member), rows
                    else:
                        assert src.row_map is not None
                        member, lrow = src.row_map(rows)
                    d = _rows_descs(pc, member, lrow, lcols, ch, toff, t.cols, es)
                for bi in np.unique(d[:, 6]):
                    per_bucket[int(bi)].append(d[d[:, 6] == bi, :6])
        out = [np.concatenate(x) if x else np.zeros((0, 6), np.int64) for x in per_bucket]
        self._descs[key] = out
        return out

    def inplace_targets(
        self, infer_rank: int = 0, stage: int = 0, tp_rank: int = 0, ep_rank: int = 0
    ) -> dict[str, tuple[str, int]]:
        """The inference tensors of ``infer_rank`` that the training rank ``(stage, tp_rank, ep_rank)`` holds
        as one contiguous range of one of its own parameters, in order: ``{name: (stage-local parameter,
        element offset)}``. Such a tensor needs no gather and no copy: a switch can hand out a view of the
        parameter (training TP 1 dense weights, the local experts of an EP rank, replicated norms).

        The rule reads the plan's pieces: every piece of the target comes from the same parameter on this
        rank (its ``member`` in the source's group), takes all of the parameter's columns, and the pieces'
        local rows follow each other in the target's row order."""
        key = (infer_rank, stage, tp_rank, ep_rank)
        if key in self._inplace:
            return self._inplace[key]
        me = {"tp": tp_rank, "ep": ep_rank}
        out: dict[str, tuple[str, int]] = {}
        for t in self.targets(infer_rank):
            where = self._local_rows(t, stage, me)
            if where is not None:
                out[t.name] = where
        self._inplace[key] = out
        return out

    def _local_rows(self, t: Target, stage: int, me: dict[str, int]) -> tuple[str, int] | None:
        """``(param, element offset)`` where target ``t`` is one contiguous range of a local parameter."""
        if not t.pieces:
            return None
        param, next_row, first, dst = None, None, 0, 0
        for pc in sorted(t.pieces, key=lambda p: p.dst_row):
            src = self.hf[pc.hf].src
            lcols = src.local_shape[1]
            if src.stage != stage or pc.dst_row != dst or pc.dst_col or pc.col0 or pc.ncols != lcols:
                return None
            if lcols != t.cols or (param is not None and src.param != param):
                return None
            if src.mode == "whole":
                # replicated over the TP group: every member holds it; a whole expert: its EP owner only
                if src.group == "ep" and src.member != me["ep"]:
                    return None
                r0 = pc.row0
            elif src.mode == "cols":
                if src.members != 1 or me[src.group] != 0:
                    return None
                r0 = pc.row0
            else:
                assert src.row_map is not None
                member, lrow = src.row_map(np.arange(pc.row0, pc.row0 + pc.nrows, dtype=np.int64))
                if (member != me[src.group]).any() or (np.diff(lrow) != 1).any():
                    return None
                r0 = int(lrow[0])
            if next_row is None:
                param, first = src.param, r0 * lcols
            elif r0 != next_row:
                return None
            next_row, dst = r0 + pc.nrows, dst + pc.nrows
        if dst != t.rows:
            return None
        assert param is not None
        return param, first

    def needed_buckets(self, bucket_bytes: int) -> frozenset[int]:
        """The gather buckets some rank must still gather when every rank yields its
        :meth:`inplace_targets` as views: a bucket is needed if, on any training rank and for any inference
        rank, a tensor that is not in place there reads from it. The same set on every rank (a function of
        the plan), so the ranks skip the same collectives. With PP > 1 every bucket that anyone reads is
        needed (the other stages read it through the broadcast); otherwise a bucket stays a candidate for
        skipping only while every tensor reading it is in place on each TP x EP rank checked so far (most
        buckets fall out at the first rank, so the check stays near one pass over the targets)."""
        if bucket_bytes in self._needed:
            return self._needed[bucket_bytes]
        tr = self.train
        nb = len(self.buckets(bucket_bytes))
        need: set[int] = set()
        for r in range(self.infer.tp):
            descs = self.bucket_descriptors(bucket_bytes, r)
            layout, _ = self.infer_layout(r)
            names = list(layout)
            by_name = {t.name: t for t in self.targets(r)}
            offs = np.asarray([layout[n][0] for n in names], dtype=np.int64)
            readers = [
                [names[i] for i in np.unique(np.searchsorted(offs, d[:, 1], side="right") - 1)] for d in descs
            ]
            if tr.pp > 1:  # every bucket someone reads, through the broadcast to the other stages
                need.update(k for k in range(nb) if readers[k])
                continue
            cand = {k for k in range(nb) if k not in need and readers[k]}
            for tp in range(tr.tp):
                for ep in range(tr.ep):
                    me = {"tp": tp, "ep": ep}
                    for k in sorted(cand):
                        if any(self._local_rows(by_name[n], 0, me) is None for n in readers[k]):
                            need.add(k)
                            cand.discard(k)
        self._needed[bucket_bytes] = frozenset(need)
        return self._needed[bucket_bytes]

    def stream_schedule(
        self, bucket_bytes: int, infer_rank: int = 0, inplace: frozenset[str] | None = None
    ) -> tuple[list[StreamBucket], list[np.ndarray]]:
        """Group the gather buckets into stream buckets that each yield whole inference tensors.

        A tensor is complete after the last gather bucket that writes it; consecutive gather buckets whose
        tensors overlap form one indivisible run, and runs are packed greedily until a stream bucket holds
        ``bucket_bytes`` of output (a run larger than that is a stream bucket of its own). Returns the stream
        buckets and, per gather bucket, its copy descriptors re-based onto its stream bucket's output
        scratch.

        ``inplace`` (a set, possibly empty; ``None``: every tensor copied into the output scratch): names of
        tensors the caller yields as views of its own parameters (a subset of :meth:`inplace_targets`):
        they keep their place in the order and count toward a bucket's ``bucket_bytes``, but take no output
        scratch and no copy descriptor. In this mode, too, a tensor that is one contiguous range of a
        gathered bucket (exchanged, or broadcast over PP), that bucket ending its run, is yielded as a view
        of the gather scratch (``StreamBucket.gathered``) and closes its stream bucket, so that no later
        gather overwrites it before it is yielded."""
        key = (bucket_bytes, infer_rank, None if inplace is None else frozenset(inplace))
        if key in self._stream:
            return self._stream[key]
        views_mode = inplace is not None
        inplace = frozenset(inplace or ())
        descs = self.bucket_descriptors(bucket_bytes, infer_rank)
        layout, _ = self.infer_layout(infer_rank)
        unknown = set(inplace) - set(layout)
        if unknown:
            raise ReshardError(
                f"stream_schedule: inplace names {sorted(unknown)[:3]} are not tensors of this plan"
            )
        names = list(layout)
        offs = np.asarray([layout[n][0] for n in names], dtype=np.int64)
        sizes = np.asarray([int(np.prod(layout[n][1])) * self.itemsize for n in names], dtype=np.int64)
        in_place = np.asarray([n in inplace for n in names], dtype=bool)
        nb = len(descs)
        first = np.full(len(names), nb, dtype=np.int64)
        last = np.full(len(names), -1, dtype=np.int64)
        covered = np.zeros(len(names), dtype=np.int64)
        which: list[np.ndarray] = []
        for k, d in enumerate(descs):
            t = np.searchsorted(offs, d[:, 1], side="right") - 1
            which.append(t)
            np.minimum.at(first, t, k)
            np.maximum.at(last, t, k)
            np.add.at(covered, t, d[:, 2] * d[:, 3])
        # runs of gather buckets: a tensor written by buckets [first, last] ties them into one run
        run_end = np.arange(nb)
        for f, lst in zip(first, last):
            if lst >= 0:
                run_end[f] = max(run_end[f], lst)
        runs: list[tuple[int, int]] = []
        k = 0
        while k < nb:
            end, j = int(run_end[k]), k
            while j <= end:
                end = max(end, int(run_end[j]))
                j += 1
            runs.append((k, end))
            k = end + 1
        # tensors no copy writes (all-padding vocab shards) go with the first run
        done_at = np.where(last >= 0, last, 0)
        # views of the gather scratch: the whole tensor one contiguous range of one gathered bucket
        scratch_at: dict[int, int] = {}  # tensor -> byte offset in its gathered bucket
        if views_mode:
            buckets = self.buckets(bucket_bytes)
            ends = {e for _, e in runs}
            for k, d in enumerate(descs):
                b = buckets[k]
                if k not in ends or not len(d) or (b.members == 1 and self.train.pp == 1):
                    continue  # overwritten by the run's next gather, or not gathered (copied directly)
                for i in np.unique(which[k]):
                    if in_place[i] or first[i] != k or last[i] != k or covered[i] != sizes[i]:
                        continue
                    at = _contiguous_source(d[which[k] == i], int(offs[i]), int(sizes[i]))
                    if at is not None:
                        scratch_at[int(i)] = at
        closes = {e for _, e in runs if any(done_at[i] == e for i in scratch_at)}
        groups: list[list[tuple[int, int]]] = []
        out_bytes: list[int] = []
        for r in runs:
            rb = int(sizes[(done_at >= r[0]) & (done_at <= r[1])].sum())
            closed = bool(groups) and groups[-1][-1][1] in closes
            fits = bool(groups) and (out_bytes[-1] == 0 or rb == 0 or out_bytes[-1] + rb <= bucket_bytes)
            if fits and not closed:
                groups[-1].append(r)
                out_bytes[-1] += rb
            else:
                groups.append([r])
                out_bytes.append(rb)
        stream: list[StreamBucket] = []
        rebased: list[np.ndarray] = [np.zeros((0, 6), np.int64)] * nb
        for g in groups:
            lo, hi = g[0][0], g[-1][1]
            members = np.flatnonzero((done_at >= lo) & (done_at <= hi))
            new_off, pos, tensors, zero, views, gathered = {}, 0, [], [], [], []
            for i in members:
                if in_place[i]:
                    views.append((names[i], tuple(layout[names[i]][1])))
                    continue
                if int(i) in scratch_at:
                    gathered.append((names[i], scratch_at[int(i)], tuple(layout[names[i]][1])))
                    continue
                new_off[int(i)] = pos
                tensors.append((names[i], pos, tuple(layout[names[i]][1])))
                if covered[i] < sizes[i]:
                    zero.append((pos, int(sizes[i])))
                pos = _align(pos + int(sizes[i]))
            for k in range(lo, hi + 1):
                keep = ~in_place[which[k]] & ~np.isin(which[k], list(scratch_at))
                d = descs[k][keep].copy()
                if len(d):
                    shift = np.asarray([new_off[int(t)] - offs[t] for t in which[k][keep]], dtype=np.int64)
                    d[:, 1] += shift
                rebased[k] = d
            stream.append(
                StreamBucket(
                    tuple(range(lo, hi + 1)), tuple(tensors), tuple(zero), pos, tuple(views), tuple(gathered)
                )
            )
        self._stream[key] = (stream, rebased)
        return self._stream[key]

    def native_plans(
        self,
        bucket_bytes: int,
        infer_rank: int = 0,
        stream: bool = False,
        inplace: frozenset[str] | None = None,
    ) -> list[Any]:
        """Per gather bucket the native ``CopyPlan`` (None where the bucket writes nothing here): into the
        flat inference buffer, or with ``stream=True`` into the stream buckets' output scratch (of the
        schedule built with ``inplace``)."""
        key = (bucket_bytes, infer_rank, stream, None if inplace is None else frozenset(inplace))
        if key not in self._native:
            from msrl_core import CopyPlan

            descs = (
                self.stream_schedule(bucket_bytes, infer_rank, inplace)[1]
                if stream
                else self.bucket_descriptors(bucket_bytes, infer_rank)
            )
            self._native[key] = [CopyPlan(d) if len(d) else None for d in descs]
        return self._native[key]


def _contiguous_source(d: np.ndarray, dst: int, nbytes: int) -> int | None:
    """The source offset where descriptors ``d`` copy one contiguous source range onto the contiguous
    destination ``[dst, dst + nbytes)`` in order, else ``None``."""
    d = d[np.argsort(d[:, 1], kind="stable")]
    src0, at = int(d[0, 0]), dst
    for so, do, rows, rb, sp, dp in d.tolist():
        if do != at or so != src0 + (at - dst) or (rows > 1 and (sp != rb or dp != rb)):
            return None
        at += rows * rb
    return src0 if at == dst + nbytes else None


def rebase_onto_params(b: Bucket, d: np.ndarray) -> dict[str, np.ndarray]:
    """The copy descriptors ``d`` of gather bucket ``b`` (sources in this member's packed slot) re-based, per
    training parameter, onto the parameter's own bytes: the copy then reads the parameter directly (no pack,
    no scratch). The bucket's members must be 1 or the source the reading rank's own slot."""
    out: dict[str, list[np.ndarray]] = {}
    if not len(d):
        return {}
    starts = np.asarray([p[2] for p in b.params], dtype=np.int64)
    which = np.searchsorted(starts, d[:, 0], side="right") - 1
    for i in np.unique(which):
        name, _shape, off, nb, r0, r1 = b.params[int(i)]
        sel = d[which == i].copy()
        # a descriptor never leaves its chunk: [off, off + nb) of the bucket = rows [r0, r1) of the param
        end = sel[:, 0] + (sel[:, 2] - 1) * sel[:, 4] + sel[:, 3]
        assert int(sel[:, 0].min()) >= off and int(end.max()) <= off + nb, (name, b.index)
        sel[:, 0] += r0 * (nb // (r1 - r0)) - off
        out.setdefault(name, []).append(sel)
    return {n: np.concatenate(v) for n, v in out.items()}


def _rows_descs(pc, member, lrow, lcols, ch, toff, tcols, es) -> np.ndarray:
    """Runs of consecutive local rows on one member inside one chunk -> descriptors (+ bucket column)."""
    n = len(lrow)
    ci = np.searchsorted(ch[:, 0], lrow, side="right") - 1
    brk = np.flatnonzero((np.diff(member) != 0) | (np.diff(lrow) != 1) | (np.diff(ci) != 0)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [n])))
    m, r0, c = member[starts], lrow[starts], ci[starts]
    src = m * ch[c, 3] + ch[c, 2] + ((r0 - ch[c, 0]) * lcols + pc.col0) * es
    dst = toff + ((pc.dst_row + starts) * tcols + pc.dst_col) * es
    k = len(starts)
    return np.stack(
        [src, dst, lens, np.full(k, pc.ncols * es), np.full(k, lcols * es), np.full(k, tcols * es), ch[c, 1]],
        axis=1,
    ).astype(np.int64)


def _cols_descs(pc, rows, lcols, ch, toff, tcols, es) -> np.ndarray:
    """Row-parallel source: columns split over members; rows split by chunk."""
    out = []
    ci = np.searchsorted(ch[:, 0], rows, side="right") - 1
    brk = np.flatnonzero(np.diff(ci) != 0) + 1
    for seg_rows in np.split(np.arange(len(rows)), brk):
        r_first, nrows = int(rows[seg_rows[0]]), len(seg_rows)
        r0c, bidx, off, mbytes = (int(x) for x in ch[ci[seg_rows[0]]])
        c, end = pc.col0, pc.col0 + pc.ncols
        while c < end:
            m, lc = divmod(c, lcols)
            seg = min(end - c, lcols - lc)
            src = m * mbytes + off + ((r_first - r0c) * lcols + lc) * es
            dst = toff + ((pc.dst_row + seg_rows[0]) * tcols + pc.dst_col + (c - pc.col0)) * es
            out.append([src, dst, nrows, seg * es, lcols * es, tcols * es, bidx])
            c += seg
    return np.asarray(out, dtype=np.int64)


def execute_numpy(descs: np.ndarray, dst: np.ndarray, src: np.ndarray) -> None:
    """Reference executor of a descriptor array over uint8 buffers (tests; no native extension needed)."""
    for so, do, rows, rb, sp, dp in np.asarray(descs, dtype=np.int64):
        s = np.lib.stride_tricks.as_strided(src[so:], shape=(rows, rb), strides=(sp, 1))
        d = np.lib.stride_tricks.as_strided(dst[do:], shape=(rows, rb), strides=(dp, 1))
        d[...] = s


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def views_of(flat, layout: dict[str, tuple[int, tuple[int, ...]]], dtype) -> dict[str, Any]:
    import torch

    es = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for name, (off, shape) in layout.items():
        n = int(np.prod(shape)) * es
        out[name] = flat[off : off + n].view(dtype).view(shape)
    return out


def megatron_to_vllm(model_config: ModelConfig, train: Parallel, infer: Parallel) -> ReshardPlan:
    """Plan Megatron (tp, pp, ep) -> vLLM per-rank layout (tp, ep; pp 1)."""
    return ReshardPlan(model_config, train, infer, "vllm")


def to_hf(model_config: ModelConfig, train: Parallel) -> ReshardPlan:
    """Plan Megatron -> Hugging Face checkpoint layout (full tensors, HF names) on every rank."""
    return ReshardPlan(model_config, train, Parallel(tp=1), "hf")
