"""Broadcast of a weight switch to rollout ranks outside the training group (disaggregated rollout).

One process group spans the training source ranks and the rollout ranks (gloo on CPUs, NCCL/HCCL on
devices). Rollout rank ``j`` (its index in ``rollouts``) serves inference TP rank ``r = j % TP_i``
(rollout replicas repeat the TP ranks) and is fed by training rank ``trainers[j % T]`` (``T =
len(trainers)``), so replicas are fed by different trainers in parallel. A trainer streams each inference
rank it feeds with :func:`~msrl_core.reshard.stream_buckets` in vLLM's per-rank layout (one pass per rank)
and broadcasts it bucket by bucket over the subgroup ``{that trainer} ∪ {its rollout ranks of r}``: each
rollout rank receives only the slices of its own TP rank, one bucket buffer at a time. Every rank derives
the same bucket schedule from the plan, so nothing but tensor bytes crosses the wire (no pickled metadata).

```python
bc = RolloutBroadcast(plan, trainers=[0, 1], rollouts=[2, 3], bucket_bytes=64 << 20)   # on every rank
bc.send(model, groups)                       # training ranks (their TP/PP/EP groups as for allgather_swap)
for bucket in bc.receive():                  # rollout ranks: [(vLLM name, tensor)], valid until the next
    engine_load(bucket)
```
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ReshardError
from .plan import ReshardPlan

__all__ = ["BroadcastReport", "RolloutBroadcast", "broadcast_per_parameter"]


@dataclass
class BroadcastReport:
    """What one send or receive did on this rank."""

    role: str  # "trainer" | "rollout"
    infer_ranks: list[int]  # the inference ranks this rank sent (trainer) or received (rollout)
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0


class RolloutBroadcast:
    """The broadcast topology for one plan; construct it on every rank of ``group`` (it creates the
    subgroups, a collective). ``trainers`` / ``rollouts``: global ranks. ``device``: where rollout ranks
    receive (``"cpu"`` here; the rank's GPU with NCCL)."""

    def __init__(
        self,
        plan: ReshardPlan,
        trainers: Sequence[int],
        rollouts: Sequence[int],
        *,
        bucket_bytes: int = 64 << 20,
        group: Any = None,
        device: Any = "cpu",
    ) -> None:
        import torch.distributed as dist

        if plan.layout != "vllm":
            raise ReshardError(f"RolloutBroadcast needs a megatron_to_vllm plan, got {plan!r}")
        if bucket_bytes <= 0:
            raise ReshardError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        tr, ro = list(trainers), list(rollouts)
        if not tr or not ro:
            raise ReshardError(f"need at least one trainer and one rollout rank, got {tr} and {ro}")
        if set(tr) & set(ro) or len(set(tr)) != len(tr) or len(set(ro)) != len(ro):
            raise ReshardError(f"trainer ranks {tr} and rollout ranks {ro} must be distinct")
        tp_i = plan.infer.tp
        if len(ro) % tp_i:
            raise ReshardError(f"{len(ro)} rollout ranks do not make whole replicas of inference TP {tp_i}")
        world = dist.get_world_size(group)
        bad = [r for r in tr + ro if not 0 <= r < world]
        if bad:
            raise ReshardError(f"ranks {bad} are outside the group of {world} ranks")
        self.plan, self.trainers, self.rollouts = plan, tr, ro
        self.bucket_bytes, self.device = bucket_bytes, device
        self.tp_i = tp_i
        self.me = dist.get_rank()
        self.subgroups: dict[tuple[int, int], Any] = {}
        for k in range(len(tr)):  # every rank calls new_group for every subgroup, in the same order
            for r in self.ranks_fed_by(k):
                self.subgroups[(k, r)] = dist.new_group(sorted({tr[k]} | set(self.rollouts_of(k, r))))

    def feeder_of(self, j: int) -> int:
        """Index (in ``trainers``) of the trainer that feeds rollout index ``j``."""
        return j % len(self.trainers)

    def ranks_fed_by(self, k: int) -> list[int]:
        return sorted({j % self.tp_i for j in range(len(self.rollouts)) if self.feeder_of(j) == k})

    def rollouts_of(self, k: int, r: int) -> list[int]:
        return [g for j, g in enumerate(self.rollouts) if self.feeder_of(j) == k and j % self.tp_i == r]

    def passes(self) -> int:
        return max(1, *(len(self.ranks_fed_by(k)) for k in range(len(self.trainers))))

    # -- training side ---------------------------------------------------------------------------
    def send(self, train_params: Any, groups: Mapping[str, Any], **stream_kw: Any) -> BroadcastReport:
        """On every training rank: stream each owned inference rank's buckets and broadcast them to that
        rank's rollout ranks. A training rank without a rank in some pass still streams (its gathers are
        collectives of the training groups) and sends nothing."""
        import torch.distributed as dist

        from .stream import stream_buckets

        if self.me not in self.trainers:
            raise ReshardError(
                f"rank {self.me} is not a trainer rank ({self.trainers}); rollout ranks call receive()"
            )
        k = self.trainers.index(self.me)
        mine = self.ranks_fed_by(k)
        rep = BroadcastReport("trainer", [])
        t0 = time.perf_counter()
        for p in range(self.passes()):
            sending = p < len(mine)
            r = (
                mine[p] if sending else k % self.tp_i
            )  # no rank left: stream anyway (collectives), send nothing
            stream = stream_buckets(
                train_params,
                self.plan,
                groups,
                names="vllm",
                infer_rank=r,
                bucket_bytes=self.bucket_bytes,
                **stream_kw,
            )
            for bucket, sb in zip(stream, stream.schedule):
                if not sending:
                    continue
                buf = _bucket_bytes(bucket, sb.nbytes)
                dist.broadcast(buf, src=self.me, group=self.subgroups[(k, r)])
                rep.buckets += 1
                rep.bytes += sb.nbytes
            if sending:
                rep.infer_ranks.append(r)
        rep.seconds = time.perf_counter() - t0
        return rep

    # -- rollout side ----------------------------------------------------------------------------
    def infer_rank(self) -> int:
        if self.me not in self.rollouts:
            raise ReshardError(f"rank {self.me} is not a rollout rank ({self.rollouts})")
        return self.rollouts.index(self.me) % self.tp_i

    def receive(self) -> Iterator[list[tuple[str, Any]]]:
        """On every rollout rank: buckets ``[(vLLM per-rank name, tensor)]`` of this rank's inference rank,
        views into one reused receive buffer (valid until the next bucket is requested)."""
        import torch
        import torch.distributed as dist

        r = self.infer_rank()
        k = self.feeder_of(self.rollouts.index(self.me))
        schedule, _ = self.plan.stream_schedule(self.bucket_bytes, r)
        dtype = getattr(torch, self.plan.cfg.dtype)
        es = self.plan.itemsize
        buf = torch.empty(max(sb.nbytes for sb in schedule), dtype=torch.uint8, device=self.device)
        src = self.trainers[k]
        self.report = BroadcastReport("rollout", [r])
        t0 = time.perf_counter()
        for sb in schedule:
            view = buf[: sb.nbytes]
            dist.broadcast(view, src=src, group=self.subgroups[(k, r)])
            self.report.buckets += 1
            self.report.bytes += sb.nbytes
            self.report.seconds = time.perf_counter() - t0
            yield [
                (name, buf[off : off + _numel(shape) * es].view(dtype).view(shape))
                for name, off, shape in sb.tensors
            ]

    def receive_all(self) -> dict[str, Any]:
        """Every tensor of this rank (copies), for callers that want the whole rank at once."""
        return {n: t.clone() for bucket in self.receive() for n, t in bucket}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bucket_bytes(bucket: list[tuple[str, Any]], nbytes: int) -> Any:
    """The stream's output bucket as one contiguous uint8 tensor: the yielded views share one scratch that
    starts at storage offset 0 (stream.py), so its first ``nbytes`` bytes are the bucket."""
    import torch

    t0 = bucket[0][1]
    st = t0.untyped_storage()
    if st.nbytes() < nbytes:
        raise ReshardError(f"stream bucket storage has {st.nbytes()} bytes, the schedule says {nbytes}")
    return torch.empty(0, dtype=torch.uint8, device=t0.device).set_(st, 0, (nbytes,), (1,))


def broadcast_per_parameter(
    tensors: Mapping[str, Any] | None,
    metadata: Sequence[tuple[str, tuple[int, ...]]],
    *,
    src: int,
    dtype: Any,
    group: Any = None,
    device: Any = "cpu",
) -> dict[str, Any]:
    """Baseline (what a trainer without a reshard plan does): rank ``src`` holds every full HF tensor and
    broadcasts them one by one to the whole group; everyone ends with full tensors (rollout ranks slice their
    part afterwards). ``metadata``: ``[(name, shape)]`` in the same order on every rank."""
    import torch
    import torch.distributed as dist

    out = {}
    me = dist.get_rank()
    for name, shape in metadata:
        if me == src:
            assert tensors is not None
            t = tensors[name].contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        out[name] = t
    return out
