"""``trainer.device``: resolution (auto is cuda, then npu, then cpu), a clear error for a device this
machine lacks, the process-group backend per device, and engines placed on the selected device (the CPU
here; the GPU/NPU path is exercised by bench/trainer_gpu_check.sh where a GPU is lent)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")

import trainer_util  # noqa: E402
from msrl_core.cli import main  # noqa: E402
from msrl_core.trainer.engines import (  # noqa: E402
    available_devices,
    process_group_backend,
    select_device,
    torch_device,
)


@pytest.mark.parametrize(
    ("available", "expected"),
    [
        (["cpu"], "cpu"),
        (["npu", "cpu"], "npu"),
        (["cuda", "cpu"], "cuda"),
        (["cuda", "npu", "cpu"], "cuda"),
    ],
)
def test_auto_prefers_cuda_then_npu_then_cpu(available, expected):
    assert select_device("auto", available) == expected


def test_explicit_device():
    assert select_device("cpu", ["cuda", "cpu"]) == "cpu"
    assert select_device("npu", ["cuda", "npu", "cpu"]) == "npu"
    with pytest.raises(ValueError, match=r"trainer.device='cuda' is not available .*available: \['cpu'\]"):
        select_device("cuda", ["cpu"])
    with pytest.raises(ValueError, match=r"trainer.device='npu' is not available .*\['cuda', 'cpu'\]"):
        select_device("npu", ["cuda", "cpu"])
    with pytest.raises(ValueError, match=r"one of \['auto', 'cpu', 'cuda', 'npu'\]; got 'tpu'"):
        select_device("tpu", ["cpu"])


def test_this_machine():
    avail = available_devices()
    assert avail[-1] == "cpu"
    assert select_device("auto") == avail[0]
    if not torch.cuda.is_available():
        assert "cuda" not in avail
    if avail == ["cpu"]:  # this CI machine: auto resolves to the CPU
        assert select_device("auto") == "cpu"
    assert torch_device("cpu") == torch.device("cpu")


def test_process_group_backend_per_device():
    assert [process_group_backend(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="'tpu'"):
        process_group_backend("tpu")


def test_unavailable_device_is_a_clear_error(tmp_path, capsys):
    if "cuda" in available_devices():
        pytest.skip("a GPU is visible here")
    args = ["demo", *trainer_util.TINY, f"trainer.output_dir={tmp_path}", "--no-progress"]
    assert main([*args, "trainer.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "trainer.device='cuda' is not available" in err and "available: ['cpu']" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing started


def test_hf_engines_on_the_selected_device():
    from msrl_core.reshard import to_hf
    from msrl_core.trainer.actor import response_log_probs
    from msrl_core.trainer.config import ModelSection
    from msrl_core.trainer.engines.hf import HFSampler, HFTrainEngine
    from msrl_core.trainer.grpo import pack

    section = ModelSection(
        arch="llama", hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=18, make_vocab_size_divisible_by=8, qkv_bias=False,
        max_position_embeddings=32,
    )  # fmt: skip
    dev = select_device("auto")
    eng = HFTrainEngine(section, seed=3, device=dev)
    cfg = eng.model_config
    assert {p.device.type for p in eng.parameters()} == {dev}
    assert {b.device.type for b in eng.model.buffers()} == {dev}  # rotary frequencies built there
    plan = to_hf(cfg, eng.parallel)
    flat, views = plan.allocate_inference(device=eng.device)
    sampler = HFSampler(section, views, dev)
    eng.switch(flat, plan, 1 << 20, swap=True)
    prompt = torch.tensor([1, 5, 13, 6, 16])
    toks, lps = sampler.generate([prompt], 4, 2, 0, 1.0, 1.0, torch.Generator(eng.device).manual_seed(0))
    eng.switch_back()
    assert toks[0].device.type == dev and len(toks[0]) == len(lps[0]) >= 1
    pk = pack([prompt.numpy()], [toks[0].cpu().numpy()], 0).to(eng.device)
    with torch.no_grad():
        lp, _, _ = response_log_probs(eng, pk, slice(None), 1.0)
    n = len(toks[0])  # the sampler sampled with the weights the engine trains
    assert torch.allclose(lp[0, :n].cpu(), lps[0].cpu(), atol=1e-5)
