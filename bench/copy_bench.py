"""Fused copy plans vs the per-slice torch loop they replace, and (on a GPU) engine vs torch copies.

Prints one JSON line per case: case, backend, bytes, gbps_median, baseline, baseline_gbps_median, ratio,
reps, statistic. Data is verified after timing. Usage: python bench/copy_bench.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

import msrl_core


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def emit(case: str, backend: str, nbytes: int, secs: float, baseline: str, base_secs: float, **extra) -> None:
    g, bg = nbytes / secs / 1e9, nbytes / base_secs / 1e9
    row = dict(
        case=case,
        backend=backend,
        bytes=nbytes,
        gbps_median=round(g, 3),
        baseline=baseline,
        baseline_gbps_median=round(bg, 3),
        ratio=round(g / bg, 3),
        statistic="median",
        **extra,
    )
    print(json.dumps(row), flush=True)


def slices_case(engine: msrl_core.CopyEngine, reps: int, scattered: bool) -> None:
    k, slice_bytes = 10_000, 4096
    src = torch.randint(0, 255, (2 * k, slice_bytes), dtype=torch.uint8)
    order = np.random.default_rng(5).permutation(k) if scattered else np.arange(k)
    src_rows = (2 * order).tolist()
    dst_plan = torch.zeros(k, slice_bytes, dtype=torch.uint8)
    dst_loop = torch.zeros(k, slice_bytes, dtype=torch.uint8)
    plan = msrl_core.CopyPlan(
        msrl_core.descriptors(
            src_offset=2 * order * slice_bytes, dst_offset=np.arange(k) * slice_bytes, row_bytes=slice_bytes
        )
    )

    def loop():
        for i, j in enumerate(src_rows):
            dst_loop[i].copy_(src[j])

    base = median_seconds(loop, reps)
    secs = median_seconds(lambda: engine.execute(plan, dst_plan, src).wait(timeout=60), reps)
    want = src[torch.as_tensor(src_rows)]
    assert torch.equal(dst_plan, want) and torch.equal(dst_loop, want), "slice data mismatch"
    emit(
        "plan_10k_" + ("scattered" if scattered else "strided") + "_4KiB_vs_torch_copy_loop",
        engine.runtime.name,
        k * slice_bytes,
        secs,
        "torch_copy_per_slice_python_loop",
        base,
        reps=reps,
        descriptors_coalesced=len(plan),
    )


def gpu_cases(engine: msrl_core.CopyEngine, reps: int, device: str = "cuda") -> None:
    """Engine vs torch on an NVIDIA GPU, 256 MiB: pinned H2D/D2H (torch ``pin_memory()`` buffers, which the
    engine must copy directly: ``bounced_bytes`` is reported), pageable H2D/D2H (through the bounce buffers
    vs torch's own pageable copies). Baselines synchronise, as the engine's ticket waits do.
    ``device="cpu"``: a dry run of the same code on host memory (16 MiB; not a GPU figure)."""
    cuda = device == "cuda"
    n = (256 if cuda else 16) << 20
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    pinned = torch.randint(0, 255, (n,), dtype=torch.uint8)
    pinned = pinned.pin_memory() if cuda else pinned
    pageable = pinned.clone()
    back = torch.empty(n, dtype=torch.uint8)

    def timed_torch(fn):
        def run():
            fn()
            if cuda:
                torch.cuda.synchronize()

        return median_seconds(run, reps)

    def engine_copy(dst, src):
        engine.copy(dst, src).wait(timeout=60)

    def case(name, dst, src, baseline, base_fn):
        before = engine.stats()["bounced_bytes"]
        secs = median_seconds(lambda: engine_copy(dst, src), reps)
        bounced = (engine.stats()["bounced_bytes"] - before) // (reps + 1)
        base = timed_torch(base_fn)
        extra = {} if cuda else {"dry_run": "host memory both sides: not a GPU figure"}
        emit(name, engine.runtime.name, n, secs, baseline, base, reps=reps, bounced_bytes=bounced, **extra)

    nb = "torch_copy_non_blocking"
    case("h2d_pinned_vs_torch", dev, pinned, nb, lambda: dev.copy_(pinned, non_blocking=True))
    case("d2h_pinned_vs_torch", pinned, dev, nb, lambda: pinned.copy_(dev, non_blocking=True))
    engine_copy(back, dev)
    assert torch.equal(back, pageable), "gpu pinned round trip: data mismatch"
    case("h2d_pageable_bounce_vs_torch", dev, pageable, "torch_pageable_to", lambda: pageable.to(device))
    case("d2h_pageable_bounce_vs_torch", back, dev, "torch_pageable_copy", lambda: back.copy_(dev))
    assert torch.equal(back, pageable), "gpu pageable round trip: data mismatch"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--host-dry-run", action="store_true", help="the GPU cases on host memory (no GPU)")
    args = ap.parse_args()
    engine = msrl_core.CopyEngine()
    print(
        json.dumps(
            {
                "meta": True,
                "torch": torch.__version__,
                "msrl_core": msrl_core.__version__,
                "machine": platform.machine(),
                "processor": platform.processor(),
                "runtime": msrl_core.runtime_info()["selected"],
            }
        ),
        flush=True,
    )
    slices_case(engine, args.reps, scattered=False)
    slices_case(engine, args.reps, scattered=True)
    if engine.runtime.name == "cuda" and torch.cuda.is_available():
        gpu_cases(engine, args.reps)
    elif args.host_dry_run:
        gpu_cases(engine, args.reps, device="cpu")


if __name__ == "__main__":
    main()
