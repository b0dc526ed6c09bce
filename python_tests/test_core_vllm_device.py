"""``rollout.engine=vllm`` on an accelerator, run on a CPU with a stand-in ``vllm`` package and fakes of the
device calls (issue 17 item 6): the sampling seeds come from the trainer's generator on its own device, a
GPU/NPU engine is built with vLLM's sleep mode, the engine sleeps at level 2 once the rollout is done and is
woken weights-first at the next switch, and the switch empties the caching allocator of the device in use
(CUDA or NPU)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from msrl_core.reshard import ModelConfig  # noqa: E402
from msrl_core.reshard import vllm as rv  # noqa: E402
from msrl_core.trainer.config import ModelSection  # noqa: E402
from msrl_core.trainer.engines import vllm_rollout  # noqa: E402
from msrl_core.trainer.engines.vllm_rollout import VLLMSampler  # noqa: E402

MC = ModelConfig(
    arch="llama",
    vocab_size=18,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
)


class _Out:
    def __init__(self, ids):
        self.token_ids = ids
        self.logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]


class FakeLLM:
    """``vllm.LLM`` as the sampler uses it: records construction kwargs and every sleep/wake call."""

    def __init__(self, sleep_mode: bool = True, **kwargs):
        self.kwargs = kwargs
        self.calls: list[str] = []
        self.seeds: list[int | None] = []
        mc = SimpleNamespace(enable_sleep_mode=kwargs.get("enable_sleep_mode", sleep_mode))
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=mc))

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append("generate")
        self.seeds = [p.seed for p in params]
        return [SimpleNamespace(outputs=[_Out([3, 4])]) for _ in requests]

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags):
        self.calls.append(f"wake_up({','.join(tags)})")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


class _Platform:
    def __init__(self, cpu: bool, sleep: bool):
        self._cpu, self._sleep = cpu, sleep

    def is_cpu(self):
        return self._cpu

    def is_sleep_mode_available(self):
        return self._sleep


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` package (LLM, SamplingParams, platforms.current_platform) in ``sys.modules``."""
    created: list[FakeLLM] = []

    def make_llm(**kwargs):
        llm = FakeLLM(**kwargs)
        created.append(llm)
        return llm

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.LLM = make_llm
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Platform(cpu=False, sleep=True)
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(rv, "engine_kwargs", lambda **extra: {})
    return SimpleNamespace(created=created, platform=platforms)


def _cfg():
    # the trainer's model section, the one description the sampler builds its engine config from (= MC)
    model = ModelSection(
        arch="llama",
        vocab_size=18,
        hidden_size=32,
        ffn_hidden_size=64,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=2,
        max_position_embeddings=64,
    )
    return SimpleNamespace(model=model, rollout=SimpleNamespace(tp=1, gpu_memory_utilization=0.4))


def _sampler(fake_vllm, tmp_path) -> tuple[VLLMSampler, FakeLLM]:
    s = VLLMSampler(_cfg(), MC, {}, tmp_path / "model", seed=1)
    return s, fake_vllm.created[-1]


def test_a_gpu_engine_is_built_with_sleep_mode(fake_vllm, tmp_path):
    s, llm = _sampler(fake_vllm, tmp_path)
    assert llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["gpu_memory_utilization"] == 0.4
    assert s.sleep_mode
    # a platform without sleep mode (e.g. an accelerator vLLM has no allocator hooks for) is not asked for it
    fake_vllm.platform.current_platform = _Platform(cpu=False, sleep=False)
    _, llm2 = _sampler(fake_vllm, tmp_path)
    assert llm2.kwargs["enable_sleep_mode"] is False


class _DeviceGenerator:
    """A generator on an accelerator, as the trainer's ``torch.Generator(device="cuda")`` is."""

    def __init__(self, device: str):
        self.device = torch.device(device)


def test_seeds_are_drawn_on_the_generators_device(fake_vllm, tmp_path, monkeypatch):
    s, llm = _sampler(fake_vllm, tmp_path)
    gen = _DeviceGenerator("cuda")
    seen = {}

    def randint(low, high, size, *, generator=None, device=None, **kw):
        # torch's own rule: a generator must be of the device the numbers are made on
        want = torch.device(device) if device is not None else torch.device("cpu")
        if generator is not None and generator.device.type != want.type:
            found = generator.device.type
            raise RuntimeError(f"Expected a '{want.type}' device type for generator but found '{found}'")
        seen["device"] = want
        return torch.arange(10, 10 + size[0])

    monkeypatch.setattr(torch, "randint", randint)
    prompts = [torch.tensor([1, 2]), torch.tensor([1, 2])]
    toks, lps = s.generate(prompts, 4, 0, 0, 1.0, 1.0, gen)
    assert seen["device"] == torch.device("cuda")
    assert llm.seeds == [10, 11]  # one seed per request: equal prompts sample different responses
    assert [t.tolist() for t in toks] == [[3, 4], [3, 4]]
    assert lps[0].tolist() == [-0.5, -0.5]
    s.generate(prompts, 4, 0, 0, 1.0, 1.0, gen, greedy=True)
    assert llm.seeds == [None, None]


def test_release_sleeps_at_level_2_and_the_switch_wakes_weights_first(fake_vllm, tmp_path, monkeypatch):
    s, llm = _sampler(fake_vllm, tmp_path)
    monkeypatch.setattr(rv, "load_into", lambda engine, views: llm.calls.append("load"))
    monkeypatch.setattr(rv, "empty_device_cache", lambda: llm.calls.append("empty_cache"))
    s.on_switch()  # the first switch: the engine is awake with dummy weights, which level 2 discards
    s.generate([torch.tensor([1])], 2, 0, 0, 1.0, 1.0, None)
    s.release()  # the rollout is done: give the device memory to training
    s.release()  # idempotent
    with pytest.raises(RuntimeError, match="after release"):
        s.generate([torch.tensor([1])], 2, 0, 0, 1.0, 1.0, None)
    s.on_switch()  # asleep: no second sleep, weights first, KV cache after the training memory is freed
    wake_and_load = ["wake_up(weights)", "load", "empty_cache", "wake_up(kv_cache)", "reset_prefix_cache"]
    assert llm.calls == ["sleep(2)", *wake_and_load, "generate", "sleep(2)", *wake_and_load]


def test_release_without_sleep_mode_does_nothing(fake_vllm, tmp_path):
    fake_vllm.platform.current_platform = _Platform(cpu=False, sleep=False)
    s, llm = _sampler(fake_vllm, tmp_path)
    s.release()
    s.generate([torch.tensor([1])], 2, 0, 0, 1.0, 1.0, None)
    assert llm.calls == ["generate"]


def _no_sleep_llm():
    return FakeLLM(enable_sleep_mode=False)


def test_the_switch_empties_the_npu_cache_on_an_npu(monkeypatch):
    freed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    npu = SimpleNamespace(is_available=lambda: True, empty_cache=lambda: freed.append("npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    out = rv.rollout_switch(_no_sleep_llm(), lambda: 5)
    assert out == 5
    assert freed == ["npu"]


def test_the_switch_empties_the_cuda_cache_on_a_gpu(monkeypatch):
    freed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append("cuda"))
    monkeypatch.delattr(torch, "npu", raising=False)
    rv.rollout_switch(_no_sleep_llm(), lambda: None)
    assert freed == ["cuda"]
    assert rv.empty_device_cache() == ["cuda"]


def test_the_switch_on_a_cpu_frees_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delattr(torch, "npu", raising=False)
    assert rv.empty_device_cache() == []
    assert vllm_rollout.device_engine_kwargs(0.3, _Platform(cpu=False, sleep=True)) == {
        "gpu_memory_utilization": 0.3,
        "enable_sleep_mode": True,
    }
