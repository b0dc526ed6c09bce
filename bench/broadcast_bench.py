"""Broadcast of the switch to rollout ranks outside the training group: RolloutBroadcast (per-rank slices,
bucketed, over subgroups of one gloo group) vs the per-parameter baseline of the same run (trainer 0 gathers
full HF tensors with one all_gather per parameter, broadcasts each full tensor to the rollout ranks, which
slice their TP rank's part with torch).

Spawns 2 training + 2 rollout processes (gloo, host runtime) on random Megatron-layout shards of the
Llama-style bench model (hidden 768, 12 heads / 4 KV heads, FFN 2048, vocab 32000, ``--layers``), TP_t 2 ->
TP_i ``--infer-tp``. Each case: barrier, warm-up, median of ``--reps``; a case ends when every rank is done
(barrier); the rollout ranks' tensors are verified against the baseline's after timing. One JSON line.

    python bench/broadcast_bench.py [--reps 5] [--infer-tp 2] [--bucket-mib 16] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _timed(fn, reps: int, dist) -> float:
    dist.barrier()
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # the case ends when the last rank is done
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("MSRL_COPY_THREADS", "1")
    import torch
    import torch.distributed as dist

    from msrl_core.reshard import (
        ModelConfig,
        Parallel,
        megatron_to_vllm,
        naive_reshard,
        reference,
        spec,
        to_hf,
    )
    from msrl_core.reshard.broadcast import RolloutBroadcast, broadcast_per_parameter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tp_group = dist.new_group([0, 1])
    base_group = dist.new_group([0, 2, 3])
    cfg = ModelConfig(
        "llama",
        hidden_size=768,
        num_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
    )
    train, infer = Parallel(tp=2), Parallel(tp=args.infer_tp)
    plan = megatron_to_vllm(cfg, train, infer)
    hfp = to_hf(cfg, train)
    bucket = args.bucket_mib << 20
    bc = RolloutBroadcast(plan, trainers=[0, 1], rollouts=[2, 3], bucket_bytes=bucket)
    groups = {"tp": tp_group}
    trainer = rank < 2
    params = {}
    if trainer:
        g = torch.Generator().manual_seed(1000 + rank)
        params = {n: torch.randn(s, generator=g) for n, s, _ in spec.megatron_stage_params(cfg, train, 0)}
    r = bc.infer_rank() if not trainer else -1
    engine = {}
    if not trainer:  # the rollout engine's own per-rank weights, filled by each case
        lay, _ = plan.infer_layout(r)
        engine = {n: torch.zeros(s) for n, (_, s) in lay.items()}
    meta = [(n, shape) for n, (_, shape) in hfp.infer_layout(0)[0].items()]

    def ours():
        if trainer:
            bc.send(params, groups)
        else:
            for b in bc.receive():
                for n, t in b:
                    engine[n].copy_(t)

    def baseline():
        full = None
        if trainer:
            full, _ = naive_reshard(params, hfp, groups)  # per-parameter all_gather on the trainers
        if rank != 1:
            got = broadcast_per_parameter(full, meta, src=0, dtype=torch.float32, group=base_group)
            if not trainer:
                for n, t in reference.hf_to_vllm(cfg, infer, r, got).items():
                    engine[n].copy_(t)

    t_base = _timed(baseline, args.reps, dist)
    ref = {n: t.clone() for n, t in engine.items()}
    for t in engine.values():
        t.zero_()
    t_ours = _timed(ours, args.reps, dist)
    ok = all(torch.equal(engine[n], ref[n]) for n in ref)
    row = {"rank": rank, "ok": ok, "ours_s": t_ours, "base_s": t_base}
    if not trainer:
        row["received_bytes"] = bc.report.bytes
        row["full_hf_bytes"] = sum(int(torch.Size(s).numel()) * 4 for _, s in meta)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--infer-tp", type=int, default=2)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "python_tests"))
    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, HERE)
    from reshard_bench import _commit, _port

    out = tempfile.mkdtemp(prefix="msrl_bcb_")
    mp.start_processes(_worker, args=(4, _port(), args, out), nprocs=4, join=True, start_method="spawn")
    rows = []
    for r in range(4):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            rows.append(json.load(f))
    ro = [x for x in rows if "received_bytes" in x]
    print(
        json.dumps(
            dict(
                case="broadcast_to_rollout_vs_per_parameter",
                train_tp=2,
                infer_tp=args.infer_tp,
                rollout_ranks=2,
                layers=args.layers,
                bucket_bytes=args.bucket_mib << 20,
                seconds_median=rows[0]["ours_s"],
                baseline="trainer 0: per-parameter all_gather to full HF tensors, one broadcast per "
                "parameter to the rollout ranks, torch slicing there",
                baseline_seconds_median=rows[0]["base_s"],
                speedup=rows[0]["base_s"] / rows[0]["ours_s"],
                received_bytes_per_rollout_rank=[x["received_bytes"] for x in ro],
                baseline_bytes_per_rollout_rank=ro[0]["full_hf_bytes"],
                verified=all(x["ok"] for x in rows),
                statistic=f"median of {args.reps} (case time = slowest rank, barrier to barrier)",
                torch=torch.__version__,
                python=platform.python_version(),
                machine=f"{platform.machine()}, {os.cpu_count()} cores",
                commit=_commit(),
            )
        )
    )


if __name__ == "__main__":
    main()
