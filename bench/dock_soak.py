"""Soak of the dock's Ray backend: many iterations, a new thread pool every step, actors' resources flat.

  python bench/dock_soak.py [--steps 1000] [--workers 8] [--sample-every 50]

Each step puts 8 prompt groups, a thread pool made anew runs `--workers` rollout workers (claim, fetch,
put responses with the claim), the update stage takes everything and completes it, and the dock is reset.
Every `--sample-every` steps the controller's and warehouses' OS threads, open fds, open wire
connections and PSS are sampled. After warm-up (the first 10% of the steps) each must stay flat: threads
and fds within +2, PSS within +8 MiB of the post-warm-up sample. Prints JSON lines and exits non-zero when
a figure is not flat.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray

from msrl_core import Column, Dock

G = 4


def step(dock: Dock, workers: int) -> None:
    rows = dock.put({"prompts": [np.arange(16 + i % 7, dtype=np.int64) for i in range(8 * G)]})

    def rollout() -> int:
        meta = dock.claim("gen", max_rows=G)  # the rows are ready: never waits
        if len(meta) == 0:
            return 0
        batch = dock.fetch(meta)
        dock.put({"responses": [p * 2 for p in batch["prompts"]]}, rows=meta)
        return len(meta)

    done = 0
    while done < len(rows):
        with ThreadPoolExecutor(max_workers=workers) as pool:  # a new pool (new threads) every round
            done += sum(pool.map(lambda _: rollout(), range(workers)))
    upd = dock.take("update", max_rows=len(rows), timeout=10.0, min_rows=len(rows))
    assert all((r == p * 2).all() for r, p in zip(upd["responses"], upd["prompts"]))
    dock.complete(upd)
    dock.reset()


def sample(dock: Dock) -> list[dict]:
    b = dock._backend  # the actors' own diagnostics (benchmark only)
    return ray.get([h.diagnostics.remote() for h in [b.controller, *b.warehouses]])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=50)
    args = ap.parse_args()
    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    dock = Dock(
        columns={c: Column("int64", ragged=True, max_len=32) for c in ("prompts", "responses")},
        stages={"gen": ["prompts"], "update": ["prompts", "responses"]},
        capacity=8 * G,
        group_size=G,
        warehouses=2,
        backend="ray",
    )
    warm = max(1, args.steps // 10)
    samples: list[tuple[int, list[dict]]] = []
    t0 = time.perf_counter()
    for s in range(1, args.steps + 1):
        step(dock, args.workers)
        if s == warm or s % args.sample_every == 0 or s == args.steps:
            samples.append((s, sample(dock)))
            names = ["controller"] + [f"warehouse {w}" for w in range(len(samples[-1][1]) - 1)]
            for name, d in zip(names, samples[-1][1]):
                row = {"step": s, "actor": name, "threads": d["threads"], "fds": d["fds"]}
                row.update(pss_mib=round(d["pss_bytes"] / 2**20, 2), open_conns=d["wire"]["open"])
                print(json.dumps(row), flush=True)
    wall = time.perf_counter() - t0
    base = next(smp for st, smp in samples if st >= warm)
    worst = {"threads": 0, "fds": 0, "pss_mib": 0.0}
    for _, smp in samples:
        for d0, d in zip(base, smp):
            worst["threads"] = max(worst["threads"], d["threads"] - d0["threads"])
            worst["fds"] = max(worst["fds"], d["fds"] - d0["fds"])
            worst["pss_mib"] = max(worst["pss_mib"], (d["pss_bytes"] - d0["pss_bytes"]) / 2**20)
    flat = worst["threads"] <= 2 and worst["fds"] <= 2 and worst["pss_mib"] <= 8
    summary = {"case": "soak", "steps": args.steps, "workers": args.workers, "warm_up_steps": warm}
    summary.update(wall_s=round(wall, 1), max_growth_after_warm_up=worst, flat=flat)
    print(json.dumps(summary), flush=True)
    dock.shutdown()
    ray.shutdown()
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
