"""Layout and plan tests (single process): the descriptor plans reproduce the HF checkpoint from Megatron
shards exactly, and the vLLM per-rank tensors equal vLLM's weight-loader rules applied to the HF tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import msrl_core
from msrl_core.reshard import ModelConfig, Parallel, ReshardError, megatron_to_vllm, reference, to_hf
from msrl_core.reshard.layout import vllm_padded_vocab
from reshard_util import CONFIGS, gathered_bucket, random_shards, run_plan_numpy

TRAIN = {
    "tp1": Parallel(tp=1),
    "tp2": Parallel(tp=2),
    "tp4_pp2": Parallel(tp=4, pp=2),
    "tp2_ep2": Parallel(tp=2, ep=2),
}


def _train_ok(cfg: ModelConfig, tr: Parallel) -> bool:
    return (cfg.is_moe or tr.ep == 1) and cfg.num_attention_heads % tr.tp == 0


def _cases():
    for c in CONFIGS:
        for t in TRAIN:
            if _train_ok(CONFIGS[c], TRAIN[t]):
                yield c, t


@pytest.fixture(scope="module")
def shards_and_hf():
    cache = {}

    def get(c, t):
        if (c, t) not in cache:
            cfg, tr = CONFIGS[c], TRAIN[t]
            sh = random_shards(to_hf(cfg, tr), seed=3)
            cache[(c, t)] = (sh, reference.megatron_to_hf(cfg, tr, sh))
        return cache[(c, t)]

    return get


@pytest.mark.parametrize("bucket_bytes", [4 << 10, 1 << 30])
@pytest.mark.parametrize(("cfg_name", "train_name"), list(_cases()))
def test_hf_layout_equals_reference(cfg_name, train_name, bucket_bytes, shards_and_hf):
    cfg, tr = CONFIGS[cfg_name], TRAIN[train_name]
    sh, ref = shards_and_hf(cfg_name, train_name)
    plan = to_hf(cfg, tr)
    got = run_plan_numpy(plan, sh, 0, bucket_bytes)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert tuple(got[k].shape) == tuple(ref[k].shape), k
        assert torch.equal(got[k], ref[k]), k


# --- vLLM's loader rules, written the way vllm's weight_loader methods apply them ------------------------


def vllm_expected(cfg: ModelConfig, infer: Parallel, rank: int, hf: dict) -> dict:
    tp, hs, H = infer.tp, cfg.hd, cfg.hidden_size
    out = {}

    def vocab_parallel(w):  # VocabParallelEmbedding / ParallelLMHead: pad to 64, shard, zero the rest
        per = vllm_padded_vocab(cfg.vocab_size) // tp
        start = rank * per
        end = min(start + per, cfg.vocab_size)
        param = torch.zeros(per, H)
        param[: end - start].copy_(w.narrow(0, start, end - start))
        return param

    def qkv_parallel(prefix, suffix):  # QKVParallelLinear.weight_loader
        nh = cfg.num_attention_heads // tp
        if tp >= cfg.num_key_value_heads:
            nkv, replicas = 1, tp // cfg.num_key_value_heads
        else:
            nkv, replicas = cfg.num_key_value_heads // tp, 1
        rows = (nh + 2 * nkv) * hs
        param = torch.zeros((rows, H) if suffix == "weight" else (rows,))
        for sid, off, size in (("q", 0, nh * hs), ("k", nh * hs, nkv * hs), ("v", (nh + nkv) * hs, nkv * hs)):
            shard_id = rank if sid == "q" else rank // replicas
            loaded = hf[f"{prefix}self_attn.{sid}_proj.{suffix}"]
            param.narrow(0, off, size).copy_(loaded.narrow(0, shard_id * size, size))
        return param

    def merged_column(ws):  # MergedColumnParallelLinear.weight_loader, output_sizes = [F, F]
        sizes = [w.shape[0] for w in ws]
        param = torch.zeros(sum(sizes) // tp, H)
        for i, w in enumerate(ws):
            off, size = sum(sizes[:i]) // tp, sizes[i] // tp
            param.narrow(0, off, size).copy_(w.narrow(0, rank * size, size))
        return param

    def row_parallel(w):  # RowParallelLinear.weight_loader, input_dim 1
        size = w.shape[1] // tp
        return w.narrow(1, rank * size, size).clone()

    out["model.embed_tokens.weight"] = vocab_parallel(hf["model.embed_tokens.weight"])
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = vocab_parallel(hf["lm_head.weight"])
    out["model.norm.weight"] = hf["model.norm.weight"].clone()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n].clone()
        if cfg.qk_norm:
            for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                out[p + n] = hf[p + n].clone()
        out[p + "self_attn.qkv_proj.weight"] = qkv_parallel(p, "weight")
        if cfg.qkv_bias:
            out[p + "self_attn.qkv_proj.bias"] = qkv_parallel(p, "bias")
        out[p + "self_attn.o_proj.weight"] = row_parallel(hf[p + "self_attn.o_proj.weight"])
        if not cfg.is_moe:
            out[p + "mlp.gate_up_proj.weight"] = merged_column(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
            )
            out[p + "mlp.down_proj.weight"] = row_parallel(hf[p + "mlp.down_proj.weight"])
            continue
        out[p + "mlp.gate.weight"] = hf[p + "mlp.gate.weight"].clone()  # ReplicatedLinear
        # FusedMoE: with EP, moe tp = 1 and expert_map "linear" (contiguous); else all experts, tp on I
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        if infer.ep > 1:
            local = list(range(rank * E // infer.ep, (rank + 1) * E // infer.ep))
            mtp, mrank = 1, 0
        else:
            local, mtp, mrank = list(range(E)), tp, rank
        isz = inter // mtp
        w13, w2 = torch.zeros(len(local), 2 * isz, H), torch.zeros(len(local), H, isz)
        for k, e in enumerate(local):
            x = p + f"mlp.experts.{e}."
            w13[k].narrow(0, 0, isz).copy_(hf[x + "gate_proj.weight"].narrow(0, mrank * isz, isz))  # w1
            w13[k].narrow(0, isz, isz).copy_(hf[x + "up_proj.weight"].narrow(0, mrank * isz, isz))  # w3
            w2[k].copy_(hf[x + "down_proj.weight"].narrow(1, mrank * isz, isz))
        out[p + "mlp.experts.w13_weight"], out[p + "mlp.experts.w2_weight"] = w13, w2
        if cfg.shared_expert_intermediate_size:
            s = p + "mlp.shared_expert."
            out[s + "gate_up_proj.weight"] = merged_column(
                [hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]]
            )
            out[s + "down_proj.weight"] = row_parallel(hf[s + "down_proj.weight"])
            out[p + "mlp.shared_expert_gate.weight"] = hf[p + "mlp.shared_expert_gate.weight"].clone()
    return out


def _vllm_cases():
    for c, t in _cases():
        if t in ("tp2", "tp4_pp2", "tp2_ep2"):
            for ti in (1, 2, 4):
                if CONFIGS[c].num_attention_heads % ti == 0:
                    yield c, t, ti, 1
                    if CONFIGS[c].is_moe and ti > 1:
                        yield c, t, ti, ti


@pytest.mark.parametrize(("cfg_name", "train_name", "infer_tp", "infer_ep"), list(_vllm_cases()))
def test_vllm_layout_equals_vllm_loader_rules(cfg_name, train_name, infer_tp, infer_ep, shards_and_hf):
    cfg, tr = CONFIGS[cfg_name], TRAIN[train_name]
    sh, hf = shards_and_hf(cfg_name, train_name)
    infer = Parallel(tp=infer_tp, ep=infer_ep)
    plan = megatron_to_vllm(cfg, tr, infer)
    for rank in range(infer_tp):
        got = run_plan_numpy(plan, sh, rank, 8 << 10)
        exp = vllm_expected(cfg, infer, rank, hf)
        assert sorted(got) == sorted(exp)
        for k in exp:
            assert tuple(got[k].shape) == tuple(exp[k].shape), (k, rank)
            assert torch.equal(got[k], exp[k]), (k, rank)
        # the library's own torch reference (used by verify=True and the naive baseline) agrees too
        lib = reference.hf_to_vllm(cfg, infer, rank, hf)
        assert all(torch.equal(lib[k], exp[k]) for k in exp)


def test_native_engine_runs_the_plans_like_the_reference_executor(shards_and_hf):
    cfg, tr = CONFIGS["qwen2_gqa_bias"], TRAIN["tp2"]
    sh, hf = shards_and_hf("qwen2_gqa_bias", "tp2")
    plan = megatron_to_vllm(cfg, tr, Parallel(tp=4))
    engine = msrl_core.CopyEngine()
    for rank in range(4):
        flat, views = plan.allocate_inference(rank)
        for b, cp in zip(plan.buckets(8 << 10), plan.native_plans(8 << 10, rank)):
            if cp is not None:
                engine.execute(cp, flat, gathered_bucket(plan, b, sh)).wait(30.0)
        exp = vllm_expected(cfg, plan.infer, rank, hf)
        for k in exp:
            assert torch.equal(views[k], exp[k]), (k, rank)


def test_descriptors_are_coalesced_runs_not_per_row_copies():
    cfg = CONFIGS["qwen2_gqa_bias"]
    plan = to_hf(cfg, Parallel(tp=2))
    descs = plan.bucket_descriptors(1 << 30)
    total = sum(len(d) for d in descs)
    # per layer: q/k/v weight+bias one run per head (8+2+2)*2, o_proj 2 column blocks, gate/up 2+2, down 2,
    # 2 norms; plus embedding (2 shard runs), lm_head (2), final norm (1)
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    per_layer = 2 * heads + 2 + 4 + 2 + 2
    assert total <= cfg.num_layers * per_layer + 5
    native = plan.native_plans(1 << 30)
    assert sum(len(p) for p in native if p is not None) <= total
    assert sum(p.bytes for p in native if p is not None) == plan.infer_layout(0)[1] - _padding(plan)


def _padding(plan) -> int:
    layout, total = plan.infer_layout(0)
    used = sum(int(np.prod(s)) * plan.itemsize for _, s in layout.values())
    return total - used


@pytest.mark.parametrize(
    ("kwargs", "train", "infer", "needle"),
    [
        ({}, Parallel(tp=3), Parallel(tp=1), "num_attention_heads"),
        ({}, Parallel(tp=2), Parallel(tp=3), "num_attention_heads"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48, "intermediate_size": 96},
            Parallel(tp=1),
            Parallel(tp=3),
            "vocab",
        ),
        (
            {"num_key_value_heads": 4, "num_attention_heads": 12, "hidden_size": 48, "intermediate_size": 96},
            Parallel(tp=1),
            Parallel(tp=3),
            "num_key_value_heads",
        ),
        ({"intermediate_size": 90}, Parallel(tp=4), Parallel(tp=1), "intermediate_size"),
        ({"num_layers": 3}, Parallel(pp=2), Parallel(tp=1), "num_layers"),
        ({}, Parallel(tp=1, ep=2), Parallel(tp=1), "ep=2"),
        ({}, Parallel(tp=1), Parallel(tp=1, pp=2), "pipeline"),
    ],
)
def test_bad_parallel_sizes_are_rejected_with_the_reason(kwargs, train, infer, needle):
    base = dict(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    base.update(kwargs)
    with pytest.raises(ReshardError) as ei:
        megatron_to_vllm(ModelConfig(**base), train, infer)
    assert needle in str(ei.value) or needle == "pipeline" and "pp" in str(ei.value)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, msrl_core.errors.MsrlError)


def test_model_config_errors_and_from_hf():
    with pytest.raises(ReshardError, match="unknown arch"):
        ModelConfig("gpt2", 64, 2, 4, 4, 128, 100)
    with pytest.raises(ReshardError, match="num_key_value_heads"):
        ModelConfig("llama", 64, 2, 4, 3, 128, 100)
    transformers = pytest.importorskip("transformers")
    c = ModelConfig.from_hf(
        transformers.Qwen2Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            num_hidden_layers=2,
            vocab_size=1000,
        )
    )
    assert (c.arch, c.qkv_bias, c.hd, c.num_key_value_heads) == ("qwen2", True, 16, 2)


@st.composite
def _dense_case(draw):
    hd = draw(st.sampled_from([2, 4, 8]))
    ng = draw(st.sampled_from([1, 2, 4]))
    qpg = draw(st.sampled_from([1, 2, 3]))
    nh = ng * qpg
    arch = draw(st.sampled_from(["llama", "qwen2", "qwen3"]))
    ttp = draw(st.sampled_from([t for t in (1, 2, 4) if nh % t == 0 and (ng % t == 0 or t % ng == 0)]))
    itp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if nh % t == 0 and (ng % t == 0 or t % ng == 0)]))
    cfg = ModelConfig(
        arch,
        hidden_size=draw(st.sampled_from([8, 16])),
        num_layers=2,
        num_attention_heads=nh,
        num_key_value_heads=ng,
        head_dim=hd,
        intermediate_size=8 * 8,
        vocab_size=draw(st.integers(64, 300)) if itp <= 1 else 64 * itp * draw(st.integers(1, 3)) - 5,
        qkv_bias=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        qk_norm=arch == "qwen3",
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 128])),
    )
    pp = draw(st.sampled_from([1, 2]))
    return cfg, Parallel(tp=ttp, pp=pp), Parallel(tp=itp), draw(st.sampled_from([64, 512, 1 << 20]))


@settings(max_examples=40, deadline=None)
@given(_dense_case(), st.integers(0, 7))
def test_random_layouts_match_vllm_rules(case, rank_seed):
    """Property: for random head/kv/TP/PP/vocab/bucket combinations the plan equals vLLM's loader rules."""
    cfg, tr, infer, bucket = case
    plan = megatron_to_vllm(cfg, tr, infer)
    sh = random_shards(plan, seed=rank_seed)
    hf = reference.megatron_to_hf(cfg, tr, sh)
    rank = rank_seed % infer.tp
    got = run_plan_numpy(plan, sh, rank, bucket)
    exp = vllm_expected(cfg, infer, rank, hf)
    assert sorted(got) == sorted(exp)
    for k in exp:
        assert torch.equal(got[k], exp[k]), k


def test_name_map_megatron_hf_vllm():
    cfg = CONFIGS["qwen3_moe"]
    plan = megatron_to_vllm(cfg, Parallel(tp=1, pp=2, ep=2), Parallel(tp=2, ep=2))
    m = plan.name_map(infer_rank=1)
    assert m["model.layers.1.self_attn.qkv_proj.weight"] == [
        (f"model.layers.1.self_attn.{w}_proj.weight", 1, "decoder.layers.0.self_attention.linear_qkv.weight")
        for w in "qkv"
    ]
    # infer EP rank 1 holds experts 2, 3, trained on EP rank 1 as local experts 0, 1
    w13 = m["model.layers.0.mlp.experts.w13_weight"]
    assert [x[0] for x in w13] == [
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3) for p in ("gate", "up")
    ]
    assert {x[2] for x in w13} == {
        f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight" for j in (0, 1)
    }
    assert m["lm_head.weight"] == [("lm_head.weight", 1, "output_layer.weight")]
    assert m["model.embed_tokens.weight"] == [
        ("model.embed_tokens.weight", 0, "embedding.word_embeddings.weight")
    ]
