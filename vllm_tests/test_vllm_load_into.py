"""``load_into`` from a single trainer process into an engine in that process (transport ``"local"``, the
in-process engine): a ``Swap`` of allgather-swap (vLLM per-rank layout, TP_i 1) and a dict of HF tensors.
Greedy tokens equal the transformers model's, log-probs within 1e-3."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python_tests"))

import vllm_harness  # noqa: E402

import megatron_harness  # noqa: E402
from msrl_core.reshard import ModelConfig, Parallel, allgather_swap, megatron_to_vllm, reference  # noqa: E402
from msrl_core.reshard import vllm as rv  # noqa: E402
from reshard_util import random_shards  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    cfg = ModelConfig(**vllm_harness.MODEL)
    hf = megatron_harness.hf_model(cfg)
    hf.config.torch_dtype = torch.float32
    path = tmp_path_factory.mktemp("load_into") / "model"
    hf.save_pretrained(path)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: transport "local"
    llm = LLM(
        model=str(path),
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=64,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        **rv.engine_kwargs(),
    )
    mp.undo()
    yield cfg, hf, llm
    llm.llm_engine.engine_core.shutdown()


def _check(llm, hf) -> float:
    got = vllm_harness._greedy_vllm(llm)
    want = [vllm_harness._greedy_hf(hf, p) for p in vllm_harness.PROMPTS]
    assert [g[0] for g in got] == [w[0] for w in want]
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1]))


@pytest.mark.parametrize("seed", [1, 2])
def test_load_into_from_a_swap_and_from_hf_tensors(engine, seed):
    cfg, hf, llm = engine
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=1))
    params = {n: 0.3 * t for n, t in random_shards(plan, seed=seed)[(0, 0, 0)].items()}
    hf_tensors = reference.megatron_to_hf(cfg, plan.train, {(0, 0, 0): params})
    megatron_harness.load_hf(hf, cfg, hf_tensors)
    flat, _ = plan.allocate_inference(0)
    swap = allgather_swap(params, flat, plan, {}, bucket_bytes=256 << 10)
    rep = rv.load_into(llm, swap, transport="local")
    swap.swap_back().wait()
    assert rep.layout == "vllm" and rep.per_rank_bytes == {0: plan.infer_layout(0)[1]}
    assert _check(llm, hf) <= 1e-3
    rep = rv.load_into(
        llm, {n: 1.0 * t for n, t in hf_tensors.items()}, transport="local", bucket_bytes=1 << 20
    )
    assert rep.layout == "hf" and rep.chunks > 1
    assert _check(llm, hf) <= 1e-3


def test_load_into_rejects_what_it_cannot_place(engine):
    from msrl_core.reshard import ReshardError

    _, _, llm = engine
    with pytest.raises(ReshardError, match="weights must be a Swap, a dict of tensors"):
        rv.load_into(llm, [1, 2, 3])
    cfg = ModelConfig(**vllm_harness.MODEL)
    plan = megatron_to_vllm(cfg, Parallel(tp=1), Parallel(tp=2))
    flat, views = plan.allocate_inference(0)
    swap = allgather_swap(random_shards(plan)[(0, 0, 0)], flat, plan, {}, swap=False, infer_rank=0)
    with pytest.raises(ReshardError, match="one rank's tensors given for an engine with TP_i = 2"):
        rv.load_into(llm, swap)
