"""Persistent pinned host mirrors of device storages: swap out (one batched device→host copy, then free the
storages; the tensor objects survive) and back (re-materialise, one batched host→device copy). Used for the
training weights (:class:`~msrl_core.reshard.Switcher`) and the training state (``offload.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ReshardError
from .steps import Deadline, bytes_view


class EngineAndPool:
    """The copy engine and pinned pool an owner uses: injected, or its own (created on first use)."""

    def __init__(self, engine: Any = None, pool: Any = None) -> None:
        self._engine, self._pool = engine, pool

    @property
    def engine(self) -> Any:
        if self._engine is None:
            from msrl_core import CopyEngine

            self._engine = CopyEngine()
        return self._engine

    @property
    def pool(self) -> Any:
        if self._pool is None:
            from msrl_core import PinnedPool

            self._pool = PinnedPool()
        return self._pool


@dataclass(frozen=True)
class Storage:
    """One device storage to swap: ``name`` is its key (the first tensor on it)."""

    name: str
    storage: Any
    nbytes: int
    device: Any


def unique_storages(named: dict[str, Any]) -> list[Storage]:
    """One entry per storage with bytes (tensors may share one: a contiguous parameter or grad buffer)."""
    out: list[Storage] = []
    seen: set[int] = set()
    for n, t in named.items():
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(Storage(n, st, st.nbytes(), t.device))
    return out


@dataclass
class SwapOutResult:
    new_bytes: int  # pinned bytes allocated by this swap-out (0 once the mirrors exist)
    seconds: float  # mirror lookup + copies + freeing
    copy_seconds: float  # the device->host copies alone


class HostMirrors:
    """Pinned mirrors by key, allocated from ``pool()`` on first use and reused."""

    def __init__(self, pool: Callable[[], Any]) -> None:
        self._pool = pool
        self.mirrors: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(int(m.nbytes) for m in self.mirrors.values())

    def view(self, s: Storage):
        import torch

        return torch.frombuffer(self.mirrors[s.name], dtype=torch.uint8, count=s.nbytes)

    def swap_out(
        self,
        storages: list[Storage],
        engine: Any,
        deadline: Deadline,
        stream: Any,
        what: str,
        pool: Any = None,
    ) -> SwapOutResult:
        """Copy every storage to its mirror (one batch, after ``stream``), then free them. A failure restores
        what was already freed and raises a ``ReshardError`` naming the ``what`` (e.g. "parameter").
        ``pool`` overrides the pool new mirrors come from."""
        t0 = time.perf_counter()
        new = 0
        done: list[Storage] = []
        at = storages[0].name if storages else "(none)"
        try:
            for s in storages:
                at = s.name
                m = self.mirrors.get(s.name)
                if m is None or m.nbytes < s.nbytes:
                    self.mirrors[s.name] = (pool or self._pool()).allocate(s.nbytes)
                    new += s.nbytes
            t_copy0 = time.perf_counter()
            at = "(all storages, one batch)"
            # every storage in one job: one submission and one ticket, however many tensors
            engine.copy_many(
                [self.view(s) for s in storages],
                [bytes_view(s.storage, s.device) for s in storages],
                kind="d2h",
                after=stream,
            ).wait(deadline.left())
            t_copied = time.perf_counter()
            for s in storages:
                at = s.name
                s.storage.resize_(0)
                done.append(s)
        except Exception as e:
            if done:  # into re-materialised storages: ordered after `stream` like any swap-in
                self.copy_in(done, engine, stream).wait(deadline.left())
            raise ReshardError(
                f"swap-out failed at {what} {at!r}: {type(e).__name__}: {e}; {what}s restored"
            ) from e
        return SwapOutResult(new, time.perf_counter() - t0, t_copied - t_copy0)

    def copy_in(self, storages: list[Storage], engine: Any, stream: Any) -> Any:
        """Re-materialise the storages and start the host→device copies (one batch); returns the ticket."""
        dsts, srcs = [], []
        for s in storages:
            s.storage.resize_(s.nbytes)
            dsts.append(bytes_view(s.storage, s.device))
            srcs.append(self.view(s))
        return engine.copy_many(dsts, srcs, kind="h2d", after=stream)
