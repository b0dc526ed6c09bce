"""verl's weight switch: ``MegatronEngine.get_per_tensor_param`` through verl's own code (mbridge's export:
one TP all-gather, PP broadcast and EP all-gather per parameter) vs the one ``msrl_core.integrations.verl``
installs (``stream_buckets``: one gather and one fused copy per bucket, tensors the rank holds contiguously
yielded in place), and the same stream with every tensor copied through its scratches
(``HFWeightExport(inplace=False)``, system ``msrl_copy``), same model, same run, same consumer.

Spawns ``--world`` processes over gloo (CPU, host runtime) with a megatron-core GPTModel (python_tests'
harness, TE-spec names as verl_tests/verl_util.py explains), cast to bf16 as verl trains. The consumer is
verl's ``BucketedWeightSender`` loop without the socket: each yielded tensor is copied into a reused
``--sender-mib`` buffer at the next aligned offset. Per system, warm-up then ``--reps`` runs, the three
systems interleaved (A B C A B C ...); per run, on every rank together (barrier first):

- ``s``: wall time from the ``get_per_tensor_param`` call to the end of the iteration;
- ``torch_peak_bytes``: the peak of the bytes torch allocated during the run
  (``msrl_core.reshard.MemoryProbe``: a dispatch-mode tally of every storage a torch op makes, minus the
  freed ones; gloo's internal buffers are not seen);
- ``rss_peak_bytes``: the OS high-water mark of the process's resident memory during the run above its
  resident memory at the start (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; glibc
  returns large blocks to the OS at once: ``MALLOC_MMAP_THRESHOLD_`` is fixed at 128 KiB in the workers).
  Every timed run records it; the torch tally slows each op, so it runs once per system, untimed.

The tensors the systems yield are compared after timing (names, shapes, dtypes, values). Prints one JSON
line per system (rank 0's medians, ``max_rank_s`` the slowest rank's median) and one with the ratios.

    .venv-verl/bin/python bench/verl_switch_bench.py [--world 2] [--tp 2] [--pp 1] [--ep 1] [--moe]
        [--layers 8] [--reps 5] [--bucket-mib 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "verl_tests"), os.path.join(ROOT, "python_tests")]


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def bench_model(layers: int) -> dict:
    """Qwen2-style: hidden 1024, 16 heads / 4 KV heads, FFN 2816, vocab 32768 (8 layers: 157 M parameters)."""
    return dict(
        arch="qwen2",
        hidden_size=1024,
        num_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_size=32768,
        qkv_bias=True,
    )


def bench_moe_model(layers: int) -> dict:
    """Qwen3-MoE-style: hidden 1024, 16 heads / 4 KV heads (head_dim 64), 16 experts with FFN 256, vocab
    32768 (4 layers: 119 M parameters)."""
    return dict(
        arch="qwen3_moe",
        hidden_size=1024,
        num_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2816,
        vocab_size=32768,
        qk_norm=True,
        num_experts=16,
        moe_intermediate_size=256,
    )


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class RssPeak:
    """Peak resident memory above the start, from the OS (VmHWM reset through /proc/self/clear_refs)."""

    def __enter__(self) -> RssPeak:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        self.peak_bytes = _status_kib("VmHWM") * 1024 - self.start


class Sender:
    """verl's BucketedWeightSender fill loop (bucketed_weight_transfer.py) without the socket."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.tensors = self.bytes = 0

    def consume(self, weights) -> None:
        offset = 0
        for _name, w in weights:
            align = w.element_size()
            offset = (offset + align - 1) // align * align
            if offset + w.nbytes > self.buffer.numel():
                offset = 0  # "send" the bucket
            if w.nbytes > self.buffer.numel():
                continue  # verl sends such a tensor on its own (_direct_send_large_weight)
            self.buffer[offset : offset + w.nbytes].view(dtype=w.dtype).view(w.shape).copy_(w)
            offset += w.nbytes
            self.tensors += 1
            self.bytes += w.nbytes


def _worker(rank: int, world: int, port: int, cases: list, out: str) -> None:
    import megatron_harness

    megatron_harness.serve(rank, world, port, cases, out, _bench_case)


def _bench_case(case: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import verl_util

    import integrations_util as iu
    import msrl_core.integrations.verl as mv
    from msrl_core.integrations.megatron import HFWeightExport
    from msrl_core.reshard.memory import MemoryProbe

    model, _cfg, hf_config, _ps = iu.build(case)
    model.to(torch.bfloat16)
    eng = verl_util.verl_engine(model, hf_config)
    bucket = case["bucket_mib"] << 20
    inplace = HFWeightExport(bucket_bytes=bucket)  # what the adapter installs (in place where it can)
    copying = HFWeightExport(bucket_bytes=bucket, inplace=False)  # every tensor through the scratches

    def ours(export: HFWeightExport):
        def go():
            eng._msrl_export = export
            return eng.get_per_tensor_param()[0]

        return go

    sender = Sender(case["sender_mib"] << 20)
    systems = {
        "verl": lambda: mv.ORIGINAL["get_per_tensor_param"](eng)[0],
        "msrl": ours(inplace),
        "msrl_copy": ours(copying),
    }

    def run(name: str) -> dict:
        gc.collect()  # the previous run's garbage leaves before the RSS baseline is taken
        dist.barrier()
        with RssPeak() as rss:
            t0 = time.perf_counter()
            sender.consume(systems[name]())
            s = time.perf_counter() - t0
        return {"s": s, "rss_peak_bytes": rss.peak_bytes}

    def measured(name: str) -> int:  # the torch tally slows every op: a run of its own, not timed
        gc.collect()
        dist.barrier()
        with MemoryProbe() as probe:
            sender.consume(systems[name]())
        return probe.peak_bytes

    for name in systems:  # warm-up: the plan, mbridge's name tables, gloo's connections
        run(name)
    runs: dict = {n: [] for n in systems}
    for _ in range(case["reps"]):
        for name in systems:
            runs[name].append(run(name))
    res: dict = {}
    for name, rs in runs.items():
        res[name] = {k: statistics.median(r[k] for r in rs) for k in ("s", "rss_peak_bytes")}
        res[name]["runs_s"] = [round(r["s"], 4) for r in rs]
        res[name]["torch_peak_bytes"] = measured(name)
    # after timing: the two systems yield the same tensors
    theirs, _ = verl_util.collect(systems["verl"]())
    mine, _ = verl_util.collect(systems["msrl"]())
    res["compare"] = iu.compare(mine, theirs)
    res["tensors"] = len(mine)
    res["hf_bytes"] = sum(t.nbytes for t in mine.values())
    res["shard_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    for name, export in (("msrl", inplace), ("msrl_copy", copying)):
        t = export.telemetry
        res[name]["telemetry"] = {
            "buckets": t.buckets,
            "scratch_bytes": t.gather_scratch_bytes + t.output_scratch_bytes,
            "gather_scratch_bytes": t.gather_scratch_bytes,
            "output_scratch_bytes": t.output_scratch_bytes,
            "gather_buckets": t.gather_buckets,
            "skipped_buckets": t.skipped_buckets,
            "direct_buckets": t.direct_buckets,
            "inplace_tensors": t.inplace_tensors,
            "scratch_views": t.scratch_views,
            "bytes_inplace": t.bytes_inplace,
        }
    theirs_copy, _ = verl_util.collect(systems["msrl_copy"]())
    res["compare_copy"] = iu.compare(theirs_copy, theirs)
    return res


def run_ranks(worker, case: dict, world: int) -> list[dict]:
    """``case`` on ``world`` spawned ranks (megatron_harness over gloo): each rank's result, or the first
    rank's traceback as the exit message."""
    import megatron_harness

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # glibc reads it at start-up: the workers inherit it
    per_rank = [
        r[case["name"]] for r in megatron_harness.spawn(worker, [case], world, 3600.0, "bench workers")
    ]
    for r in per_rank:
        if "error" in r:
            raise SystemExit(r["traceback"])
    return per_rank


def run_meta(world: int) -> dict:
    """What every JSON line records: commit, date, machine, versions, ranks."""
    import torch
    import verl

    return {
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "torch": torch.__version__,
        "verl": verl.__version__,
        "world": world,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="the Qwen3-MoE-style model (bench_moe_model)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=16, help="msrl stream bucket (MSRL_VERL_BUCKET_MB)")
    ap.add_argument("--sender-mib", type=int, default=512, help="verl's update_weights_bucket_megabytes")
    a = ap.parse_args()
    case = {
        "name": "switch",
        "model": (bench_moe_model if a.moe else bench_model)(a.layers),
        "tp": a.tp,
        "pp": a.pp,
        "ep": a.ep,
        "reps": a.reps,
        "bucket_mib": a.bucket_mib,
        "sender_mib": a.sender_mib,
    }
    per_rank = run_ranks(_worker, case, a.world)
    r0 = per_rank[0]
    meta = {
        **run_meta(a.world),
        "tp": a.tp,
        "pp": a.pp,
        "ep": a.ep,
        "model": "qwen3_moe" if a.moe else "qwen2",
        "layers": a.layers,
        "dtype": "bfloat16",
        "statistic": f"median of {a.reps} interleaved runs after one warm-up",
        "tensors": r0["tensors"],
        "hf_bytes": r0["hf_bytes"],
        "shard_bytes": r0["shard_bytes"],
        "same_tensors": all(
            r[k]["names_equal"] and not r[k]["value_mismatch"] and not r[k]["dtype_mismatch"]
            for r in per_rank
            for k in ("compare", "compare_copy")
        ),
        "load_avg": os.getloadavg(),
    }
    for name in ("verl", "msrl", "msrl_copy"):
        row = {"case": f"get_per_tensor_param/{name}", **meta, **r0[name]}
        row["max_rank_s"] = max(r[name]["s"] for r in per_rank)
        if name != "verl":
            row["bucket_bytes"] = a.bucket_mib << 20
        print(json.dumps(row))
    v = r0["verl"]
    for name in ("msrl", "msrl_copy"):
        m = r0[name]
        print(
            json.dumps(
                {
                    "case": f"ratio verl/{name}",
                    **meta,
                    "time": round(v["s"] / m["s"], 3),
                    # the peaks can be 0 (nothing allocated): the ratio is then left out
                    "torch_peak": round(v["torch_peak_bytes"] / m["torch_peak_bytes"], 3)
                    if m["torch_peak_bytes"]
                    else None,
                    "torch_peak_bytes": [v["torch_peak_bytes"], m["torch_peak_bytes"]],
                    "rss_peak": round(v["rss_peak_bytes"] / m["rss_peak_bytes"], 3)
                    if m["rss_peak_bytes"]
                    else None,
                }
            )
        )


if __name__ == "__main__":
    main()
