"""A/B of the dock between two source trees, interleaved in one run (old, new, old, new, ...).

  python bench/ab_dock.py --old OLD_TREE --new NEW_TREE [--rounds 3] [--steps 10]
                          [--python .venv/bin/python] [--tq-python .venv-bench/bin/python]
                          [--extra-systems dock-ray-xnode,dock-ray-2node] [--scripts own|new]
  python bench/ab_dock.py --summarize bench/results/dock_ab_<date>.jsonl

Each tree is a checkout with its extension built in place (src/msrl_core/_core*.so, e.g. by a dev
build). Per round and tree, one after the other: `dock_bench.py local` and `dock_bench.py grpo
--systems dock-ray,central --steps N`, each run with PYTHONPATH=<tree>/src from <tree> (so the JSON
lines carry its commit), with the tree's own bench/ scripts (--scripts new: the new tree's scripts for
both). Then, once each with the new tree: `grpo --systems <--extra-systems>` (e.g. the cross-node
systems) and `grpo --systems tq` (--tq-python) so TransferQueue is measured in the same run. One
process at a time. The JSON lines, each tagged with ab_side/ab_round/ab_tree, go to
bench/results/dock_ab_<date>.jsonl; a table of medians per figure goes to stdout and to a .md beside;
the runs' stderr to a log in the temp directory. Exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_one(tree: Path, scripts: Path, python: str, args: list[str], tag: dict, out, log) -> int:
    """Runs dock_bench.py once; appends its JSON lines (tagged) to out. Returns the exit status."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    env.pop("RAY_ADDRESS", None)  # a Ray of its own, never another cluster on the machine
    cmd = [python, str(scripts / "dock_bench.py"), *args]
    log.write(f"\n### {tag} {' '.join(cmd)}\n")
    log.flush()
    print(f"[ab] {tag['ab_side']} round {tag['ab_round']}: {' '.join(args)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=3600)
    n = 0
    for line in p.stdout.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        out.write(json.dumps({**row, **tag, "ab_cmd": " ".join(args)}) + "\n")
        n += 1
    out.flush()
    if p.returncode or not n:
        print(f"[ab]   exit {p.returncode}, {n} JSON lines (stderr in {log.name})", file=sys.stderr)
    return p.returncode


def _get(row: dict, path: str) -> Any:
    for k in path.split("."):
        if not isinstance(row, dict):
            return None
        row = row.get(k)  # type: ignore[assignment]
    return row


# (label, case, system or None, field path, unit)
FIGURES = [
    ("local claim p50 (64 of 16k rows)", "claim64", None, "p50_us", "µs"),
    ("local numpy-rescan baseline / dock claim, same run", "claim64", None, "ratio_baseline_over_dock", "×"),
    ("local put+fetch / warm memcpy", "put_fetch", None, "ratio_put_fetch_vs_memcpy_warm", "×"),
    ("local bulk cycle peak PSS / payload", "memory_bulk", None, "peak_over_payload", "×"),
    ("GRPO dock-ray samples/s", "grpo_stream", "dock-ray", "samples_per_s", "/s"),
    ("GRPO central samples/s", "grpo_stream", "central", "samples_per_s", "/s"),
    (
        "GRPO dock-ray / central samples/s, same run",
        "grpo_summary",
        None,
        "dock_samples_per_s_over_central",
        "×",
    ),
    ("GRPO dock-ray claim p50 under workload", "grpo_stream", "dock-ray", "claim.p50_us", "µs"),
    ("GRPO dock-ray uncontended claim p50", "grpo_stream", "dock-ray", "claim_uncontended.p50_us", "µs"),
    ("GRPO dock-ray blocked-claim wake p50", "grpo_stream", "dock-ray", "wake_delay_ms.p50", "ms"),
    ("GRPO central uncontended claim p50", "grpo_stream", "central", "claim_uncontended.p50_us", "µs"),
]
SINGLE_FIGURES = [  # of the single runs (TransferQueue, --extra-systems) beside the new dock-ray
    ("samples/s", "samples_per_s", "/s"),
    ("claim p50 under workload", "claim.p50_us", "µs"),
    ("uncontended claim p50", "claim_uncontended.p50_us", "µs"),
    ("blocked-claim wake p50", "wake_delay_ms.p50", "ms"),
]


def _values(rows: list[dict], side: str, case: str, system: str | None, path: str) -> list[float]:
    out = []
    for r in rows:
        if r.get("ab_side") != side or r.get("case") != case:
            continue
        if system is not None and r.get("system") != system:
            continue
        if case == "memory_bulk" and r.get("backend", "local") != "local":
            continue
        v = _get(r, path)
        if isinstance(v, (int, float)):
            out.append(float(v))
    return out


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "—"
    m = statistics.median(xs)
    return f"{m:.3g} (n={len(xs)})" if abs(m) < 1000 else f"{m:.0f} (n={len(xs)})"


def summarize(rows: list[dict]) -> str:
    trees = {r["ab_side"]: (r.get("commit"), r.get("ab_tree")) for r in rows if "ab_side" in r}
    lines = [
        "| figure | old | new | new / old |",
        "|---|---|---|---|",
    ]
    for label, case, system, path, unit in FIGURES:
        old = _values(rows, "old", case, system, path)
        new = _values(rows, "new", case, system, path)
        ratio = f"{statistics.median(new) / statistics.median(old):.2f}" if old and new else "—"
        lines.append(f"| {label} ({unit}) | {_fmt(old)} | {_fmt(new)} | {ratio} |")
    single = sorted(
        {
            (r["ab_side"], r["system"])
            for r in rows
            if r.get("ab_side") in ("tq", "extra") and "samples_per_s" in r
        }
    )
    if single:
        names = " | ".join(f"{system} (dock-ray / it)" for _, system in single)
        lines += [
            "",
            f"| single runs, new tree | dock-ray (new) | {names} |",
            "|---" * (2 + len(single)) + "|",
        ]
        for label, path, unit in SINGLE_FIGURES:
            d = _values(rows, "new", "grpo_stream", "dock-ray", path)
            cells = [_fmt(d)]
            for side, system in single:
                x = _values(rows, side, "grpo_stream", system, path)
                ratio = (
                    f" ({statistics.median(d) / statistics.median(x):.2f})"
                    if x and d and statistics.median(x)
                    else ""
                )
                cells.append(_fmt(x) + ratio)
            lines.append(f"| {label} ({unit}) | {' | '.join(cells)} |")
    errors = [f"{r.get('ab_side')}/{r.get('system')}: {r['error']}" for r in rows if "error" in r]
    head = [f"{side}: commit {c} ({t})" for side, (c, t) in sorted(trees.items())]
    return "\n".join(
        [
            "Medians over the rounds (n = values).",
            *head,
            "",
            *lines,
            *(["", "errors:", *errors] if errors else []),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--old", type=Path, help="source tree of the previous code (its _core*.so built in place)"
    )
    ap.add_argument("--new", type=Path, help="source tree of the new code (its _core*.so built in place)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the dock runs")
    ap.add_argument("--tq-python", default=None, help="interpreter with transferqueue (none: no tq run)")
    ap.add_argument(
        "--extra-systems",
        default="",
        help="grpo systems run once with the new tree after the rounds, e.g. dock-ray-xnode,dock-ray-2node",
    )
    ap.add_argument(
        "--scripts", choices=("own", "new"), default="own", help="bench/ scripts of each tree, or new's"
    )
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/dock_ab_<UTC date>.jsonl")
    ap.add_argument("--summarize", type=Path, default=None, help="only print the table of an existing .jsonl")
    a = ap.parse_args(argv)
    if a.summarize:
        print(summarize([json.loads(x) for x in a.summarize.read_text().splitlines() if x.strip()]))
        return 0
    if a.old is None or a.new is None:
        ap.error("--old and --new are required (or --summarize FILE)")
    old, new = a.old.resolve(), a.new.resolve()
    for tree in (old, new):
        if not list((tree / "src" / "msrl_core").glob("_core*.so")):
            ap.error(f"{tree}: no src/msrl_core/_core*.so (build the extension in place first)")
    out_path = (
        a.out
        or HERE / "results" / f"dock_ab_{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d_%H%M}.jsonl"
    )
    log_path = Path(tempfile.gettempdir()) / f"{out_path.stem}.stderr.log"  # not for the repository
    grpo = ["grpo", "--systems", "dock-ray,central", "--steps", str(a.steps)]
    failed = 0
    with out_path.open("w") as out, log_path.open("w") as log:
        for rnd in range(a.rounds):
            for side, tree in (("old", old), ("new", new)):
                scripts = (new if a.scripts == "new" else tree) / "bench"
                tag = {"ab_side": side, "ab_round": rnd, "ab_tree": str(tree), "ab_scripts": str(scripts)}
                for args in (["local"], grpo):
                    failed += run_one(tree, scripts, a.python, args, tag, out, log) != 0
        singles = [("extra", a.python, a.extra_systems)] if a.extra_systems else []
        singles += [("tq", a.tq_python, "tq")] if a.tq_python else []
        for side, python, systems in singles:
            tag = {"ab_side": side, "ab_round": 0, "ab_tree": str(new), "ab_scripts": str(new / "bench")}
            args = ["grpo", "--systems", systems, "--steps", str(a.steps)]
            failed += run_one(new, new / "bench", python, args, tag, out, log) != 0
    table = summarize([json.loads(x) for x in out_path.read_text().splitlines() if x.strip()])
    out_path.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nJSON lines: {out_path}\nstderr of the runs: {log_path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
