"""Trainer pieces without a full run: the task and tokenizer, packing, the stage table and its runner over a
real Dock, the HF engine against the sampler over allgather_swap views, and the CPU compatibility layer."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import msrl_core  # noqa: E402
from msrl_core.reshard import Parallel, to_hf  # noqa: E402
from msrl_core.trainer.actor import response_log_probs  # noqa: E402
from msrl_core.trainer.config import ModelSection  # noqa: E402
from msrl_core.trainer.grpo import pack  # noqa: E402
from msrl_core.trainer.metrics import StageClock  # noqa: E402
from msrl_core.trainer.stages import STREAMING, StageError, StageRunner, grpo_stages, make_dock  # noqa: E402
from msrl_core.trainer.task import (  # noqa: E402
    CharTokenizer,
    arithmetic_records,
    constant_answer_score,
)


def test_task_answer_depends_on_prompt():
    recs = arithmetic_records(300, 2, 5, seed=0)
    assert all(int(r["answer"]) == int(r["prompt"][0]) + int(r["prompt"][2]) for r in recs)
    assert constant_answer_score(2, 5) == pytest.approx(1 / 6)  # the demo's ranges: <= 0.2
    assert constant_answer_score(4, 5) == pytest.approx(5 / 30)
    # a constant answer really scores that on a sample
    best = max(sum(r["answer"] == str(a) for r in recs) for a in range(8)) / len(recs)
    assert best <= 0.2 + 0.05


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("3+4=")
    assert ids[0] == tok.bos_id and len(ids) == 5
    assert tok.decode([*tok.encode("12", bos=False), tok.eos_id, *tok.encode("9", bos=False)]) == "12"
    with pytest.raises(ValueError, match=r"\['x'\]"):
        tok.encode("3x4")


def test_pack_positions_point_at_response_tokens():
    pk = pack([np.array([1, 5, 6]), np.array([1, 7])], [np.array([9, 2]), np.array([8, 8, 2])], pad_id=0)
    assert pk.tokens.tolist() == [[1, 5, 6, 9, 2], [1, 7, 8, 8, 2]]
    assert pk.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    for i in range(2):
        for j in range(int(pk.mask[i].sum())):
            assert pk.tokens[i, pk.pos[i, j] + 1] == pk.responses[i, j]


def test_stage_table_is_data():
    on = [s.name for s in grpo_stages(32, 4, 2, use_reference=True, recompute_old=False)]
    assert on == ["rollout", "reference", "rule_reward", "adv", "update"]
    off = grpo_stages(32, 4, 2, use_reference=False, recompute_old=True)
    assert [s.name for s in off] == ["rollout", "rule_reward", "adv", "old_log_p", "update"]
    upd = off[-1]
    assert upd.rows_per_claim == 32 and upd.layout == "padded" and "old_log_prob" in upd.reads
    assert "ref_log_prob" not in upd.reads


def _tiny_runner(work_delay: float = 0.0, fail: str | None = None):
    stages = grpo_stages(16, 4, 1, use_reference=True, recompute_old=False)
    dock = make_dock(stages, 16, 4, warehouses=2, backend="local")
    seen: dict[str, list[int]] = {s.name: [] for s in stages}

    def make(name, out):
        def fn(batch):
            if name == fail:
                raise RuntimeError(f"{name} broke")
            seen[name] += [int(r) for r in batch.rows]
            time.sleep(work_delay)
            return out(batch)

        return fn

    def ragged(batch, dtype):
        return [np.zeros(3, dtype) for _ in batch.rows]

    work = {
        "rollout": make(
            "rollout",
            lambda b: {"responses": ragged(b, np.int64), "rollout_log_prob": ragged(b, np.float32)},
        ),
        "reference": make("reference", lambda b: {"ref_log_prob": ragged(b, np.float32)}),
        "rule_reward": make("rule_reward", lambda b: {"scores": np.ones(len(b.rows), np.float32)}),
        "adv": make("adv", lambda b: {"advantages": np.zeros(len(b.rows), np.float32)}),
        "update": make("update", lambda b: None),
    }
    runner = StageRunner(dock, stages, work, deadline_s=60)
    dock.put({"prompts": [np.arange(4) for _ in range(16)], "index": np.arange(16)})
    return runner, dock, seen


def _step(runner, clock):
    """The trainer's order: the streaming stages in the background, rollout, join, update."""
    with runner.iteration(clock) as stages:
        stages.start(STREAMING)
        stages.run("rollout")
        stages.join()
        stages.run("update")


def test_runner_streams_every_row_once_per_stage():
    runner, dock, seen = _tiny_runner(work_delay=0.02)
    clock = StageClock()
    _step(runner, clock)
    for name, rows in seen.items():
        assert sorted(rows) == list(range(16)), name
    assert all(p["consumed_rows"] == 16 for p in dock.progress().values())
    iv = clock.intervals()
    # reference started before the rollout finished: it streamed behind it
    assert min(a for a, _ in iv["reference"]) < max(b for _, b in iv["rollout"])
    # the update ran after the rollout (the order the step writes)
    assert min(a for a, _ in iv["update"]) >= max(b for _, b in iv["rollout"])


def test_runner_failure_names_the_stage_and_stops_the_others():
    runner, _, _ = _tiny_runner(fail="rule_reward")
    t0 = time.monotonic()
    with pytest.raises(StageError, match="stage 'rule_reward' failed: RuntimeError: rule_reward broke"):
        _step(runner, StageClock())
    assert time.monotonic() - t0 < 30
    runner, _, _ = _tiny_runner(fail="rollout")  # a failure in the driver's own stage stops the others too
    with pytest.raises(StageError, match="stage 'rollout' failed: RuntimeError: rollout broke"):
        _step(runner, StageClock())
    assert time.monotonic() - t0 < 60


def test_runner_deadline_when_a_stage_never_gets_rows():
    runner, dock, _ = _tiny_runner()
    runner.deadline_s = 1.0
    with pytest.raises(StageError, match="did not finish within"), runner.iteration(StageClock()) as stages:
        stages.start(STREAMING)  # the rollout never runs: reference waits for rows that never come
        stages.join()


def test_hf_engine_matches_sampler_over_allgather_swap_views():
    from msrl_core.trainer.engines.hf import HFSampler, HFTrainEngine

    section = ModelSection(
        arch="llama", hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=18, make_vocab_size_divisible_by=8, qkv_bias=False,
        max_position_embeddings=32,
    )  # fmt: skip
    eng = HFTrainEngine(section, seed=3)
    cfg = eng.model_config
    before = {k: v.detach().clone() for k, v in eng.params.items()}
    plan = to_hf(cfg, Parallel(tp=1))
    flat, views = plan.allocate_inference()
    sampler = HFSampler(section, views)
    swap = msrl_core.allgather_swap(eng.params, flat, plan, eng.groups)
    assert all(p.untyped_storage().nbytes() == 0 for p in eng.params.values())  # swapped out
    prompts = [torch.tensor([1, 5, 13, 6, 16]), torch.tensor([1, 7, 13, 16])]  # different lengths: left pad
    toks, lps = sampler.generate(prompts, 4, 2, 0, 1.0, 1.0, torch.Generator().manual_seed(0))
    swap.swap_back()
    swap.wait()
    assert all(torch.equal(before[k], v) for k, v in eng.params.items())
    pk = pack([p.numpy() for p in prompts], [t.numpy() for t in toks], 0)
    with torch.no_grad():
        lp, _, _ = response_log_probs(eng, pk, slice(None), 1.0)
    for i in range(2):
        n = len(toks[i])
        assert torch.allclose(lp[i, :n], lps[i], atol=1e-5), (lp[i, :n], lps[i])


def test_megatron_cpu_is_a_no_op_with_an_accelerator(monkeypatch):
    from msrl_core.trainer.engines import megatron_cpu

    monkeypatch.setattr(megatron_cpu, "_ACTIVE", False)
    monkeypatch.setattr(megatron_cpu, "accelerator_present", lambda: True)
    orig = torch.cuda.current_device
    assert megatron_cpu.activate() is False
    assert torch.cuda.current_device is orig and not megatron_cpu.is_active()
