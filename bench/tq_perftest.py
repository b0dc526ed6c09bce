"""TransferQueue's own throughput benchmark, SimpleStorage vs MsrlDock, in one run (.venv-tq).

Runs ``scripts/performance_test/perftest.py`` as it ships in the transferqueue 0.1.11 wheel: its
``TQThroughputTester`` (a writer and a reader Ray actor; ``kv_batch_put`` of one batch, ``kv_list``,
``kv_batch_get`` of every key, ``kv_clear``; PUT and GET timed around the actor calls), unmodified, once per
storage backend and case, alternating the backends round by round so load drifts hit both. Ray runs on
loopback with enough logical CPUs for TQ's one-CPU actors (8 on this 2-core machine).

Prints one JSON line per (case, backend) with the median PUT / GET seconds over the timed iterations (the
first iteration of every tester is a warm-up, not counted) and one line per case with the ratios
SimpleStorage time / MsrlDock time (> 1: MsrlDock faster). Checks after timing that MsrlDock returns the
writer's batch exactly (the perftest itself does not compare data).

    .venv-tq/bin/python bench/tq_perftest.py [--rounds 2] [--iterations 3] [--cases ci,simple,complex]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

BACKENDS = ("SimpleStorage", "MsrlDock")
# name -> (global_batch_size, field_num, seq_len, complex): "ci" is TQ's own CI shape (perftest.yml).
CASES: dict[str, tuple[int, int, int, bool]] = {
    "ci": (128, 4, 1024, False),
    "simple": (1024, 4, 4096, False),
    "complex": (1024, 6, 4096, True),
}
HOST = "127.0.0.1"
# Ray reads this when it is imported: without it a single-node Ray ignores _node_ip_address="127.0.0.1".
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def perftest_dir() -> Path:
    path = Path(sysconfig.get_paths()["purelib"]) / "scripts" / "performance_test"
    if not (path / "perftest.py").exists():
        raise SystemExit(
            f"TransferQueue's perftest.py not found in {path} (pip install transferqueue==0.1.11)"
        )
    return path


def backend_yaml(backend: str, directory: Path) -> Path:
    from omegaconf import OmegaConf

    conf: dict[str, Any] = {"controller": {"polling_mode": True}, "backend": {"storage_backend": backend}}
    if backend == "SimpleStorage":
        conf["backend"]["SimpleStorage"] = {"num_data_storage_units": 2}
    else:
        conf["backend"]["MsrlDock"] = {"capacity": 8192, "warehouses": 2}
    path = directory / f"{backend}.yaml"
    OmegaConf.save(OmegaConf.create(conf), path)
    return path


def run_tester(perftest: Any, backend: str, case: str, iterations: int, directory: Path) -> list[dict]:
    batch, fields, seq, complex_case = CASES[case]
    tester = perftest.TQThroughputTester(
        backend_config_path=str(backend_yaml(backend, directory)),
        device="cpu",
        global_batch_size=batch,
        field_num=fields,
        seq_len=seq,
        num_test_iterations=iterations + 1,
        head_node_ip=HOST,
        use_complex_case=complex_case,
    )
    try:
        results = [tester.run_throughput_test(skip_dataset_create=(i != 0)) for i in range(iterations + 1)]
        if backend == "MsrlDock":
            verify_roundtrip(tester)
    finally:
        tester.close()
    return results[1:]


def verify_roundtrip(tester: Any) -> None:
    """The writer's batch, put and read back through MsrlDock, equals what it wrote (after timing)."""
    import ray
    import torch

    writer = tester.writer
    data = ray.get(writer.__ray_call__.remote(lambda self: self.test_data))
    keys = ray.get(writer.__ray_call__.remote(lambda self: self.test_keys))
    ray.get(writer.put.remote(partition_id="verify"))
    got = ray.get(
        writer.__ray_call__.remote(lambda self: __import__("transfer_queue").kv_batch_get(keys, "verify"))
    )
    ray.get(writer.delete.remote(partition_id="verify"))
    for name in data.keys():  # noqa: SIM118 (iterating a TensorDict walks its batch)
        a, b = data[name], got[name]
        if isinstance(a, torch.Tensor):
            for x, y in zip(a.unbind(), b.unbind(), strict=True):
                assert torch.equal(x, y), f"field {name} differs after the round trip"
        else:
            assert list(a.tolist()) == list(b.tolist()), f"field {name} differs after the round trip"


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=2, help="tester runs per backend and case (alternating)"
    )
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per tester (+1 warm-up)")
    parser.add_argument("--cases", default="ci,simple,complex", help=f"comma list of {sorted(CASES)}")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--verbose", action="store_true", help="the perftest's own INFO log")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; cases: {sorted(CASES)}")

    logging.getLogger().setLevel(logging.WARNING)
    import ray
    import torch
    import transfer_queue

    import msrl_core.integrations.transfer_queue as msrl_tq

    scripts = perftest_dir()
    sys.path.insert(0, str(scripts))
    import perftest  # TransferQueue's own script, as its wheel ships it

    perftest.logger.setLevel(logging.INFO if args.verbose else logging.WARNING)
    ray.init(
        num_cpus=8,
        _node_ip_address=HOST,
        include_dashboard=False,
        object_store_memory=512 * 2**20,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "msrl_core.integrations.transfer_queue.register",
            # Its actor class lives in that script: Ray workers import it from there.
            "env_vars": {"PYTHONPATH": os.pathsep.join([str(scripts), *sys.path[1:]])},
        },
    )
    meta = {
        "transferqueue": msrl_tq.TQ_VERSION,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    del transfer_queue
    times: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            for _ in range(args.rounds):
                for backend in backends:
                    times.setdefault((case, backend), []).extend(
                        run_tester(perftest, backend, case, args.iterations, Path(tmp))
                    )
    for case in cases:
        batch, fields, seq, complex_case = CASES[case]
        med = {}
        for backend in backends:
            rows = times[(case, backend)]
            med[backend] = {
                "put_s": statistics.median(r["put_time"] for r in rows),
                "get_s": statistics.median(r["get_time"] for r in rows),
            }
            print(
                json.dumps(
                    {
                        "bench": "tq_perftest",
                        "case": case,
                        "backend": backend,
                        "global_batch_size": batch,
                        "field_num": fields,
                        "seq_len": seq,
                        "complex": complex_case,
                        "gb": rows[0]["total_data_size_gb"],
                        "n": len(rows),
                        "statistic": "median",
                        **med[backend],
                        "put_gbit_s": rows[0]["total_data_size_gb"] * 8 / med[backend]["put_s"],
                        "get_gbit_s": rows[0]["total_data_size_gb"] * 8 / med[backend]["get_s"],
                        **meta,
                    }
                ),
                flush=True,
            )
        if set(BACKENDS) <= set(med):
            base, ours = med["SimpleStorage"], med["MsrlDock"]
            print(
                json.dumps(
                    {
                        "bench": "tq_perftest_ratio",
                        "case": case,
                        "put_speedup": base["put_s"] / ours["put_s"],
                        "get_speedup": base["get_s"] / ours["get_s"],
                        "baseline": "SimpleStorage, same run",
                        **meta,
                    }
                ),
                flush=True,
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
