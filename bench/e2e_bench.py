"""End-to-end GRPO benchmark: the same short job with four data paths, one run, JSON lines.

    (a) dock      msrl_core.Dock (local backend) + allgather_swap          (the trainer as shipped)
    (a') dock_ray msrl_core.Dock (Ray backend)   + allgather_swap
    (b) central   the centralized buffer (one Ray actor holds every row, bench/central_buffer.py)
                  + allgather_swap
    (c) no_swap   Dock + allgather_swap(swap=False): the training copy stays resident during rollout
    (d) naive     Dock + the naive per-parameter reshard (msrl_core.reshard.naive_reshard: one all-gather
                  per parameter, torch slicing, every intermediate kept; the rollout engine uses its output)

Each case runs in its own process (same seed, same model, same steps); the parent measures that process's
peak resident memory (``wait4`` rusage, ru_maxrss) and prints one JSON line per case plus the ratios of
``e2e_tps`` (mean over the steps after the first) and peak memory to case (a).

    python bench/e2e_bench.py                    # all cases, 12 steps each
    python bench/e2e_bench.py --steps 6 --cases dock,naive
    python bench/e2e_bench.py --steps 6 --cases dock,naive --tp 1,2 --repeat 3 --reshard-reps 7
                                                 # the switch at TP 1 and 2, interleaved, medians

On a CPU the "device" is host memory and allgather_swap's mirrors are host memory too, so swapping does not
lower the process's resident memory here; ``reshard/peak_bytes`` (the switch's accounted peak) is reported
beside the measured RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ("dock", "dock_ray", "central", "no_swap", "naive")

# a model large enough that weights matter next to the interpreter (about 13 M parameters, 52 MB fp32)
MODEL = [
    "model.hidden_size=512",
    "model.ffn_hidden_size=1536",
    "model.num_layers=4",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "data.global_batch_size=8",
    "rollout.n=8",
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size=64",
    "rollout.max_response_length=4",
    "trainer.val_every=0",
    "demo.warmup_steps=0",
]


class CentralDock:
    """The Dock calls the trainer makes, served by the centralized buffer in one Ray actor."""

    def __init__(self, stages: dict[str, list[str]], capacity: int, group_size: int) -> None:
        import ray

        sys.path.insert(0, HERE)
        from central_buffer import CentralBuffer

        self.capacity, self.group_size, self.stages = capacity, group_size, stages
        self.actor = ray.remote(num_cpus=0.1)(CentralBuffer).remote(stages, capacity, group_size)
        self._ray = ray
        self._pending: dict[str, list[int]] = {}

    def _get(self, ref):
        return self._ray.get(ref, timeout=120)

    def reset(self) -> None:
        self._pending = {}
        self._get(self.actor.reset.remote())

    def put(self, data, rows=None):
        import numpy as np

        cols = {k: [np.asarray(x) for x in v] for k, v in data.items()}
        r = None if rows is None else [int(x) for x in np.asarray(getattr(rows, "rows", rows))]
        return np.asarray(self._get(self.actor.put.remote(r, cols)))

    def claim(self, stage, max_rows, timeout=0.0, min_rows=None):
        """Rows the buffer handed out before ``min_rows`` were reached wait here for the next call (the
        centralized buffer marks rows consumed when it returns them)."""
        import numpy as np

        from msrl_core.dock import Claim
        from msrl_core.errors import Timeout

        need = min_rows or self.group_size
        got = self._pending.setdefault(stage, [])
        deadline = time.monotonic() + timeout
        while len(got) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"central buffer: {len(got)} of {need} rows ready for {stage}")
            got += self._get(self.actor.claim.remote(stage, max_rows - len(got), min(left, 0.5)))
        self._pending[stage] = []
        return Claim(stage, np.asarray(got, np.int64))

    def fetch(self, meta, columns=None):
        import numpy as np

        from msrl_core.dock import Batch

        rows = [int(x) for x in np.asarray(getattr(meta, "rows", meta))]
        data = self._get(self.actor.get.remote(rows, list(columns)))
        out = {}
        for k, v in data.items():
            out[k] = v if v and np.asarray(v[0]).ndim else np.asarray(v)
        return Batch(np.asarray(rows, np.int64), out)

    def progress(self):
        return {s: {"consumed_rows": self._get(self.actor.consumed_rows.remote(s))} for s in self.stages}

    def stats(self):
        return {}


class NaiveSwitch:
    """Weight switch by ``naive_reshard``: fresh HF tensors every step, handed to the sampler."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.state = "back"
        self.telemetry: dict = {}

    def __call__(self, flat, plan, bucket_bytes, swap):
        from msrl_core.reshard import naive_reshard

        t0 = time.perf_counter()
        eng = self.trainer.engine
        out, accounted = naive_reshard(eng.train_params(), plan, eng.groups)
        self.trainer.sampler.views = dict(out)
        self.telemetry = {"total_s": time.perf_counter() - t0, "peak_bytes": accounted}
        return self


def run_case(case: str, steps: int, seed: int, tp: int = 1) -> dict:
    import numpy as np

    from msrl_core.trainer.demo import prepare
    from msrl_core.trainer.grpo import GRPOTrainer
    from msrl_core.trainer.reward import load_reward_fn
    from msrl_core.trainer.run import build_engine, encode_prompts, load_data, sampler_factory
    from msrl_core.trainer.task import CharTokenizer

    out_dir = tempfile.mkdtemp(prefix=f"msrl_e2e_{case}_")
    over = MODEL + [
        f"actor.tp={tp}",
        f"trainer.output_dir={out_dir}",
        f"trainer.seed={seed}",
        "actor.engine=megatron",
    ]
    if case in ("dock_ray", "central"):
        import ray

        from msrl_core.trainer.grpo import LOOPBACK_RAY

        ray.init(num_cpus=2, **LOOPBACK_RAY)
    if case == "dock_ray":
        over.append("dock.backend=ray")
    cfg, _ = prepare(over)
    records, _ = load_data(cfg)
    encode_prompts(CharTokenizer(), cfg, records, "training")
    engine = build_engine(cfg, seed)
    tr = GRPOTrainer(
        cfg,
        CharTokenizer(),
        records,
        load_reward_fn(cfg.reward.fn),
        engine,
        sampler_factory(cfg),
        swap=case != "no_swap",
    )
    if case == "central":
        tr.dock = tr.runner.dock = CentralDock(tr.dock.stages, tr.batch_rows, tr.n)
    if case == "naive":
        engine.switch = NaiveSwitch(tr)
    from msrl_core.trainer.data import PromptLoader

    loader = PromptLoader(records, int(cfg.data.global_batch_size), int(cfg.data.seed))
    rows = [tr.step(next(loader)) for _ in range(steps)]
    engine.close()
    steady = rows[1:] or rows
    return {
        "case": case,
        "tp": tp,
        "steps": steps,
        "e2e_tps": float(np.mean([r["e2e_tps"] for r in steady])),
        "step_s": float(np.mean([r["timing/all"] for r in steady])),
        "resharding_to_infer_s": float(np.mean([r["timing/resharding_to_infer"] for r in steady])),
        "resharding_to_infer_median_s": float(np.median([r["timing/resharding_to_infer"] for r in steady])),
        "resharding_to_train_s": float(np.mean([r["timing/resharding_to_train"] for r in steady])),
        "reshard_gather": str(getattr(getattr(engine, "_swap", None), "telemetry", {}).get("gather", "-"))
        if case != "naive"
        else "per-parameter",
        "reshard_accounted_peak_bytes": max(r.get("reshard/peak_bytes", 0.0) for r in rows),
        "score_last": rows[-1]["grpo/score/mean"],
        "probs_diff_max": max(r["training/rollout_probs_diff_max"] for r in rows),
    }


def _child(case: str, tp: int, steps: int, seed: int, src: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    if src:  # msrl_core from another checkout's src/ (ahead of this one's on sys.path)
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--case",
            case,
            "--tp",
            str(tp),
            "--steps",
            str(steps),
            "--seed",
            str(seed),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    out = p.stdout.read() if p.stdout else ""
    _, status, ru = os.wait4(p.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if code != 0 or not line:
        return {"case": case, "tp": tp, "error": f"exit {code}"}
    r = json.loads(line[-1][7:])
    r["peak_rss_bytes"] = ru.ru_maxrss * 1024
    return r


def _median(xs: list[float]) -> float:
    import statistics

    return float(statistics.median(xs))


def _reshard_bench(*extra: str) -> list[dict]:
    """bench/reshard_bench.py on this bench's model (``--model e2e --layers 4``, 1 MiB buckets as the demo
    config's ``reshard.bucket_mb``); its JSON lines."""
    cmd = [sys.executable, os.path.join(HERE, "reshard_bench.py"), "--model", "e2e", "--layers", "4"]
    p = subprocess.run([*cmd, "--bucket-mib", "1", *extra], capture_output=True, text=True, timeout=1200)
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]


def _header() -> dict:
    import platform

    import torch

    try:
        commit = subprocess.check_output(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], text=True
        ).strip()
    except Exception:
        commit = "unknown"
    return {
        "bench": "e2e_bench",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tp", default="1", help="training TP sizes, comma-separated (naive: TP 1 only)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every (tp, case), interleaved; medians")
    ap.add_argument(
        "--reshard-reps",
        type=int,
        default=0,
        help="also run bench/reshard_bench.py --model e2e (TP 2 -> 1, bucketed vs per-parameter gathers)",
    )
    ap.add_argument(
        "--swap-reps",
        type=int,
        default=0,
        help="also run bench/reshard_bench.py --model e2e --world 1 --swap-only --malloc both (swap-in vs "
        "pre-faulted copies of the same bytes)",
    )
    ap.add_argument(
        "--before-src",
        help="an older checkout's src/ (with its _core built): every (tp, case) also runs on it, interleaved",
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)  # child mode
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(a.case, a.steps, a.seed, int(a.tp))), flush=True)
        return 0
    print(json.dumps(_header()), flush=True)
    jobs = []
    for tp in (int(x) for x in a.tp.split(",")):
        for case in a.cases.split(","):
            if case not in CASES:
                ap.error(f"unknown case {case!r}; cases: {', '.join(CASES)}")
            if case == "naive":
                print(
                    json.dumps(
                        {
                            "case": case,
                            "tp": tp,
                            "skipped": "the trainer's ranks are worker processes (issue 18): the naive "
                            "per-parameter switch is not wired into them; it is timed by --reshard-reps",
                        }
                    ),
                    flush=True,
                )
                continue
            jobs.append((tp, case))
    if a.before_src:
        jobs = [(tp, c) for tp, case in jobs for c in (f"{case}@before", case)]
    runs: dict[tuple[int, str], list[dict]] = {j: [] for j in jobs}
    for rep in range(a.repeat):  # interleaved: drift on the shared machine hits every case alike
        for tp, case in jobs:
            name, _, before = case.partition("@")
            r = _child(name, tp, a.steps, a.seed, a.before_src if before else None)
            r["case"], r["repeat"] = case, rep
            print(json.dumps(r), flush=True)
            if "error" not in r:
                runs[(tp, case)].append(r)
    summary: dict[tuple[int, str], dict] = {}
    for (tp, case), rs in runs.items():
        if not rs:
            continue
        summary[(tp, case)] = m = {
            "summary": case,
            "tp": tp,
            "runs": len(rs),
            "statistic": "median over runs of the per-run mean over steps 1..",
            **{
                k: _median([r[k] for r in rs])
                for k in (
                    "e2e_tps",
                    "step_s",
                    "resharding_to_infer_s",
                    "resharding_to_train_s",
                    "peak_rss_bytes",
                    "reshard_accounted_peak_bytes",
                )
            },
            "resharding_to_infer_per_run_s": [round(r["resharding_to_infer_s"], 4) for r in rs],
        }
        print(json.dumps(m), flush=True)
    for tp in sorted({tp for tp, _ in summary}):
        base = summary.get((tp, "dock"))
        if not base:
            continue
        for (t, case), r in summary.items():
            if t != tp:
                continue
            print(
                json.dumps(
                    {
                        "ratio_to": "dock",
                        "tp": tp,
                        "case": case,
                        "e2e_tps_ratio": round(r["e2e_tps"] / base["e2e_tps"], 3),
                        "resharding_to_infer_ratio": round(
                            r["resharding_to_infer_s"] / base["resharding_to_infer_s"], 3
                        ),
                        "peak_rss_ratio": round(r["peak_rss_bytes"] / base["peak_rss_bytes"], 3),
                        "reshard_peak_ratio": round(
                            r["reshard_accounted_peak_bytes"]
                            / max(1.0, base["reshard_accounted_peak_bytes"]),
                            3,
                        ),
                    }
                ),
                flush=True,
            )
    if a.reshard_reps:  # TP_t 2 -> TP_i 1 over 2 gloo processes: the bucketed switch vs per-parameter gathers
        rows = _reshard_bench("--reps", str(a.reshard_reps), "--world", "2", "--infer-tp", "1")
        for row in rows:
            if row["case"].startswith("reshard_bucketed"):
                print(json.dumps({"reshard_bench": row["case"], **row}), flush=True)
    if a.swap_reps:  # one process (TP 1): swap-out / swap-in vs pre-faulted copies, glibc default and keeping
        rows = _reshard_bench("--reps", str(a.swap_reps), "--world", "1", "--swap-only", "--malloc", "both")
        for row in rows:
            print(json.dumps({"reshard_bench": row["case"], **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
