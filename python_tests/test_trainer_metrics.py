"""metrics.jsonl writing and reading (crash-tolerant, resume), stage overlap timing, e2e_tps, and the
report: summary table, PNG plots and ``report_main``."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from msrl_core.trainer.metrics import (
    MetricsWriter,
    StageClock,
    e2e_tps,
    overlap_timings,
    read_metrics,
)
from msrl_core.trainer.report import plot, report_main, summary_table


def test_writer_appends_flushed_json_rows(tmp_path):
    w = MetricsWriter(tmp_path / "run")
    row = w.write(1, {"grpo/score/mean": torch.tensor(0.25), "n": np.int64(3), "bad": math.nan, "tag": "x"})
    assert row == {"step": 1, "grpo/score/mean": 0.25, "n": 3, "bad": None, "tag": "x"}
    # flushed: readable before close
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == row
    w.write(2, {"grpo/score/mean": 0.5, "inf": float("inf")})
    w.close()
    w.close()
    assert read_metrics(tmp_path / "run") == [row, {"step": 2, "grpo/score/mean": 0.5, "inf": None}]


def test_truncated_last_line_is_tolerated_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    with MetricsWriter(tmp_path) as w:  # reopening drops the partial line before appending
        w.write(3, {"a": 3})
    assert path.read_text().splitlines()[-1] == '{"step": 3, "a": 3}'
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_malformed_middle_line_names_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: malformed metrics line"):
        read_metrics(path)


def test_resume_drops_later_steps(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for s in range(1, 6):
            w.write(s, {"a": s})
    with MetricsWriter(tmp_path, resume_step=4) as w:  # the checkpoint after 3 steps: step 4 comes next
        w.write(4, {"a": 40})
    assert [(r["step"], r["a"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    with MetricsWriter(tmp_path, resume_step=0) as w:  # a fresh run into the same directory
        w.write(0, {"a": 0})
    assert read_metrics(tmp_path) == [{"step": 0, "a": 0}]


def test_tensorboard_is_optional(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        w.write(1, {"a": 1.0})
        assert w.tensorboard_active == (importlib.util.find_spec("tensorboard") is not None)
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}]


def test_e2e_tps():
    # (prompt + response tokens) / step seconds / devices
    assert e2e_tps(1000, 2.0, 4) == 125.0
    with pytest.raises(ValueError, match="seconds > 0"):
        e2e_tps(10, 0.0, 1)
    with pytest.raises(ValueError, match="devices >= 1"):
        e2e_tps(10, 1.0, 0)


def test_overlap_timings_hand_computed():
    spans = {
        "rollout": [(0.0, 4.0)],
        "reference": [(1.0, 2.0), (3.0, 5.0)],
        "rule_reward": [(4.5, 6.0)],
        "update": [(7.0, 8.0)],
        "old_log_p": [(6.5, 6.9), (6.6, 7.0)],  # two workers overlapping each other: busy 0.5, not 0.8
    }
    got = overlap_timings(spans, total=8.0)
    expected = {
        "timing/all": 8.0,
        "timing/rollout": 4.0,
        "timing/non_overlap_rollout": 2.0,  # reference covers (1,2) and (3,4)
        "timing/reference": 3.0,
        "timing/non_overlap_reference": 0.5,  # only (4,4.5) is its own
        "timing/rule_reward": 1.5,
        "timing/non_overlap_rule_reward": 1.0,  # reference covers (4.5,5)
        "timing/update": 1.0,
        "timing/non_overlap_update": 1.0,
        "timing/old_log_p": 0.5,
        "timing/non_overlap_old_log_p": 0.5,
    }
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v), k
    assert overlap_timings({}, 1.5) == {"timing/all": 1.5}
    with pytest.raises(ValueError, match="ends before it starts"):
        overlap_timings({"x": [(2.0, 1.0)]}, 3.0)


def test_stage_clock_records_spans():
    clock = StageClock()
    with clock.span("rollout"):
        pass
    clock.add("reference", 10.0, 12.0)
    spans = clock.intervals()
    (start, end) = spans["rollout"][0]
    assert end >= start and spans["reference"] == [(10.0, 12.0)]
    clock.reset()
    assert clock.intervals() == {}


ROWS = [
    {"step": 1, "grpo/score/mean": 0.1, "actor/pg_loss": -0.5, "val/score/mean": 0.0},
    {"step": 2, "grpo/score/mean": 0.3, "actor/pg_loss": None},
    {"step": 3, "grpo/score/mean": 0.5, "actor/pg_loss": 1.5, "val/score/mean": 0.6},
]


def test_summary_table_hand_computed():
    table = summary_table(ROWS)
    assert table.splitlines() == [
        "metric           first  last  mean   min  max  steps",
        "---------------  -----  ----  ----  ----  ---  -----",
        "grpo/score/mean    0.1   0.5   0.3   0.1  0.5      3",
        "val/score/mean       0   0.6   0.3     0  0.6      2",
        "actor/pg_loss     -0.5   1.5   0.5  -0.5  1.5      2",
    ]
    assert summary_table([{"step": 1, "zeta": 2.0, "alpha": 1}]).splitlines()[2].startswith("alpha")


def _demo_rows(n=25):
    rows = []
    for s in range(n):
        row = {
            "step": s,
            "grpo/score/mean": min(1.0, 0.05 + 0.03 * s),
            "response_length/mean": 20 - 0.4 * s,
            "timing/all": 2.0,
            "timing/rollout": 1.2,
            "timing/reference": 0.5,
            "timing/update": 0.7,
            "timing/non_overlap_rollout": 0.8,
        }
        if s % 5 == 0:
            row["val/score/mean"] = 0.04 * s
        rows.append(row)
    return rows


def _write_rows(run, rows):
    with MetricsWriter(run) as w:
        for row in rows:
            w.write(row["step"], {k: v for k, v in row.items() if k != "step"})


def test_plot_writes_pngs(tmp_path):
    _write_rows(tmp_path, _demo_rows())
    paths = plot(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "response_length.png", "timing.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_skips_absent_metrics(tmp_path):
    _write_rows(tmp_path, [{"step": 0, "grpo/score/mean": 0.5}])
    assert [p.name for p in plot(tmp_path)] == ["reward.png"]


def test_report_main(tmp_path, capsys):
    # The trainer appends the final policy's validation as a row of its own after the last step.
    _write_rows(tmp_path, [*_demo_rows(4), {"step": 4, "val/score/mean": 0.9}])
    assert report_main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "4 steps in" in out and "grpo/score/mean" in out and "timing.png" in out
    assert report_main(tmp_path / "missing") == 1
    assert "no metrics.jsonl in" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert report_main(empty) == 1
    assert "no finished step yet" in capsys.readouterr().err
