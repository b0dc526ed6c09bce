"""``msrl`` command line: bad input ends with one clear message, a non-zero exit code, no hang, and the
metrics of the finished steps kept; Ctrl-C stops cleanly; ``msrl report`` redraws a run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")

import trainer_util  # noqa: E402
from msrl_core.cli import main  # noqa: E402
from msrl_core.trainer.grpo import GRPOTrainer  # noqa: E402
from msrl_core.trainer.metrics import read_metrics  # noqa: E402

TINY = [*trainer_util.TINY, "trainer.val_every=0", "actor.engine=hf"]


def _demo(tmp_path, *extra: str) -> int:
    return main(["demo", *TINY, f"trainer.output_dir={tmp_path}", "--no-progress", *extra])


def test_unknown_key_names_the_nearest(tmp_path, capsys):
    assert _demo(tmp_path, "actor.lrr=1e-3") == 2
    err = capsys.readouterr().err
    assert "actor.lrr" in err and "'actor.lr'" in err
    assert _demo(tmp_path, "demo.warmup_step=3") == 2
    assert "demo.warmup_steps" in capsys.readouterr().err


def test_impossible_parallel_sizes(tmp_path, capsys):
    assert _demo(tmp_path, "actor.engine=megatron", "actor.tp=3") == 2
    err = capsys.readouterr().err
    assert "actor.tp=3" in err and "allowed: [1, 2, 4]" in err


def test_vllm_rollout_without_vllm_is_a_clear_error(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert _demo(tmp_path, "rollout.engine=vllm") == 2
    assert "install vllm" in capsys.readouterr().err


def test_missing_data_file(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert _demo(tmp_path, f"data.train_files={missing}") == 2
    assert str(missing) in capsys.readouterr().err


def test_malformed_jsonl_names_the_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n{"prompt": "1+\n')
    assert _demo(tmp_path, f"data.train_files={data}") == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "3" in err and "line" in err


REWARD = """
calls = 0
def reward(prompt, response, answer):
    global calls
    calls += 1
    if calls > {after}:
        raise ValueError("cannot score")
    return 1.0 if response == answer else 0.0
"""


def test_failing_reward_names_function_and_prompt(tmp_path, capsys):
    mod = tmp_path / "my_reward.py"
    mod.write_text(REWARD.replace("{after}", "16"))  # step 0 scores its 16 rows, step 1 fails
    run = tmp_path / "run"
    assert _demo(run, f"reward.fn={mod}:reward", "trainer.steps=3") == 1
    err = capsys.readouterr().err
    assert "reward" in err and "cannot score" in err and "prompt '" in err and "rule_reward" in err
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0]  # the finished step is kept


def test_stage_worker_dying_mid_step(tmp_path, capsys, monkeypatch):
    orig = GRPOTrainer._reference

    def dies(self, batch):
        if self.step_index == 1:
            raise SystemExit("reference worker killed")
        return orig(self, batch)

    monkeypatch.setattr(GRPOTrainer, "_reference", dies)
    t0 = time.monotonic()
    assert _demo(tmp_path, "trainer.steps=3") == 1
    assert time.monotonic() - t0 < 300
    err = capsys.readouterr().err
    assert "stage 'reference' failed" in err and "reference worker killed" in err
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]


def _popen(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "msrl_core.cli", *args, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    raise AssertionError(f"no line starting with {prefix!r} in {timeout} s")


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_keeping_metrics_and_checkpoint(tmp_path):
    proc = _popen(["demo", *TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=500"])
    try:
        _wait_for_line(proc, "step    1", timeout=300)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "stopped after" in err
    rows = read_metrics(tmp_path)
    assert len(rows) >= 2 and len(rows) < 500
    last = Path(tmp_path) / "checkpoints" / f"step_{len(rows)}"
    assert (last / "model.safetensors").is_file() and (last / "trainer_state.json").is_file()
    # msrl report redraws the interrupted run
    assert main(["report", str(tmp_path)]) == 0


@pytest.mark.slow
def test_megatron_follower_killed_mid_run(tmp_path):
    """A TP rank dies: rank 0's next collective fails, the run ends with an error, metrics kept."""
    pytest.importorskip("megatron.core")
    proc = _popen(
        [
            "demo",
            *TINY[:-1],
            f"trainer.output_dir={tmp_path}",
            "trainer.steps=500",
            "actor.engine=megatron",
            "actor.tp=2",
        ]
    )
    try:
        _wait_for_line(proc, "step    0", timeout=300)
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        followers = [int(k) for k in kids]
        assert followers, "no follower process"
        for pid in followers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None), err[-2000:]
    assert len(read_metrics(tmp_path)) >= 1


def test_train_with_the_example_config(tmp_path):
    root = Path(__file__).resolve().parents[1]
    args = [x for x in TINY if not x.startswith("demo.")]
    rc = main(
        [
            "train",
            str(root / "examples" / "train.yaml"),
            *args,
            f"data.train_files={root / 'examples' / 'data' / 'arithmetic.jsonl'}",
            f"trainer.output_dir={tmp_path}",
            "trainer.steps=2",
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert (tmp_path / "config.yaml").read_text().count("arithmetic.jsonl") == 1
