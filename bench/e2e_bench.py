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
    "actor.tp=1",
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


def run_case(case: str, steps: int, seed: int) -> dict:
    import numpy as np

    from msrl_core.trainer.demo import prepare
    from msrl_core.trainer.grpo import GRPOTrainer
    from msrl_core.trainer.reward import load_reward_fn
    from msrl_core.trainer.run import build_engine, encode_prompts, load_data, sampler_factory
    from msrl_core.trainer.task import CharTokenizer

    out_dir = tempfile.mkdtemp(prefix=f"msrl_e2e_{case}_")
    over = MODEL + [f"trainer.output_dir={out_dir}", f"trainer.seed={seed}", "actor.engine=megatron"]
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
        "steps": steps,
        "e2e_tps": float(np.mean([r["e2e_tps"] for r in steady])),
        "step_s": float(np.mean([r["timing/all"] for r in steady])),
        "resharding_to_infer_s": float(np.mean([r["timing/resharding_to_infer"] for r in steady])),
        "resharding_to_train_s": float(np.mean([r["timing/resharding_to_train"] for r in steady])),
        "reshard_accounted_peak_bytes": max(r.get("reshard/peak_bytes", 0.0) for r in rows),
        "score_last": rows[-1]["grpo/score/mean"],
        "probs_diff_max": max(r["training/rollout_probs_diff_max"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", help=argparse.SUPPRESS)  # child mode
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(a.case, a.steps, a.seed)), flush=True)
        return 0
    results = {}
    for case in a.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r}; cases: {', '.join(CASES)}")
        env = dict(os.environ, OMP_NUM_THREADS="2")
        p = subprocess.Popen(
            [sys.executable, __file__, "--case", case, "--steps", str(a.steps), "--seed", str(a.seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        out = p.stdout.read() if p.stdout else ""
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            print(json.dumps({"case": case, "error": f"exit {p.returncode}"}), flush=True)
            continue
        r = json.loads(line[-1][7:])
        r["peak_rss_bytes"] = ru.ru_maxrss * 1024
        results[case] = r
        print(json.dumps(r), flush=True)
    base = results.get("dock")
    if base:
        for case, r in results.items():
            print(
                json.dumps(
                    {
                        "ratio_to": "dock",
                        "case": case,
                        "e2e_tps_ratio": round(r["e2e_tps"] / base["e2e_tps"], 3),
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
