"""The Megatron-engine half of ``msrl_core.integrations.verl`` without verl installed (the differential test
against verl's own ``get_per_tensor_param`` is the verl tier, verl_tests/): a real megatron-core GPTModel,
TP 2 over gloo, exported through ``HFWeightExport`` equals the reference HF checkpoint layout; the pinned-
mirror offload round-trips weights, gradients and Adam state; an unsupported verl fails at import."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

import integrations_util
import megatron_harness
from reshard_util import CONFIGS

QWEN2 = dataclasses.asdict(CONFIGS["qwen2_gqa_bias"])  # GQA 8/2 heads, QKV bias, vocab 1000 (padded: 1024)


@pytest.fixture(scope="module")
def tp2():
    cases = [{"name": "qwen2_tp2", "model": QWEN2, "tp": 2}]
    return megatron_harness.spawn(integrations_util.quick_main, cases, 2, 300.0, "integration workers")


@pytest.mark.slow  # two spawned megatron-core workers: about 40 s with their imports
def test_export_equals_the_hf_layout_on_tp2(tp2):
    for rank in (0, 1):
        r = tp2[rank]["qwen2_tp2"]
        assert "error" not in r, r.get("traceback")
        assert r["layout"] == {"arch": "qwen2", "dtype": "float32", "tp": 2, "pp": 1, "ep": 1}
        v = r["vs_reference"]
        assert v["names_equal"], (v["missing"], v["extra"])
        assert not v["shape_mismatch"] and not v["dtype_mismatch"] and not v["value_mismatch"], v
        assert (
            v["count"] == 3 + 2 * 12
        )  # embed, norm, lm_head; per layer 2 norms, q/k/v weight+bias, o, gate, up, down
        assert r["buckets"] > 1 and r["plan_reused"]


@pytest.mark.slow
def test_mirror_offload_round_trip(tp2):
    for rank in (0, 1):
        r = tp2[rank]["qwen2_tp2"]
        assert r["weights_freed"] and r["grads_freed"]
        assert r["first"] in r["guarded"]  # a read of an offloaded parameter raises, naming it
        assert r["weight_bytes"] == r["param_bytes"] == r["host_new_first"]
        assert r["host_new_second"] == 0  # the mirrors are reused
        assert r["restored_equal"] and r["grads_zero"] and r["grads_left_freed"]
        assert r["moments_freed"] and r["moments_equal"]
        assert r["optimizer_freed"]["optimizer_state"] == r["moment_bytes"]  # Adam's 0-d step counts stay


def _import_with_fake_verl(version: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        f"""
        import sys, types
        fake = types.ModuleType("verl")
        fake.__version__, fake.__file__ = {version!r}, "/opt/verl/__init__.py"
        sys.modules["verl"] = fake
        import msrl_core.integrations.verl
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_unsupported_verl_version_fails_at_import_with_one_message():
    p = _import_with_fake_verl("0.8.0")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("msrl_core.integrations.verl.UnsupportedVerl:"), p.stderr
    assert "supports verl 0.9.1 and 0.10.0.dev; found verl '0.8.0' at /opt/verl" in last
    assert "Install verl==0.9.1" in last


def test_bad_setting_names_the_value_and_what_is_allowed():
    env = {**os.environ, "MSRL_VERL_BUCKET_MB": "0"}
    code = "import msrl_core.integrations.verl"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "ValueError: MSRL_VERL_BUCKET_MB='0'; allowed: a positive integer (MiB)" in p.stderr
