"""allgather-swap benchmark: bucketed plan vs per-parameter all-gather + torch slicing; swap vs memcpy.

Spawns ``--world`` processes over gloo (CPU, host runtime), builds random Megatron-layout shards of a
~112M-parameter Llama-style model (TP_t = world) and reshards them to the inference layout (TP_i = 1 by
default). Every case is timed on all ranks together (barrier before each run), warm-up first, then the
median of ``--reps`` runs; data is verified after timing. Prints one JSON line per case (rank 0's times;
``max_rank_s`` is the slowest rank's median).

    python bench/reshard_bench.py [--reps 5] [--world 2] [--infer-tp 1] [--bucket-mib 16] [--layers 10]
        [--model bench|e2e] [--swap-only] [--malloc default|keep|both]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "-C", here, "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def bench_model(layers: int = 10, model: str = "bench"):
    """The bench model: Llama-style, hidden 768, 12 heads / 4 KV heads, FFN 2048, vocab 32000 (112 M
    parameters at 10 layers), fp32. ``model="e2e"``: the model of ``bench/e2e_bench.py`` (hidden 512,
    8 heads / 4 KV heads, FFN 1536, the demo's 18-token vocabulary padded to 24, 13 M parameters at 4
    layers)."""
    from msrl_core.reshard import ModelConfig

    if model == "e2e":
        return ModelConfig(
            "llama",
            hidden_size=512,
            num_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1536,
            vocab_size=18,
            make_vocab_size_divisible_by=8,
        )
    return ModelConfig(
        "llama",
        hidden_size=768,
        num_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
    )


def _timed(fn, reps: int, dist) -> tuple[float, list[float]]:
    dist.barrier()
    fn()  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # one process per device shares the node's cores: each rank's copy threads get its share (set before
    # msrl_core starts its pool), as torch's intra-op threads are set to 1 below
    os.environ.setdefault("MSRL_COPY_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    import torch
    import torch.distributed as dist

    import msrl_core
    from msrl_core.reshard import Parallel, allgather_swap, megatron_to_vllm, naive_reshard, spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = bench_model(args.layers, args.model)
    train, infer = Parallel(tp=world), Parallel(tp=args.infer_tp)
    plan = megatron_to_vllm(cfg, train, infer)
    g = torch.Generator().manual_seed(1000 + rank)
    params = {n: torch.randn(s, generator=g) for n, s, _ in spec.megatron_stage_params(cfg, train, 0)}
    snap = {n: p.clone() for n, p in params.items()}
    nparams = sum(p.numel() for p in params.values()) * world  # approx (replicated norms counted twice)
    groups = {"tp": dist.group.WORLD if world > 1 else None}
    infer_rank = rank % infer.tp
    bucket = args.bucket_mib << 20
    flat, views = plan.allocate_inference(infer_rank)
    rows: list[dict] = []

    if not args.swap_only:
        # 1. bucketed reshard (no swap) vs naive per-parameter all_gather + torch slicing + copy into buffers
        def switch(**kw):
            """allgather_swap of this rank's parameters into its inference buffers (kw: the options)"""
            return allgather_swap(
                params, flat, plan, groups, bucket_bytes=bucket, infer_rank=infer_rank, **kw
            )

        def bucketed():
            switch(swap=False)

        def naive():
            out, _ = naive_reshard(params, plan, groups, infer_rank=infer_rank)
            for k, v in out.items():
                views[k].copy_(v)

        plan.native_plans(bucket, infer_rank)  # plan building is a one-off (cached), outside the timing
        t_b, _ = _timed(bucketed, args.reps, dist)
        t_n, _ = _timed(naive, args.reps, dist)
        ref = {k: v.clone() for k, v in views.items()}  # naive result

        def verified(fn) -> bool:
            """Runs ``fn`` into zeroed inference buffers; True when they then hold the naive result."""
            flat.zero_()
            fn()
            return all(torch.equal(views[k], ref[k]) for k in ref)

        ok = verified(bucketed)
        s = switch(swap=False)
        tele = s.telemetry
        rows.append(
            dict(
                case="reshard_bucketed_vs_naive",
                seconds_median=t_b,
                baseline="per-parameter all_gather + torch cat/slice + copy into inference buffers",
                baseline_seconds_median=t_n,
                speedup=t_n / t_b,
                verified=ok,
                infer_bytes=tele["infer_bytes"],
                train_bytes=tele["train_bytes"],
                bucket_scratch_bytes=tele["scratch_bytes"],
                buckets=tele["buckets"],
                descriptors=tele["descriptors"],
                gather=tele["gather"],
                gather_s=tele["gather_s"],
                pack_s=tele["pack_s"],
                copy_s=tele["copy_s"],
            )
        )

        # 1b. the same bucketed plan with the collective all_gather (what NCCL/HCCL groups use)
        def bucketed_collective():
            switch(swap=False, gather="all_gather")

        t_c, _ = _timed(bucketed_collective, args.reps, dist)
        ok_c = verified(bucketed_collective)
        rows.append(
            dict(
                case="reshard_bucketed_all_gather_vs_naive",
                seconds_median=t_c,
                baseline="per-parameter all_gather + torch cat/slice + copy into inference buffers",
                baseline_seconds_median=t_n,
                speedup=t_n / t_c,
                verified=ok_c,
            )
        )

        # 1c. pipelined buckets: gather bucket k+1 while the fused copy of bucket k runs (same run, same plan)
        def pipelined():
            switch(swap=False, pipeline=True)

        # interleaved (plain, pipelined) pairs, so drift on the shared machine hits both alike
        pipelined()
        bucketed()
        t_pls, t_nps = [], []
        for _ in range(args.reps):
            for fn, acc in ((bucketed, t_nps), (pipelined, t_pls)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        t_pl, t_np = statistics.median(t_pls), statistics.median(t_nps)
        ok_p = verified(pipelined)
        rows.append(
            dict(
                case="reshard_pipelined_vs_not",
                seconds_median=t_pl,
                baseline="the same bucketed reshard without overlap (one gather scratch)",
                baseline_seconds_median=t_np,
                speedup=t_np / t_pl,
                verified=ok_p,
                scratch_bytes_pipelined=2 * tele["scratch_bytes"],
            )
        )

        # 2. memory, measured (not summed): the switch vs the naive path, same run. MemoryProbe tallies every
        # storage torch allocates during the call; an RSS sampler (every 1 ms) cross-checks both, since gloo's
        # internal buffers and the pinned mirrors are not torch allocations. Steady state: the mirrors exist
        # (allocated by an earlier switch), and on the host runtime they are RAM like the "device" memory.
        from msrl_core.reshard import MemoryProbe

        def rss_peak(fn) -> tuple[int, int]:
            import threading

            page = os.sysconf("SC_PAGE_SIZE")

            def rss() -> int:
                with open("/proc/self/statm") as f:
                    return int(f.read().split()[1]) * page

            base, peak, stop = rss(), [0], threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss())
                    time.sleep(0.001)

            th = threading.Thread(target=sample)
            th.start()
            try:
                fn()
            finally:
                stop.set()
                th.join()
            return max(peak[0], rss()) - base, base

        for gather_mode in ("auto", "all_gather"):
            switch().swap_back().wait()
            holder: dict = {}

            def measured_switch(holder: dict = holder, gather_mode: str = gather_mode) -> None:
                holder["s"] = switch(measure=True, gather=gather_mode)

            dist.barrier()
            rss_switch, _ = rss_peak(measured_switch)
            s = holder["s"]
            t = s.telemetry
            s.swap_back().wait()
            dist.barrier()
            with MemoryProbe() as probe:
                rss_naive, _ = rss_peak(lambda: naive_reshard(params, plan, groups, infer_rank=infer_rank))
            naive_measured = t["train_bytes"] + t["infer_bytes"] + probe.peak_bytes
            honest = t["measured_peak_bytes"] + t["mirror_bytes"]  # host runtime: the mirrors are RAM too
            rows.append(
                dict(
                    case=f"switch_peak_bytes_vs_naive_measured_{t['gather']}",
                    measured_peak_bytes=t["measured_peak_bytes"],
                    measured_switch_bytes=t["measured_switch_bytes"],
                    bound_bytes=t["train_bytes"] + t["infer_bytes"] + t["scratch_bytes"],
                    accounted_peak_bytes=t["peak_bytes"],
                    mirror_bytes=t["mirror_bytes"],
                    freed_bytes=t["freed_bytes"],
                    host_runtime_peak_bytes=honest,
                    naive_measured_peak_bytes=naive_measured,
                    ratio_device=naive_measured / t["measured_peak_bytes"],
                    ratio_host_runtime=naive_measured / honest,
                    rss_delta_switch_bytes=rss_switch,
                    rss_delta_naive_bytes=rss_naive,
                    naive_accounted_bytes=naive_reshard(params, plan, groups, infer_rank=infer_rank)[1]
                    + flat.numel(),
                )
            )

    # 3. swap-out / swap-in (host runtime, pinned mirrors, persistent) vs copies of the same bytes,
    # interleaved so drift on the shared machine hits all alike. Baselines: (a) the copy engine's copy_many
    # from the same pinned mirrors into pre-faulted tensors of the same sizes (same threads, same copies:
    # what is left is re-materialising the storages); (b) torch's uint8 copy_ of all the bytes into one
    # pre-faulted buffer (torch intra-op threads: 1); (c) torch.empty + copy_ (allocation and first-touch
    # faults, like swap-in).
    import resource

    from msrl_core.reshard import Switcher

    sw = Switcher(plan)
    names = list(params)
    nbytes = sum(p.untyped_storage().nbytes() for p in params.values())
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.copy_(torch.cat([p.view(-1).view(torch.uint8) for p in params.values()]))
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in, like the persistent mirrors
    touched = [torch.empty_like(params[n]).view(-1).view(torch.uint8) for n in names]
    for t in touched:
        t.fill_(1)  # pre-faulted destinations of the same sizes
    acc: dict[str, list[float]] = {k: [] for k in ("out", "out_copy", "in", "engine", "mem", "fresh", "flt")}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for i in range(args.reps + 1):
        dist.barrier()
        s = sw.switch(params, flat, groups, bucket, infer_rank=infer_rank)
        dist.barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        s.swap_back().wait()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        mirrors = [
            torch.frombuffer(sw.mirrors[n], dtype=torch.uint8, count=t.numel())
            for n, t in zip(names, touched)
        ]
        t_eng = timed(lambda m=mirrors: sw.engine.copy_many(touched, m).wait(60))
        t_mem = timed(lambda: dst.copy_(src))

        def fresh() -> None:
            torch.empty(nbytes, dtype=torch.uint8).copy_(src)

        t_fresh = timed(fresh)
        if i:  # the first switch allocates the mirrors: warm-up
            for k, v in (
                ("out", s.telemetry["swap_out_s"]),
                ("out_copy", s.telemetry["swap_out_copy_s"]),
                ("in", s.telemetry["swap_in_s"]),
                ("engine", t_eng),
                ("mem", t_mem),
                ("fresh", t_fresh),
                ("flt", float(faults)),
            ):
                acc[k].append(v)
    med = {k: statistics.median(v) for k, v in acc.items()}
    restored = all(torch.equal(params[k], snap[k]) for k in snap)
    baselines = {
        "engine": "copy engine copy_many from the same pinned mirrors into pre-faulted tensors of the same "
        "sizes (same copy threads)",
        "mem": "torch uint8 copy_ of the same bytes into one pre-faulted buffer (torch intra-op threads: 1)",
        "fresh": "torch.empty + uint8 copy_ of the same bytes (allocation and first-touch page faults, like "
        "re-materialising the storages)",
    }
    cases = (
        ("swap_out", "out", "pinned-mirror copies + freeing the storages", ("engine", "mem")),
        ("swap_out_copies_only", "out_copy", "device->host copies only", ("engine", "mem")),
        ("swap_in", "in", "re-allocating the storages + host->device copies", ("engine", "mem", "fresh")),
    )
    for case, key, what, bases in cases:
        for base in bases:
            rows.append(
                dict(
                    case=f"{case}_vs_{base}",
                    bytes=nbytes,
                    storages=len(names),
                    gbps_median=nbytes / med[key] / 1e9,
                    baseline=baselines[base],
                    baseline_gbps_median=nbytes / med[base] / 1e9,
                    ratio=med[base] / med[key],
                    verified=restored,
                    measures=what,
                    minor_faults_swap_in_median=med["flt"],
                    pages=nbytes // os.sysconf("SC_PAGE_SIZE"),
                )
            )
    common = dict(
        thp_mem_alloc=os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
        malloc=os.environ.get("GLIBC_TUNABLES", "default"),
        copy_threads=int(os.environ["MSRL_COPY_THREADS"]),
        backend=msrl_core.runtime_info()["selected"],
        world=world,
        transport="gloo",
        train_tp=world,
        infer_tp=infer.tp,
        bucket_mib=args.bucket_mib,
        model=args.model,
        layers=args.layers,
        model_params=nparams,
        dtype=cfg.dtype,
        statistic="median",
        reps=args.reps,
        torch=torch.__version__,
        msrl_core=msrl_core.__version__,
        python=platform.python_version(),
        machine=f"{platform.machine()} {os.cpu_count()} cpus",
        commit=_commit(),
    )
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump([{**r, **common} for r in rows], f)
    dist.barrier()
    dist.destroy_process_group()


# glibc keeps freed memory (no mmap'd chunks, no trimming): re-materialised storages reuse touched pages
KEEP_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--infer-tp", type=int, default=1)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--model", choices=("bench", "e2e"), default="bench")
    ap.add_argument("--swap-only", action="store_true", help="only the swap-out / swap-in cases")
    ap.add_argument(
        "--malloc",
        choices=("default", "keep", "both"),
        default="default",
        help="keep: the ranks run with GLIBC_TUNABLES=" + KEEP_MALLOC + "; both: default, then keep",
    )
    args = ap.parse_args()
    import torch.multiprocessing as mp

    for mode in ("default", "keep") if args.malloc == "both" else (args.malloc,):
        env = os.environ.pop("GLIBC_TUNABLES", None)
        if mode == "keep":
            os.environ["GLIBC_TUNABLES"] = KEEP_MALLOC  # the spawned ranks start with it
        out = tempfile.mkdtemp(prefix="msrl_reshard_bench_")
        try:
            mp.spawn(_worker, args=(args.world, _port(), args, out), nprocs=args.world)
        finally:
            os.environ.pop("GLIBC_TUNABLES", None)
            if env is not None:
                os.environ["GLIBC_TUNABLES"] = env
        per_rank = []
        for r in range(args.world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
        for i, row in enumerate(per_rank[0]):
            for key in ("seconds_median", "baseline_seconds_median"):
                if key in row:
                    row["max_rank_" + key] = max(pr[i][key] for pr in per_rank)
            row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
