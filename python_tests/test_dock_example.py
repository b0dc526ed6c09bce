"""The quickstart in examples/ (shown in docs/dock.md and the README) runs and its assertions hold."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_on_the_local_backend():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "dock_quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "update got 16 rows" in out.stdout
    assert out.stdout.strip().endswith("local ok")
