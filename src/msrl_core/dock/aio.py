"""asyncio API over a Dock: awaitable claim / fetch / put / take (and get, where the dock has it), and
``async for batch in adock.batches(stage, ...)``.

>>> adock = AsyncDock(dock)
>>> meta = await adock.claim("reward", max_rows=64, timeout=5.0)
>>> batch = await adock.fetch(meta)
>>> await adock.put({"rewards": scores}, rows=meta)

Every wait has a deadline: ``claim``/``take`` wait at most ``timeout`` seconds for ready rows (``0``:
never wait), exactly as ``Dock.claim``; ``fetch``/``put``/``get`` run on a thread pool and are given
up after ``io_timeout`` seconds (``Timeout``; the call may still complete on its thread).

How claims wait without one thread per waiter (64 claimers in one loop need not be 64 threads):

- **fast path**: when nobody of the same kind is waiting, the claim is tried at once, non-blocking, on
  the event loop's thread (a local dock's claim takes microseconds; ``inline_claims=False`` sends it
  to the thread pool instead, e.g. for a Ray dock whose claim is a remote call);
- **waiting**: otherwise the claim joins a FIFO queue of its kind (same stage and the same extra claim
  arguments, e.g. ``partition=``). One dispatcher thread per queue runs the head's claim natively with
  a short deadline (GIL released), hands the rows to the head's future, and expires every waiter whose
  own deadline passed (after one last non-blocking try: ``Timeout``, as the sync call). A waiter
  cancelled while its rows were being claimed gives them back (``Dock.release``): cancellation never
  loses rows. The dispatcher exits after ``idle_s`` without waiters. Waiters of one kind are served
  in order: a head that asks for more rows than are ready holds back those behind it until its own
  deadline.

The dock's own rules (exactly once per stage, whole groups, readiness) stay native: this layer only
schedules calls. ``close()`` stops the dispatchers and fails waiting claims with ``Closed``; it does
not close the dock (``Dock.close()`` wakes native waits, which then raise ``Closed`` here too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from msrl_core.dock._types import MAX_WAIT_S, Batch, Claim
from msrl_core.errors import Closed, InvalidArgument, MsrlError, Timeout

_SLICE_S = 0.1  # longest native wait of a dispatcher: new earlier deadlines and cancels are seen by then


class _Waiter:
    __slots__ = ("loop", "future", "max_rows", "min_rows", "max_items", "timeout", "deadline")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        max_rows: int,
        min_rows: int,
        max_items: int | None,
        timeout: float,
    ):
        self.loop = loop
        self.future: asyncio.Future[Claim] = loop.create_future()
        self.max_rows, self.min_rows, self.max_items = max_rows, min_rows, max_items
        self.timeout = timeout
        self.deadline = time.monotonic() + min(timeout, MAX_WAIT_S)


class _Queue:
    """Waiting claims of one kind (stage + extra claim arguments), served FIFO by one thread."""

    def __init__(self, owner: AsyncDock, key: Any, stage: str, extra: dict[str, Any]):
        self.owner, self.key, self.stage, self.extra = owner, key, stage, extra
        self.cond = threading.Condition()
        self.waiters: deque[_Waiter] = deque()
        self.thread: threading.Thread | None = None

    def add(self, w: _Waiter) -> None:
        with self.cond:
            self.waiters.append(w)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"msrl-aio-{self.stage}", daemon=True)
                self.thread.start()
            self.cond.notify()

    def _claim(self, w: _Waiter, timeout: float, min_rows: int) -> Claim:
        return self.owner.dock.claim(
            self.stage, w.max_rows, timeout=timeout, min_rows=min_rows, max_items=w.max_items, **self.extra
        )

    def _next(self) -> _Waiter | None:
        """Under the lock: drops cancelled waiters, expires overdue ones; returns the head to serve, or
        None when the thread should exit (closed, or idle for ``idle_s``)."""
        idle_until = time.monotonic() + self.owner.idle_s
        while True:
            if self.owner.closed:
                for w in self.waiters:
                    self.owner._resolve(w, Closed(f"stage '{self.stage}': the AsyncDock is closed"))
                self.waiters.clear()
                self.thread = None
                return None
            now = time.monotonic()
            keep: deque[_Waiter] = deque()
            for w in self.waiters:
                if w.future.done():
                    continue
                if w.deadline <= now:
                    self._expire(w)
                else:
                    keep.append(w)
            self.waiters = keep
            if keep:
                return keep[0]
            if now >= idle_until:
                self.thread = None
                with self.owner._lock:  # forget an idle kind (e.g. a DP round's batch=): the dict stays small
                    if self.owner._queues.get(self.key) is self:
                        del self.owner._queues[self.key]
                return None
            self.cond.wait(idle_until - now)

    def _expire(self, w: _Waiter) -> None:
        """A waiter's deadline passed: one last non-blocking try, as the sync claim ends its wait."""
        try:
            got: Claim | BaseException = self._claim(w, 0.0, w.min_rows)
        except Timeout as e:
            got = Timeout(
                f"stage '{self.stage}': claim of {w.min_rows}..{w.max_rows} rows timed out after "
                f"{w.timeout:g} s with fewer than min_rows {w.min_rows} ready ({e})"
            )
        except BaseException as e:  # Closed, ...
            got = e
        self.owner._resolve(w, got)

    def _run(self) -> None:
        while True:
            with self.cond:
                head = self._next()
                if head is None:
                    return
                earliest = min(w.deadline for w in self.waiters)
            wait_s = max(0.0, min(earliest - time.monotonic(), _SLICE_S))
            try:
                got: Claim | BaseException = self._claim(head, wait_s, head.min_rows)
            except Timeout:
                continue  # not enough rows in this slice; deadlines are handled by _next
            except BaseException as e:
                got = e
            with self.cond, contextlib.suppress(ValueError):
                self.waiters.remove(head)
            self.owner._resolve(head, got)


def _check_timeout(name: str, timeout: float) -> float:
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, got {timeout!r}") from None
    if not (t >= 0 and math.isfinite(t)):
        raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, got {timeout!r}")
    return t


class AsyncDock:
    """Awaitable claim / fetch / put / take / get over ``dock`` (a ``msrl_core.Dock``).

    ``executor``: the thread pool for fetch, put and get (default: an own pool of ``max_workers``
    threads, shut down by ``close()``). ``io_timeout``: the deadline of those calls in seconds.
    ``inline_claims``: try a claim's non-blocking first attempt on the event loop's thread.
    Extra keyword arguments of ``claim``/``take`` (``partition=``, ``max_staleness=``, ...) are passed
    to ``Dock.claim`` unchanged.
    """

    def __init__(
        self,
        dock: Any,
        executor: ThreadPoolExecutor | None = None,
        max_workers: int = 8,
        io_timeout: float = 300.0,
        inline_claims: bool = True,
        idle_s: float = 1.0,
    ):
        self.dock = dock
        self.io_timeout = _check_timeout("io_timeout", io_timeout)
        self.idle_s = _check_timeout("idle_s", idle_s)
        self.inline_claims = bool(inline_claims)
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers, thread_name_prefix="msrl-aio-io")
        self._queues: dict[Any, _Queue] = {}
        self._lock = threading.Lock()
        self.closed = False
        # Claims served at once ("now") and after waiting in a queue ("queued"): see the module docstring.
        self.counts: collections.Counter[str] = collections.Counter()

    # ---- claims ----------------------------------------------------------------------------

    async def claim(
        self,
        stage: str,
        max_rows: int,
        timeout: float = 0.0,
        min_rows: int | None = None,
        max_items: int | None = None,
        **claim_args: Any,
    ) -> Claim:
        """``Dock.claim`` as a coroutine: waits up to ``timeout`` seconds for at least ``min_rows`` ready
        rows (default one group) without blocking the event loop; the same results and errors
        (``Timeout`` when fewer are ready at the deadline; ``timeout=0`` may return an empty Claim)."""
        if self.closed:
            raise Closed(f"stage '{stage}': the AsyncDock is closed")
        timeout = _check_timeout("timeout", timeout)
        if timeout == 0:
            self.counts["now"] += 1
            return await self._claim_now(stage, max_rows, min_rows, max_items, claim_args)
        need = int(self.dock.group_size if min_rows is None else min_rows)
        queue = self._queue(stage, claim_args)
        if not queue.waiters:  # nobody of this kind waits ahead of us: try at once
            try:
                if self.inline_claims:  # the hot path: no thread hop, no extra coroutine
                    meta = self.dock.claim(stage, max_rows, 0.0, need, max_items, **claim_args)
                else:
                    meta = await self._claim_now(stage, max_rows, need, max_items, claim_args)
                self.counts["now"] += 1
                return meta
            except Timeout:
                pass
        w = _Waiter(asyncio.get_running_loop(), int(max_rows), need, max_items, timeout)
        queue.add(w)
        meta = await w.future
        self.counts["queued"] += 1
        return meta

    async def _claim_now(
        self, stage: str, max_rows: int, min_rows: int | None, max_items: int | None, extra: dict
    ) -> Claim:
        call = functools.partial(
            self.dock.claim, stage, max_rows, timeout=0.0, min_rows=min_rows, max_items=max_items, **extra
        )
        if self.inline_claims:
            return call()
        return await self._io(call)

    def _queue(self, stage: str, extra: dict[str, Any]) -> _Queue:
        key: Any = (stage, tuple(sorted((k, repr(v)) for k, v in extra.items()))) if extra else stage
        q = self._queues.get(key)
        if q is None:
            with self._lock:
                q = self._queues.setdefault(key, _Queue(self, key, stage, dict(extra)))
        return q

    def _resolve(self, w: _Waiter, got: Claim | BaseException) -> None:
        """From a dispatcher thread: completes the waiter's future on its loop; rows claimed for a waiter
        that is gone (cancelled, loop closed) go back to the stage."""

        def settle() -> None:
            if not w.future.done():
                if isinstance(got, BaseException):
                    w.future.set_exception(got)
                else:
                    w.future.set_result(got)
            elif not isinstance(got, BaseException) and len(got):
                self._give_back(got)

        try:
            w.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the waiter's loop is closed
            if not isinstance(got, BaseException) and len(got):
                self._give_back(got)

    def _give_back(self, meta: Claim) -> None:
        with contextlib.suppress(MsrlError):
            self.dock.release(meta)

    # ---- data ------------------------------------------------------------------------------

    async def _io(self, call: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, call)
        # asyncio.wait, not wait_for: a Timeout raised by the call itself (a TimeoutError too) must reach
        # the caller as it is, not be taken for this deadline.
        done, _ = await asyncio.wait({fut}, timeout=self.io_timeout)
        if not done:
            fut.cancel()
            raise Timeout(
                f"dock call did not finish within io_timeout={self.io_timeout} s (it may still complete)"
            )
        return fut.result()

    async def fetch(self, meta: Any, columns: Sequence[str] | None = None, **fetch_args: Any) -> Batch:
        """``Dock.fetch`` on the thread pool (``layout=``, ``output=``, ... as there)."""
        return await self._io(functools.partial(self.dock.fetch, meta, columns, **fetch_args))

    async def put(self, data: Mapping[str, Any], rows: Any = None, **put_args: Any) -> Any:
        """``Dock.put`` on the thread pool; a put with a Claim completes that claim, as there."""
        return await self._io(functools.partial(self.dock.put, data, rows, **put_args))

    async def get(self, keys: Any, columns: Sequence[str] | None = None, **get_args: Any) -> Any:
        """``Dock.get`` (keyed read, where the dock has it) on the thread pool."""
        get = getattr(self.dock, "get", None)
        if get is None:
            raise InvalidArgument("this Dock has no keyed get(); use claim + fetch")
        return await self._io(functools.partial(get, keys, columns, **get_args))

    async def take(
        self,
        stage: str,
        max_rows: int,
        timeout: float = 0.0,
        min_rows: int | None = None,
        columns: Sequence[str] | None = None,
        max_items: int | None = None,
        fetch_args: Mapping[str, Any] | None = None,
        **claim_args: Any,
    ) -> Batch:
        """claim + fetch; a fetch that fails (or is cancelled, or passes ``io_timeout``) after the claim
        releases it: an error leaves nothing claimed. ``fetch_args`` go to ``Dock.fetch``."""
        meta = await self.claim(stage, max_rows, timeout, min_rows, max_items, **claim_args)
        try:
            return await self.fetch(meta, columns, **dict(fetch_args or {}))
        except BaseException:
            if len(meta):
                self._give_back(meta)
            raise

    async def batches(
        self,
        stage: str,
        max_rows: int,
        timeout: float,
        min_rows: int | None = None,
        columns: Sequence[str] | None = None,
        max_items: int | None = None,
        fetch_args: Mapping[str, Any] | None = None,
        **claim_args: Any,
    ) -> AsyncIterator[Batch]:
        """``take`` in a loop: yields Batches until no rows come within ``timeout`` seconds (``Timeout``)
        or the dock or this AsyncDock is closed (``Closed``), then ends. ``timeout`` must be > 0."""
        if _check_timeout("timeout", timeout) == 0:
            raise InvalidArgument("batches() needs timeout > 0: it ends when no rows come within it")
        while True:
            try:
                batch = await self.take(
                    stage, max_rows, timeout, min_rows, columns, max_items, fetch_args, **claim_args
                )
            except (Timeout, Closed):
                return
            yield batch

    # ---- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Fails waiting claims with ``Closed``, stops the dispatchers and the own thread pool. The dock
        itself stays open (it belongs to the caller)."""
        self.closed = True
        with self._lock:
            queues = list(self._queues.values())
        for q in queues:
            with q.cond:
                q.cond.notify_all()
        if self._own_executor:
            self._executor.shutdown(wait=False)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncDock:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
