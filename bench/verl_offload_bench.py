"""verl's ``MegatronEngine.to`` offload and onload through verl 0.9.1's own code
(``offload_megatron_model_to_cpu`` / ``load_megatron_model_to_gpu``: one ``copy_`` per DDP buffer into a
persistent ``cpu_data`` tensor, then ``resize_(0)``; gradients freed and re-zeroed) vs the one
``msrl_core.integrations.verl`` installs (``MirrorOffload``: every parameter storage to its persistent
pinned host mirror in one batch of the copy engine, gradients freed and re-zeroed), same model, same run,
same processes.

On this CPU machine the "device" is host memory, so both are host -> host copies, and verl's pinned
``cpu_data`` cannot be pinned: ``torch.empty(pin_memory=True)`` raises without an accelerator, so the bench
runs verl's functions with ``pin_memory`` dropped (``verl.utils.megatron_utils.torch`` replaced by a proxy
whose ``empty`` ignores it; nothing else of verl changes). The optimizer part is not compared: verl's
``offload_megatron_optimizer`` is ``tensor.to("cpu")``, a no-op for tensors already on the CPU, so on this
machine it moves and frees nothing (msrl_core's moves and frees the state; its round trip is tested in
verl_tests/test_verl_weights.py and python_tests/test_integrations_verl.py).

Per rank (``--world`` processes over gloo; the model of verl_switch_bench.py in bf16, wrapped in megatron-core
DDP with fp32 gradient buffers as verl's actor does), after one cold round trip per system (it allocates the
host copy), ``--reps`` interleaved round trips ``to("cpu")`` then ``to("cuda")`` (verl's device name here),
each timed on its own, with the OS's resident-memory figures: ``rss_freed_bytes`` (VmRSS before offload minus
after it: the device memory the offload gave back), ``rss_peak_bytes`` (VmHWM above the start during the
round trip, after resetting it through ``/proc/self/clear_refs``) and the host copy each system keeps.
The weights are compared with their values before the round trips after timing.

    .venv-verl/bin/python bench/verl_offload_bench.py [--world 2] [--tp 2] [--layers 8] [--reps 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import verl_switch_bench as vsb  # noqa: E402  (puts verl_tests and python_tests on sys.path)


class _NoPinTorch:
    """``torch`` for verl's megatron_utils on a machine without a pinned-memory allocator: ``empty`` drops
    ``pin_memory``; every other attribute is torch's."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs):
        import torch

        return torch.empty(*args, **kwargs)


def _crcs(params: dict) -> dict:
    import zlib

    import torch

    return {n: zlib.crc32(p.detach().clone().view(torch.uint8).numpy().tobytes()) for n, p in params.items()}


def _worker(rank: int, world: int, port: int, cases: list, out: str) -> None:
    import megatron_harness

    megatron_harness.serve(rank, world, port, cases, out, _offload_case)


def _offload_case(case: dict, rank: int, world: int) -> dict:
    import torch
    import verl.utils.megatron_utils as vmu
    import verl_util

    import integrations_util as iu
    import msrl_core.integrations.verl as mv

    vmu.torch = _NoPinTorch()
    model, _cfg, hf_config, _ps = iu.build(case)
    model.to(torch.bfloat16)
    eng = verl_util.verl_engine(model, hf_config)
    ddp = eng.module[0]
    params = dict(model.named_parameters())
    for p in params.values():  # a gradient as after a backward pass (the DDP buffers' main_grad)
        p.main_grad.fill_(1.0)
    before = _crcs(params)
    dev = mv.verl_device_name()
    systems = {
        "verl": lambda d: mv.ORIGINAL["to"](eng, d, model=True, optimizer=False, grad=True),
        "msrl": lambda d: eng.to(d, model=True, optimizer=False, grad=True),
    }

    def run(name: str) -> dict:
        gc.collect()
        rss0 = vsb._status_kib("VmRSS") * 1024
        with vsb.RssPeak() as rss:
            t0 = time.perf_counter()
            systems[name]("cpu")
            t1 = time.perf_counter()
            rss_off = vsb._status_kib("VmRSS") * 1024
            systems[name](dev)
            t2 = time.perf_counter()
        return {
            "offload_s": t1 - t0,
            "onload_s": t2 - t1,
            "round_trip_s": t2 - t0,
            "rss_freed_bytes": rss0 - rss_off,
            "rss_peak_bytes": rss.peak_bytes,
        }

    cold = {name: run(name) for name in systems}  # allocates each system's host copy
    runs: dict = {n: [] for n in systems}
    for _ in range(case["reps"]):
        for name in systems:
            runs[name].append(run(name))
    keys = ("offload_s", "onload_s", "round_trip_s", "rss_freed_bytes", "rss_peak_bytes")
    res: dict = {}
    for name, rs in runs.items():
        res[name] = {k: statistics.median(r[k] for r in rs) for k in keys}
        res[name]["runs_round_trip_s"] = [round(r["round_trip_s"], 4) for r in rs]
        res[name]["cold"] = {k: round(v, 4) if k.endswith("_s") else v for k, v in cold[name].items()}
    buffers = [b for bs in (ddp.buffers, ddp.expert_parallel_buffers) for b in bs]
    res["verl"]["host_copy_bytes"] = sum(b.param_data.cpu_data.nbytes for b in buffers)
    res["msrl"]["host_copy_bytes"] = eng._msrl_offload.stats.host_mirror_bytes
    res["param_buffer_bytes"] = sum(b.param_data.nbytes for b in buffers)
    res["grad_buffer_bytes"] = sum(b.grad_data.nbytes for b in buffers)
    res["weights_equal_after"] = _crcs(params) == before
    res["grads_zero_after"] = all(bool((p.main_grad == 0).all()) for p in params.values())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    case = {"name": "offload", "model": vsb.bench_model(a.layers), "tp": a.tp, "reps": a.reps}
    per_rank = vsb.run_ranks(_worker, case, a.world)
    r0 = per_rank[0]
    meta = {
        **vsb.run_meta(a.world),
        "tp": a.tp,
        "model": "qwen2",
        "layers": a.layers,
        "dtype": "bfloat16 (fp32 gradient buffers)",
        "copies": "host -> host (CPU machine)",
        "statistic": f"median of {a.reps} interleaved round trips after one cold round trip each",
        "param_buffer_bytes": r0["param_buffer_bytes"],
        "grad_buffer_bytes": r0["grad_buffer_bytes"],
        "weights_equal_after": all(r["weights_equal_after"] for r in per_rank),
        "grads_zero_after": all(r["grads_zero_after"] for r in per_rank),
        "load_avg": os.getloadavg(),
    }
    for name in ("verl", "msrl"):
        row = {"case": f"MegatronEngine.to/{name}", **meta, **r0[name]}
        row["max_rank_round_trip_s"] = max(r[name]["round_trip_s"] for r in per_rank)
        print(json.dumps(row))
    v, m = r0["verl"], r0["msrl"]
    print(
        json.dumps(
            {
                "case": "ratio verl/msrl",
                **meta,
                "offload": round(v["offload_s"] / m["offload_s"], 3),
                "onload": round(v["onload_s"] / m["onload_s"], 3),
                "round_trip": round(v["round_trip_s"] / m["round_trip_s"], 3),
                "cold_round_trip": round(v["cold"]["round_trip_s"] / m["cold"]["round_trip_s"], 3),
                "rss_peak": round(v["rss_peak_bytes"] / max(m["rss_peak_bytes"], 1), 3),
                "host_copy": round(v["host_copy_bytes"] / max(m["host_copy_bytes"], 1), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
