"""Dock asyncio (msrl_core.dock.aio) vs the sync Dock: per-claim overhead, one run, ratios vs sync.

  python bench/dock_aio_bench.py [--rounds 7] [--claims 4096]

Cases (local backend, one JSON line each; medians over interleaved rounds, sync and async alternating):
  claim_ready   one group per claim with every row ready: sync ``Dock.claim(timeout=0)`` in a loop vs
                ``await AsyncDock.claim(timeout=1.0)`` in a loop in one event loop (the fast path).
  drain64       64 claimers wait on an empty stage; a producer thread puts groups (64 rows a put); the
                round lasts from the first put to the last row's claim: 64 sync threads vs 64 async
                tasks in one event loop (the dispatcher path). Round time / claims, producer included.
  wake1         one claimer waits on an empty stage, another thread puts one group 2 ms later: the time
                from the put's start to the claim's return (median of 200), sync vs async (dispatcher).
Timing covers the claims only (docks are built outside it); the rows claimed are verified (each
exactly once) after every round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import numpy as np

from dock_bench import emit
from msrl_core import Column, Dock
from msrl_core.dock.aio import AsyncDock
from msrl_core.errors import Closed, Timeout

GROUP = 4


def make_dock(capacity: int) -> Dock:
    return Dock(
        columns={"tok": Column("int32")},
        stages={"s": ["tok"]},
        capacity=capacity,
        group_size=GROUP,
        warehouses=2,
    )


def check_once(rows: list[int], put: list[int]) -> None:
    assert sorted(rows) == sorted(put), "a row was lost or claimed twice"


# ---- claim_ready --------------------------------------------------------------------------------


def sync_ready(claims: int) -> float:
    dock = make_dock(claims * GROUP)
    put = dock.put({"tok": np.zeros(claims * GROUP, np.int32)}).tolist()
    rows: list[int] = []
    t0 = time.perf_counter()
    for _ in range(claims):
        rows.extend(dock.claim("s", max_rows=GROUP).rows.tolist())
    dt = time.perf_counter() - t0
    check_once(rows, put)
    return dt / claims


def async_ready(claims: int) -> float:
    dock = make_dock(claims * GROUP)
    put = dock.put({"tok": np.zeros(claims * GROUP, np.int32)}).tolist()

    async def main() -> tuple[float, list[int]]:
        adock = AsyncDock(dock)
        rows: list[int] = []
        t0 = time.perf_counter()
        for _ in range(claims):
            rows.extend((await adock.claim("s", max_rows=GROUP, timeout=1.0)).rows.tolist())
        dt = time.perf_counter() - t0
        adock.close()
        return dt, rows

    dt, rows = asyncio.run(main())
    check_once(rows, put)
    return dt / claims


# ---- drain64 ------------------------------------------------------------------------------------


def producer(dock: Dock, total_rows: int, put: list[int], chunk: int = 64) -> threading.Thread:
    def run() -> None:
        for _ in range(0, total_rows, chunk):
            put.extend(dock.put({"tok": np.zeros(chunk, np.int32)}).tolist())

    return threading.Thread(target=run)


def sync_drain(claims: int, workers: int = 64) -> float:
    dock = make_dock(claims * GROUP)
    total = claims * GROUP
    got: list[list[int]] = [[] for _ in range(workers)]
    left = [total]
    end = [0.0]
    lock = threading.Lock()

    def worker(i: int) -> None:
        while True:
            try:
                meta = dock.claim("s", max_rows=GROUP, timeout=5.0)
            except (Timeout, Closed):
                return
            got[i].extend(meta.rows.tolist())
            with lock:
                left[0] -= len(meta)
                if left[0] == 0:
                    end[0] = time.perf_counter()
                    dock.close()  # wakes the other claimers: the round ends with its last claim

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    put: list[int] = []
    prod = producer(dock, total, put)
    for t in threads:
        t.start()
    time.sleep(0.05)  # every claimer is waiting
    t0 = time.perf_counter()
    prod.start()
    for t in [prod, *threads]:
        t.join()
    check_once([r for g in got for r in g], put)
    return (end[0] - t0) / claims


def async_drain(claims: int, workers: int = 64) -> float:
    dock = make_dock(claims * GROUP)
    total = claims * GROUP
    put: list[int] = []

    async def main() -> tuple[float, list[int]]:
        adock = AsyncDock(dock)
        rows: list[int] = []
        end = asyncio.get_running_loop().create_future()

        async def worker() -> None:
            while True:
                try:
                    meta = await adock.claim("s", max_rows=GROUP, timeout=5.0)
                except (Timeout, Closed):
                    return
                rows.extend(meta.rows.tolist())
                if len(rows) == total:
                    end.set_result(time.perf_counter())
                    adock.close()  # fails the other waiters: the round ends with its last claim

        prod = producer(dock, total, put)
        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        await asyncio.sleep(0.05)  # every claimer is waiting
        t0 = time.perf_counter()
        prod.start()
        t_end = await end
        await asyncio.gather(*tasks)
        prod.join()
        return t_end - t0, rows

    dt, rows = asyncio.run(main())
    check_once(rows, put)
    return dt / claims


# ---- wake1 --------------------------------------------------------------------------------------


def delayed_put(dock: Dock, t_put: list[float], delay: float = 0.002) -> threading.Thread:
    """A thread that puts one group after ``delay`` (the claimer is waiting by then), noting the time."""

    def run() -> None:
        time.sleep(delay)
        t_put.append(time.perf_counter())
        dock.put({"tok": np.zeros(GROUP, np.int32)})

    return threading.Thread(target=run)


def sync_wake(reps: int) -> float:
    dock = make_dock(reps * GROUP)
    lat: list[float] = []
    for _ in range(reps):
        t_put: list[float] = []
        putter = delayed_put(dock, t_put)
        putter.start()
        meta = dock.claim("s", max_rows=GROUP, timeout=5.0)
        lat.append(time.perf_counter() - t_put[0])
        putter.join()
        assert len(meta) == GROUP
    return statistics.median(lat)


def async_wake(reps: int) -> float:
    dock = make_dock(reps * GROUP)

    async def main() -> list[float]:
        adock = AsyncDock(dock)
        lat: list[float] = []
        for _ in range(reps):
            t_put: list[float] = []
            putter = delayed_put(dock, t_put)
            putter.start()
            meta = await adock.claim("s", max_rows=GROUP, timeout=5.0)
            lat.append(time.perf_counter() - t_put[0])
            putter.join()
            assert len(meta) == GROUP
        adock.close()
        return lat

    return statistics.median(asyncio.run(main()))


ROUND = "median over interleaved rounds of (round time / claims)"


def case(name: str, sync_fn, async_fn, rounds: int, claims: int, what: str, statistic: str = ROUND) -> None:
    sync_fn(min(claims, 256))  # warm-up (threads, allocator, dispatcher code paths)
    async_fn(min(claims, 256))
    s, a = [], []
    for _ in range(rounds):
        s.append(sync_fn(claims))
        a.append(async_fn(claims))
    sm, am = statistics.median(s), statistics.median(a)
    emit(
        case=name,
        backend="local",
        claims=claims,
        rows_per_claim=GROUP,
        rounds=rounds,
        what=what,
        sync_us_per_claim=round(sm * 1e6, 2),
        async_us_per_claim=round(am * 1e6, 2),
        ratio_async_over_sync=round(am / sm, 2),
        overhead_us_per_claim=round((am - sm) * 1e6, 2),
        statistic=statistic,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--claims", type=int, default=4096)
    args = ap.parse_args()
    case(
        "claim_ready", sync_ready, async_ready, args.rounds, args.claims, "claims with rows ready, one caller"
    )
    case(
        "drain64",
        sync_drain,
        async_drain,
        args.rounds,
        args.claims // 4,
        "64 claimers (sync: threads; async: tasks in one loop) drain a stage while a producer puts",
    )
    what = "one claimer waits; another thread puts a group: put start -> claim returns (incl. the put)"
    stat = "median over interleaved rounds of the round's median latency (200 claims a round)"
    case("wake1", sync_wake, async_wake, args.rounds, 200, what, stat)


if __name__ == "__main__":
    main()
