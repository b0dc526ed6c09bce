"""allgather-swap on one accelerator (prepared for a lent GPU machine; runs on the CPU as a smoke test).

One process, the bench model (Llama-style, ~112 M parameters at the defaults) on ``--device``, TP_t 1 ->
TP_i 1 (vLLM layout). Prints one JSON line per case:

- ``swap_out`` / ``swap_in``: the switch's swap GB/s vs torch copying the same bytes into / out of one pinned
  host buffer (``copy_(non_blocking=True)`` + synchronize; on the CPU a plain ``copy_``);
- ``measured_peak``: ``measure=True`` (CUDA: ``max_memory_allocated``) vs shard + inference + one bucket;
- ``pipelined_vs_not``: the reshard with and without overlap, interleaved, medians;
- ``stream_buckets``: streaming into preallocated engine weights, measured peak vs gather + output scratch;
- ``switch_verified`` (``--verify``): one ``switch(..., verify=True)``: the inference buffer checked against
  the reference reshard, the training weights against their CRCs after the swap back;
- ``switch_vs_naive``: the switch (no swap) vs ``naive_reshard`` (torch gathers + slicing per parameter, the
  torch baseline), interleaved, medians.

    python bench/reshard_gpu_check.py [--device cuda] [--layers 10] [--reps 5] [--bucket-mib 16] [--verify]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(dev, reps: int, *fns) -> list[float]:
    """Median seconds of each of ``fns``, run in turn ``reps`` times, each call synchronised."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, acc in zip(fns, times):
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--verify", action="store_true", help="one switch with verify=True")
    args = ap.parse_args()
    import torch

    from msrl_core.reshard import (
        MemoryProbe,
        Parallel,
        Switcher,
        megatron_to_vllm,
        naive_reshard,
        reference,
        spec,
        stream_buckets,
    )

    dev = torch.device(args.device)
    from reshard_bench import bench_model  # bench/ is on sys.path when this runs as a script

    cfg = bench_model(args.layers)
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=1))
    g = torch.Generator().manual_seed(0)
    params = {
        n: torch.randn(s, generator=g).to(dev) for n, s, _ in spec.megatron_stage_params(cfg, plan.train, 0)
    }
    snap = {n: p.cpu() for n, p in params.items()}
    bucket = args.bucket_mib << 20
    flat, views = plan.allocate_inference(0, device=dev)
    sw = Switcher(plan)
    common = dict(device=str(dev), torch=torch.__version__, layers=args.layers, bucket_mib=args.bucket_mib)
    if dev.type == "cuda":
        common["gpu"] = torch.cuda.get_device_name(dev)

    def emit(**row) -> None:
        print(json.dumps({**row, **common}), flush=True)

    # swap out / in vs torch pinned copies of the same bytes (warm-up switch allocates the mirrors)
    sw.switch(params, flat, {}, bucket).swap_back().wait()
    nbytes = sum(p.nbytes for p in params.values())
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    outs, ins, t_d2h, t_h2d = [], [], [], []
    for _ in range(args.reps):
        s = sw.switch(params, flat, {}, bucket)
        t0 = time.perf_counter()
        s.swap_back()
        s.wait()
        _sync(dev)
        ins.append(time.perf_counter() - t0)
        outs.append(s.telemetry.swap_out_s)
        _sync(dev)
        t0 = time.perf_counter()
        host.copy_(dev_flat, non_blocking=True)
        _sync(dev)
        t_d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dev_flat.copy_(host, non_blocking=True)
        _sync(dev)
        t_h2d.append(time.perf_counter() - t0)
    ok = all(torch.equal(params[n].cpu(), snap[n]) for n in snap)
    for case, mine, base in (("swap_out", outs, t_d2h), ("swap_in", ins, t_h2d)):
        m, b = statistics.median(mine), statistics.median(base)
        emit(
            case=case,
            bytes=nbytes,
            gbps=nbytes / m / 1e9,
            torch_pinned_gbps=nbytes / b / 1e9,
            ratio=b / m,
            ok=ok,
        )

    # measured peak of the switch vs the bound
    s = sw.switch(params, flat, {}, bucket, measure=True)
    t = s.telemetry
    s.swap_back().wait()
    emit(
        case="measured_peak",
        measured_peak_bytes=t.measured_peak_bytes,
        measured_switch_bytes=t.measured_switch_bytes,
        bound_bytes=t.train_bytes + t.infer_bytes + t.scratch_bytes,
        mirror_bytes=t.mirror_bytes,
        within_bound=t.measured_peak_bytes <= t.train_bytes + t.infer_bytes + t.scratch_bytes + (4 << 10),
    )

    if args.verify:  # inference buffer vs the reference reshard; training weights vs CRCs after the swap back
        s = sw.switch(params, flat, {}, bucket, verify=True)
        s.swap_back().wait()
        emit(
            case="switch_verified",
            verified_infer=bool(s.telemetry.verified_infer),
            training_intact=all(torch.equal(params[n].cpu(), snap[n]) for n in snap),
        )

    # the switch vs the naive per-parameter path (the torch baseline), interleaved
    ours, naive = interleaved(
        dev,
        args.reps,
        lambda: sw.switch(params, flat, {}, bucket, swap=False),
        lambda: naive_reshard(params, plan, {}, 0),
    )
    emit(case="switch_vs_naive", seconds=ours, naive_seconds=naive, ratio=naive / ours)

    # pipelined vs not, interleaved
    plain, piped = interleaved(
        dev,
        args.reps,
        lambda: sw.switch(params, flat, {}, bucket, swap=False, pipeline=False),
        lambda: sw.switch(params, flat, {}, bucket, swap=False, pipeline=True),
    )
    emit(case="pipelined_vs_not", pipelined_s=piped, plain_s=plain, speedup=plain / piped)

    # streamed buckets into the engine's own (preallocated) weights
    exp = reference.hf_to_vllm(
        cfg, plan.infer, 0, reference.megatron_to_hf(cfg, plan.train, {(0, 0, 0): snap})
    )
    engine_w = {n: torch.empty_like(v, device=dev) for n, v in exp.items()}
    stream = stream_buckets(params, plan, {}, bucket_bytes=bucket)
    t0 = time.perf_counter()
    with MemoryProbe(dev) as probe:
        for b in stream:
            for n, v in b:
                engine_w[n].copy_(v)
    _sync(dev)
    st = stream.telemetry
    emit(
        case="stream_buckets",
        seconds=time.perf_counter() - t0,
        buckets=st.buckets,
        measured_peak_bytes=probe.peak_bytes,
        scratch_bytes=st.gather_scratch_bytes + st.output_scratch_bytes,
        equal=all(torch.equal(engine_w[n].cpu(), exp[n]) for n in exp),
    )


if __name__ == "__main__":
    main()
