"""The run report: a summary table of the metrics and PNG plots (reward, response length, stage time),
drawn from ``metrics.jsonl`` alone so that ``msrl report RUN_DIR`` redraws them after (or during) a run.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch, no display needed).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from msrl_core.trainer.metrics import METRICS_FILE, read_metrics

#: Metrics the summary table shows first, in this order, when present.
SUMMARY_KEYS = (
    "grpo/score/mean",
    "val/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "training/rollout_probs_diff_max",
    "e2e_tps",
    "timing/all",
)
#: Stage order in the timing plot (pipeline order); other timing/* keys follow alphabetically.
STAGE_ORDER = (
    "resharding_to_infer",
    "rollout",
    "reference",
    "rule_reward",
    "old_log_p",
    "adv",
    "resharding_to_train",
    "update",
)
PLOTS = ("reward.png", "response_length.png", "timing.png")


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have a finite number under ``key``."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(row.get("step", i)))
            ys.append(float(v))
    return xs, ys


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def summary_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str] | None = None) -> str:
    """A plain-text table: one line per metric with first, last, mean, min, max over the steps that
    recorded it. Default keys: :data:`SUMMARY_KEYS` present in ``rows`` (else every numeric key)."""
    if keys is None:
        present = {k for row in rows for k in row}
        keys = [k for k in SUMMARY_KEYS if k in present]
        if not keys:
            keys = sorted(k for k in present if k != "step" and _series(rows, k)[1])
    header = ("metric", "first", "last", "mean", "min", "max", "steps")
    lines: list[tuple[str, ...]] = [header]
    for key in keys:
        _, ys = _series(rows, key)
        if ys:
            stats = (ys[0], ys[-1], sum(ys) / len(ys), min(ys), max(ys))
            lines.append((key, *map(_fmt, stats), str(len(ys))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _figure() -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, ax: Any, path: Path, title: str, ylabel: str, legend_outside: bool = False) -> Path:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        if legend_outside:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        else:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def _plot_lines(
    rows: Sequence[Mapping[str, Any]], path: Path, series: Mapping[str, str], title: str
) -> Path | None:
    fig, ax = _figure()
    drawn = False
    for key, label in series.items():
        xs, ys = _series(rows, key)
        if ys:
            ax.plot(xs, ys, marker="o" if len(ys) < 30 else None, markersize=3, label=label)
            drawn = True
    return _save(fig, ax, path, title, title.split(" ")[0]) if drawn else None


def _plot_timing(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    found = {k for row in rows for k in row if k.startswith("timing/") and k != "timing/all"}
    found = {k for k in found if not k.startswith("timing/non_overlap_")}
    order = {f"timing/{s}": i for i, s in enumerate(STAGE_ORDER)}
    stages = sorted(found, key=lambda k: (order.get(k, len(order)), k))
    if not stages:
        return None
    fig, ax = _figure()
    steps = [float(row.get("step", i)) for i, row in enumerate(rows)]
    bottom = [0.0] * len(rows)
    for key in stages:
        vals = [float(v) if isinstance((v := row.get(key)), (int, float)) else 0.0 for row in rows]
        ax.bar(steps, vals, bottom=bottom, width=0.8, label=key.removeprefix("timing/"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    xs, ys = _series(rows, "timing/all")
    if ys:
        ax.plot(xs, ys, color="black", marker="_", linestyle="-", label="step wall time (all)")
    title = "stage busy time, stacked (above the line: hidden by overlap)"
    return _save(fig, ax, path, title, "seconds", legend_outside=True)


def plot(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Draw ``reward.png`` (grpo/score/mean, val/score/mean), ``response_length.png`` and ``timing.png``
    (stacked busy time of each timing/<stage> against timing/all) into ``run_dir``; returns those drawn
    (a plot whose metrics are absent is skipped)."""
    out = Path(run_dir)
    rows = read_metrics(out)
    drawn = [
        _plot_lines(
            rows,
            out / PLOTS[0],
            {"grpo/score/mean": "train (sampled)", "val/score/mean": "val (greedy)"},
            "reward",
        ),
        _plot_lines(
            rows, out / PLOTS[1], {"response_length/mean": "mean response length"}, "tokens per response"
        ),
        _plot_timing(rows, out / PLOTS[2]),
    ]
    return [p for p in drawn if p is not None]


def report_main(run_dir: str | os.PathLike[str]) -> int:
    """``msrl report RUN_DIR``: print the summary table, redraw the plots, print their paths.
    Returns the process exit code (1 with a message on stderr when there is nothing to report)."""
    metrics = Path(run_dir) / METRICS_FILE
    if not metrics.is_file():
        print(
            f"msrl report: no {METRICS_FILE} in {str(run_dir)!r} (is it a trainer.output_dir?)",
            file=sys.stderr,
        )
        return 1
    try:
        rows = read_metrics(metrics)
    except ValueError as exc:
        print(f"msrl report: {exc}", file=sys.stderr)
        return 1
    if not rows:
        print(f"msrl report: {metrics} has no finished step yet", file=sys.stderr)
        return 1
    # A row with only validation figures (the final policy's, after the last step) is not a step.
    steps = sum(1 for row in rows if any(k != "step" and not k.startswith("val/") for k in row))
    print(f"{steps} steps in {metrics}")
    print(summary_table(rows))
    for path in plot(run_dir):
        print(f"wrote {path}")
    return 0


__all__ = ["PLOTS", "STAGE_ORDER", "SUMMARY_KEYS", "plot", "report_main", "summary_table"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m msrl_core.trainer.report RUN_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(report_main(sys.argv[1]))
