"""msrl_core.dock.aio: awaitable claim / fetch / put / take over the Dock, with deadlines."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.dock.aio import AsyncDock
from msrl_core.errors import Closed, InvalidArgument, NotFound, Timeout

GROUP = 4


def make_dock(capacity: int = 512, **kw) -> Dock:
    return Dock(
        columns={"prompts": Column("int64", ragged=True, max_len=8), "rewards": Column("float32")},
        stages={"score": ["prompts"], "update": ["prompts", "rewards"]},
        capacity=capacity,
        group_size=GROUP,
        warehouses=2,
        **kw,
    )


def prompts(rows: int, start: int = 0) -> dict:
    return {"prompts": [np.full(1 + (i % 3), start + i, np.int64) for i in range(rows)]}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def drain_with_64_claimers(dock: Dock, total: int) -> collections.Counter:

    async def main() -> collections.Counter:
        adock = AsyncDock(dock)
        seen: collections.Counter = collections.Counter()
        read: dict[int, list[int]] = {}  # row -> the prompt a claimer fetched
        written: dict[int, list[int]] = {}  # row -> the prompt put there
        done = asyncio.Event()
        calls = collections.Counter()

        async def claimer(i: int) -> None:
            while not done.is_set():
                calls[i] += 1
                try:
                    meta = await adock.claim("score", max_rows=2 * GROUP, timeout=0.5)
                except Timeout:
                    continue  # the deadline passed with nothing ready, as the sync call
                assert len(meta) in (GROUP, 2 * GROUP)
                batch = await adock.fetch(meta)
                for k, r in enumerate(meta.rows.tolist()):
                    read[r] = batch["prompts"][k].tolist()
                seen.update(meta.rows.tolist())
                await adock.put({"rewards": np.ones(len(meta), np.float32)}, rows=meta)
                if sum(seen.values()) >= total:
                    done.set()

        async def producer() -> None:
            for start in range(0, total, 64):  # rows arrive while the claimers wait
                data = prompts(64, start)
                rows = await adock.put(data)
                written.update(zip(rows.tolist(), (p.tolist() for p in data["prompts"])))
                await asyncio.sleep(0.002)

        claimers = [asyncio.create_task(claimer(i)) for i in range(64)]
        await producer()
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.gather(*claimers)
        adock.close()
        assert len(calls) == 64
        assert read == written  # every row's own data
        assert adock.counts["queued"] > 0  # claims waited in the dispatcher's queue
        return seen

    return run(main())


def test_64_claimers_drain_a_stage_exactly_once_while_rows_arrive():
    dock = make_dock(capacity=1024)
    total = 1024
    seen = drain_with_64_claimers(dock, total)
    assert sorted(seen) == list(range(total)) and set(seen.values()) == {1}  # every row once
    assert dock.progress()["score"] == {"ready_rows": 0, "consumed_rows": total, "waiting_claims": 0}
    assert dock.progress()["update"]["ready_rows"] == total  # the puts with the claims landed


def test_claim_without_wait_and_with_ready_rows():
    dock = make_dock()

    async def main():
        adock = AsyncDock(dock)
        empty = await adock.claim("score", max_rows=8)  # timeout 0: never waits, may be empty
        assert len(empty) == 0
        rows = await adock.put(prompts(8))
        meta = await adock.claim("score", max_rows=8, timeout=1.0)
        assert sorted(meta.rows.tolist()) == sorted(rows.tolist()) and meta.stage == "score"
        assert adock.counts == {"now": 2}  # rows were ready: served at once, no queue
        adock.close()

    run(main())


def test_deadlines_raise_timeout_and_claim_nothing():
    dock = make_dock()

    async def main():
        adock = AsyncDock(dock)
        await adock.put(prompts(4))
        t0 = time.monotonic()
        with pytest.raises(Timeout, match="min_rows 8"):
            await adock.claim("score", max_rows=8, timeout=0.3, min_rows=8)
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 5.0
        assert dock.progress()["score"]["ready_rows"] == 4  # the timed-out claim took nothing
        with pytest.raises(Timeout, match="timed out after 0.2 s"):
            await adock.claim("update", max_rows=8, timeout=0.2)  # rewards never come
        sync_msg = ""
        try:
            dock.claim("update", max_rows=8, timeout=0.2)
        except Timeout as e:
            sync_msg = str(e)
        assert "timed out after 0.2 s" in sync_msg  # the same error as the sync call
        adock.close()

    run(main())


def test_waiters_are_served_while_the_loop_keeps_running():
    dock = make_dock()

    async def main():
        adock = AsyncDock(dock)
        waiter = asyncio.create_task(adock.claim("score", max_rows=4, timeout=5.0))
        ticks = 0
        for _ in range(20):  # the loop is free while the claim waits
            await asyncio.sleep(0.005)
            ticks += 1
        assert not waiter.done() and ticks == 20
        threading.Thread(target=dock.put, args=(prompts(4, 100),)).start()  # a put from another thread
        meta = await waiter
        assert len(meta) == 4
        adock.close()

    run(main())


def test_cancelled_waiters_lose_no_rows():
    dock = make_dock()

    async def main():
        adock = AsyncDock(dock)
        waiters = [asyncio.create_task(adock.claim("score", max_rows=GROUP, timeout=5.0)) for _ in range(16)]
        await asyncio.sleep(0.05)
        for w in waiters[:8]:
            w.cancel()
        rows = await adock.put(prompts(8 * GROUP))
        got = await asyncio.gather(*waiters[8:])
        claimed = sorted(r for m in got for r in m.rows.tolist())
        assert claimed == sorted(rows.tolist())  # the cancelled waiters held none of them
        assert all(w.cancelled() for w in waiters[:8])
        adock.close()

    run(main())
    assert dock.progress()["score"]["ready_rows"] == 0


def test_take_releases_the_claim_when_fetch_fails():
    dock = make_dock()

    async def main():
        adock = AsyncDock(dock)
        await adock.put(prompts(4))
        with pytest.raises(NotFound, match="unknown column 'nope'"):
            await adock.take("score", max_rows=4, timeout=1.0, columns=["nope"])
        assert dock.progress()["score"]["ready_rows"] == 4  # released: claimable again
        batch = await adock.take("score", max_rows=4, timeout=1.0, fetch_args={"layout": "padded"})
        assert batch.stage == "score" and batch["prompts"].values.shape == (4, 3)
        adock.close()

    run(main())


def test_io_deadline_and_bad_arguments():
    class SlowDock:
        group_size = 1

        def fetch(self, meta, columns=None):
            time.sleep(0.5)

        def put(self, data, rows=None):
            raise Timeout("the dock's own deadline")  # not io_timeout's

    async def main():
        adock = AsyncDock(SlowDock(), io_timeout=0.05)  # type: ignore[arg-type]
        with pytest.raises(Timeout, match="io_timeout=0.05"):
            await adock.fetch([0])
        with pytest.raises(Timeout, match="the dock's own deadline"):
            await adock.put({})
        with pytest.raises(InvalidArgument, match="keyed get"):
            await adock.get(["k"])
        adock.close()

    run(main())
    with pytest.raises(InvalidArgument, match="io_timeout"):
        AsyncDock(make_dock(), io_timeout=float("inf"))

    async def bad():
        adock = AsyncDock(make_dock())
        for t in (-1, float("nan"), "soon"):
            with pytest.raises(InvalidArgument, match="timeout must be a finite number"):
                await adock.claim("score", 4, timeout=t)
        with pytest.raises(NotFound, match="unknown stage 'nope'"):
            await adock.claim("nope", 4, timeout=1.0)
        adock.close()

    run(bad())


def test_close_fails_waiting_claims_and_dock_close_wakes_them():
    async def main():
        dock = make_dock()
        adock = AsyncDock(dock)
        waiter = asyncio.create_task(adock.claim("score", max_rows=4, timeout=10.0))
        await asyncio.sleep(0.05)
        adock.close()
        with pytest.raises(Closed, match="AsyncDock is closed"):
            await waiter
        with pytest.raises(Closed):
            await adock.claim("score", 4, timeout=1.0)
        dock2 = make_dock()
        adock2 = AsyncDock(dock2)
        waiter = asyncio.create_task(adock2.claim("score", max_rows=4, timeout=10.0))
        await asyncio.sleep(0.05)
        dock2.close()
        with pytest.raises(Closed, match="dock (is|was) closed"):
            await waiter
        adock2.close()

    run(main())


def test_claims_from_two_event_loops_in_two_threads_share_a_stage_exactly_once():
    dock = make_dock(capacity=256)
    adock = AsyncDock(dock, inline_claims=False)
    got: list[list[int]] = [[], []]

    def worker(i: int) -> None:
        async def main():
            while True:
                try:
                    meta = await adock.claim("score", max_rows=GROUP, timeout=0.5)
                except Timeout:
                    return
                got[i].extend(meta.rows.tolist())

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for start in range(0, 256, 32):
        dock.put(prompts(32, start))
    for t in threads:
        t.join(30)
    adock.close()
    assert sorted(got[0] + got[1]) == list(range(256))


@pytest.mark.slow  # one local Ray instance: 10-25 s on the shared 2-core machine
def test_64_claimers_drain_a_ray_stage_and_two_ray_partitions_exactly_once():
    ray = pytest.importorskip("ray")
    from dock_util import init_local_ray

    started = not ray.is_initialized()
    if started:
        init_local_ray(100)
    try:
        dock = make_dock(capacity=256, backend="ray")
        seen = drain_with_64_claimers(dock, 256)
        assert sorted(seen) == list(range(256)) and set(seen.values()) == {1}
        assert dock.progress()["score"]["consumed_rows"] == 256
        dock.shutdown()
        keyed = Dock(stages={"score": ["prompts"]}, capacity=256, group_size=GROUP, backend="ray")
        drain_two_partitions(keyed, per_part=96)  # the keyed store on Ray: partitions apart, once each
        keyed.shutdown()
    finally:
        if started:
            ray.shutdown()


def test_batches_streams_until_no_rows_come_within_the_deadline():
    dock = make_dock()

    async def main():
        adock = AsyncDock(dock)
        rows = await adock.put(prompts(16))
        seen = []
        async for batch in adock.batches("score", max_rows=8, timeout=0.2, fetch_args={"layout": "padded"}):
            assert batch.stage == "score" and batch["prompts"].values.shape[0] == len(batch.rows)
            seen.extend(batch.rows.tolist())
            await adock.put({"rewards": np.zeros(len(batch.rows), np.float32)}, rows=batch)
        assert sorted(seen) == sorted(rows.tolist())
        assert dock.progress()["update"]["ready_rows"] == 16
        with pytest.raises(InvalidArgument, match="timeout > 0"):
            async for _ in adock.batches("score", max_rows=8, timeout=0):
                pass
        adock.close()

    run(main())


def test_64_claimers_on_two_partitions_of_the_keyed_dock_drain_each_exactly_once():
    drain_two_partitions(Dock(stages={"score": ["prompts"]}, capacity=512, group_size=GROUP))


def drain_two_partitions(dock: Dock, per_part: int = 192) -> None:
    for part in "ab":
        dock.create_partition(part)

    async def main():
        adock = AsyncDock(dock)
        seen = {"a": collections.Counter(), "b": collections.Counter()}
        done = {"a": asyncio.Event(), "b": asyncio.Event()}

        async def claimer(part: str) -> None:
            while not done[part].is_set():
                try:
                    meta = await adock.claim("score", max_rows=GROUP, timeout=0.3, partition=part)
                except Timeout:
                    continue
                assert meta.partition == part
                batch = await adock.fetch(meta)
                keys = dock.keys_of(meta.rows, partition=part)
                for k, key in enumerate(keys):  # every row holds its own key's data
                    assert batch["prompts"][k].tolist() == [int(key[1:])] * (1 + int(key[1:]) % 3)
                seen[part].update(keys)
                await adock.put({"rewards": np.ones(len(meta), np.float32)}, rows=meta)
                if sum(seen[part].values()) >= per_part:
                    done[part].set()

        tasks = [asyncio.create_task(claimer("ab"[i % 2])) for i in range(64)]
        for start in range(0, per_part, 32):  # both partitions fill while the claimers wait
            for part in "ab":
                keys = [f"{part}{i}" for i in range(start, start + 32)]
                data = {"prompts": [np.full(1 + i % 3, i, np.int64) for i in range(start, start + 32)]}
                await adock.put(data, partition=part, keys=keys)
            await asyncio.sleep(0.002)
        await asyncio.wait_for(asyncio.gather(*(done[p].wait() for p in "ab")), 30)
        await asyncio.gather(*tasks)
        adock.close()
        return seen

    seen = run(main())
    for part in "ab":
        assert sorted(seen[part]) == sorted(f"{part}{i}" for i in range(per_part))  # no row crossed
        assert set(seen[part].values()) == {1}  # exactly once within the partition
        assert dock.progress(part)["score"]["consumed_rows"] == per_part


def test_dp_claims_and_keyed_get_pass_through():
    dock = Dock(
        columns={"responses": Column("int64", ragged=True, max_len=8)},
        stages={"update": ["responses"]},
        capacity=16,
        group_size=2,
        balance_by="responses",
    )
    dock.create_partition("p")

    async def main():
        adock = AsyncDock(dock, idle_s=0.1)
        calls = [
            adock.claim(
                "update", 8, timeout=5.0, partition="p", dp_rank=r, dp_size=2, batch=0, ranks_per_replica=2
            )
            for r in (0, 1)
            for _ in range(2)
        ]
        tasks = [asyncio.create_task(c) for c in calls]  # all four ranks wait before any row exists
        await asyncio.sleep(0.05)
        lens = [5, 1, 4, 4, 2, 2, 7, 3]
        data = {"responses": [np.arange(n) for n in lens for _ in range(2)]}
        await adock.put(data, partition="p", keys=list(range(16)))
        shares = await asyncio.gather(*tasks)
        assert shares[0].rows.tolist() == shares[1].rows.tolist()  # the ranks of replica 0
        assert shares[2].rows.tolist() == shares[3].rows.tolist()  # the ranks of replica 1
        r0, r1 = set(shares[0].rows.tolist()), set(shares[2].rows.tolist())
        assert not r0 & r1 and len(r0 | r1) == 16
        got = await adock.get([3, 0], ["responses"], partition="p")
        assert [row.tolist() for row in got["responses"]] == [list(range(1)), list(range(5))]
        assert len(adock._queues) == 2  # one waiting kind per dp_rank of this round
        await asyncio.sleep(adock.idle_s + 0.5)
        assert len(adock._queues) == 0  # idle kinds are forgotten: one per DP round would pile up
        adock.close()

    run(main())
