"""load_hf_checkpoint into plain ``{name: tensor}`` shards (no Megatron, one process): every rank of every
layout (TP, PP, EP, with the layout features of reshard_util.CONFIGS) filled from a safetensors checkpoint
by the reshard plan run in reverse, then reassembled by the independent torch reference
(reshard.reference.megatron_to_hf): equal to the checkpoint, bit for bit. Bad checkpoints: one error naming
the file and the tensor, nothing written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from msrl_core.models import CheckpointError, ModelConfig, ShardLayout, load_hf_checkpoint
from msrl_core.reshard import Parallel, reference, to_hf
from reshard_util import CONFIGS, random_shards

LAYOUTS = [Parallel(tp=1), Parallel(tp=2), Parallel(pp=2), Parallel(tp=2, pp=2)]
MOE_LAYOUTS = [Parallel(ep=2), Parallel(tp=2, ep=2), Parallel(ep=4)]
TP2 = Parallel(tp=2)


def _checkpoint(cfg, path, dtype=torch.float32, shards: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(t.shape, generator=g).to(dtype) for n, t in to_hf(cfg, Parallel()).hf.items()}
    os.makedirs(path, exist_ok=True)
    if shards == 1:
        save_file(hf, os.path.join(path, "model.safetensors"))
    else:
        names, wm = sorted(hf), {}
        for i in range(shards):
            f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: hf[n] for n in part}, os.path.join(path, f))
            wm.update(dict.fromkeys(part, f))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": wm}, fh)
    return hf


def _empty_shards(plan, stage):
    return {n: torch.full(s, float("nan")) for n, s in plan.train_shapes(stage).items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_rank_of_every_layout_loads_exactly(tmp_path, name):
    cfg = CONFIGS[name]
    hf = _checkpoint(cfg, str(tmp_path), shards=3)
    for train in LAYOUTS + (MOE_LAYOUTS if cfg.is_moe else []):
        plan = to_hf(cfg, train)
        shards = {}
        for s in range(train.pp):
            for r in range(train.tp):
                for e in range(train.ep):
                    sh = _empty_shards(plan, s)
                    rep = load_hf_checkpoint(sh, str(tmp_path), ShardLayout(train, s, r, e), config=cfg)
                    assert not [n for n, t in sh.items() if t.isnan().any()], (train, s, r, e)
                    assert rep.bytes_read <= sum(t.numel() * 4 for t in sh.values())
                    shards[(s, r, e)] = sh
        back = reference.megatron_to_hf(cfg, train, shards)
        assert sorted(back) == sorted(hf)
        bad = [n for n in hf if not torch.equal(back[n].reshape(hf[n].shape), hf[n])]
        assert not bad, (train, bad)
        V = cfg.vocab_size
        emb = torch.cat([shards[(0, r, 0)]["embedding.word_embeddings.weight"] for r in range(train.tp)])
        assert torch.equal(emb[V:], torch.zeros_like(emb[V:]))  # Megatron's vocab padding: zero
        if cfg.tie_word_embeddings and train.pp > 1:  # the last stage's copy of the tied embedding
            last = train.pp - 1
            out = torch.cat([shards[(last, r, 0)]["output_layer.weight"] for r in range(train.tp)])
            assert torch.equal(out, emb)


def test_a_bf16_checkpoint_is_cast_to_the_parameters_dtype(tmp_path):
    cfg = CONFIGS["qwen2_gqa_bias"]
    hf = _checkpoint(cfg, str(tmp_path), dtype=torch.bfloat16)
    plan = to_hf(cfg, Parallel())
    sh = _empty_shards(plan, 0)
    load_hf_checkpoint(sh, str(tmp_path), ShardLayout(), config=cfg)
    assert sh["decoder.layers.0.mlp.linear_fc2.weight"].dtype == torch.float32
    assert torch.equal(
        sh["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.0.mlp.down_proj.weight"].float()
    )


def _rewrite(path, fn):
    from safetensors.torch import load_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f)


def _attempt(path, cfg, train=TP2, rank=1, shards=None, ep_rank=0):
    plan = to_hf(cfg, train)
    sh = shards if shards is not None else {n: torch.full(s, 7.0) for n, s in plan.train_shapes(0).items()}
    before = {n: t.clone() for n, t in sh.items()}
    with pytest.raises(CheckpointError) as ei:
        load_hf_checkpoint(sh, str(path), ShardLayout(train, 0, rank, ep_rank), config=cfg)
    assert all(torch.equal(before[n], sh[n]) for n in sh)  # nothing written
    return str(ei.value)


def test_bad_checkpoints_name_the_file_and_the_tensor(tmp_path):
    cfg = CONFIGS["qwen2_gqa_bias"]
    _checkpoint(cfg, str(tmp_path))
    f = os.path.join(str(tmp_path), "model.safetensors")

    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    msg = _attempt(tmp_path, cfg)
    assert "'model.layers.1.self_attn.v_proj.bias'" in msg and f"(not in {f})" in msg

    _checkpoint(cfg, str(tmp_path))
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}))
    msg = _attempt(tmp_path, cfg)
    assert (
        "'model.layers.0.mlp.up_proj.weight'" in msg and f in msg and "(95, 64)" in msg and "(96, 64)" in msg
    )

    os.remove(f)
    msg = _attempt(tmp_path, cfg)
    assert "model.safetensors" in msg and "model.safetensors.index.json" in msg
    assert "does not exist" in _attempt(tmp_path / "nowhere", cfg)


def test_a_partial_sharded_checkpoint_names_the_missing_file(tmp_path):
    cfg = CONFIGS["qwen3_moe"]
    _checkpoint(cfg, str(tmp_path), shards=3)
    index = os.path.join(str(tmp_path), "model.safetensors.index.json")
    with open(index) as fh:
        full = json.load(fh)
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    with open(index, "w") as fh:
        json.dump({"weight_map": {k: v for k, v in full["weight_map"].items() if k != gone}}, fh)
    for ep_rank in (0, 1):  # EP rank 1 holds expert 3; EP rank 0 refuses the partial checkpoint too
        msg = _attempt(tmp_path, cfg, Parallel(ep=2), rank=0, ep_rank=ep_rank)
        assert f"'{gone}'" in msg and f"(not in {index})" in msg
    with open(index, "w") as fh:
        json.dump(full, fh)
    os.remove(os.path.join(str(tmp_path), "model-00002-of-00003.safetensors"))
    msg = _attempt(tmp_path, cfg, Parallel(ep=2), rank=0)
    assert "model-00002-of-00003.safetensors" in msg and "does not exist" in msg
    with open(os.path.join(str(tmp_path), "model.safetensors.index.json"), "w") as fh:
        fh.write("{}")
    assert "weight_map" in _attempt(tmp_path, cfg, Parallel(ep=2), rank=0)


def test_shards_that_do_not_fit_the_layout_are_refused(tmp_path):
    cfg = CONFIGS["qwen2_gqa_bias"]
    _checkpoint(cfg, str(tmp_path))
    plan = to_hf(cfg, Parallel(tp=2))
    sh = {n: torch.zeros(s) for n, s in plan.train_shapes(0).items()}
    sh.pop("decoder.layers.0.self_attention.linear_qkv.bias")
    assert "'decoder.layers.0.self_attention.linear_qkv.bias'" in _attempt(tmp_path, cfg, shards=sh)
    sh = {n: torch.zeros(s) for n, s in plan.train_shapes(0).items()}
    sh["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(64, 96)  # a TP 1 shape on a TP 2 rank
    msg = _attempt(tmp_path, cfg, shards=sh)
    assert "'decoder.layers.0.mlp.linear_fc2.weight'" in msg and "(64, 96)" in msg and "(64, 48)" in msg
    sh = {n: torch.zeros(s) for n, s in plan.train_shapes(0).items()}
    sh["decoder.layers.9.mlp.linear_fc2.weight"] = torch.zeros(1)
    assert "'decoder.layers.9.mlp.linear_fc2.weight'" in _attempt(tmp_path, cfg, shards=sh)


@st.composite
def _layout_case(draw):
    hd = draw(st.sampled_from([2, 4]))
    ng = draw(st.sampled_from([1, 2, 4]))
    nh = ng * draw(st.sampled_from([1, 2, 3]))
    moe = draw(st.booleans())
    arch = "qwen3_moe" if moe else draw(st.sampled_from(["llama", "qwen2", "qwen3"]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if nh % t == 0 and (ng % t == 0 or t % ng == 0)]))
    cfg = ModelConfig(
        arch,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=nh,
        num_key_value_heads=ng,
        head_dim=hd,
        intermediate_size=16,
        vocab_size=draw(st.integers(20, 90)),
        qkv_bias=arch == "qwen2",
        tie_word_embeddings=draw(st.booleans()),
        qk_norm=arch.startswith("qwen3"),
        num_experts=4 if moe else 0,
        moe_intermediate_size=8 if moe else 0,
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 32])),
    )
    ep = draw(st.sampled_from([1, 2, 4])) if moe else 1
    return cfg, Parallel(tp=tp, pp=draw(st.sampled_from([1, 2])), ep=ep)


@settings(max_examples=60, deadline=None)
@given(_layout_case(), st.integers(0, 3))
def test_the_reverse_plan_is_the_inverse_of_the_forward_plan(case, seed):
    """Property: for random heads / KV heads / TP / PP / EP / vocab padding / tying, every element of every
    rank's parameters is written by at most one piece; those written equal Megatron's shards that the
    forward rules (reshard.reference) turned into the HF tensors, and those not written are vocab padding."""
    cfg, train = case
    plan = to_hf(cfg, train)
    shards = random_shards(plan, seed)
    hf = {
        n: t.reshape(plan.hf[n].rows, plan.hf[n].cols)
        for n, t in reference.megatron_to_hf(cfg, train, shards).items()
    }
    for (s, r, e), orig in shards.items():
        for t in plan.megatron_targets(s, r, e):
            got = torch.zeros(t.rows, t.cols)
            count = torch.zeros(t.rows, t.cols, dtype=torch.int64)
            for pc in t.pieces:
                dst = (slice(pc.dst_row, pc.dst_row + pc.nrows), slice(pc.dst_col, pc.dst_col + pc.ncols))
                got[dst] = hf[pc.hf][pc.row0 : pc.row0 + pc.nrows, pc.col0 : pc.col0 + pc.ncols]
                count[dst] += 1
            assert int(count.max()) <= 1, t.name
            want = orig[t.name].reshape(t.rows, t.cols)
            if (
                t.name == "output_layer.weight" and cfg.tie_word_embeddings
            ):  # Megatron's copy of the embedding
                want = shards[(0, r, e)]["embedding.word_embeddings.weight"]
            assert torch.equal(got[count == 1], want[count == 1]), (t.name, s, r, e)
            unwritten = (count == 0).all(dim=1).nonzero().flatten()
            if len(unwritten):
                assert t.name in ("embedding.word_embeddings.weight", "output_layer.weight"), t.name
                assert int(unwritten.min()) + r * t.rows >= cfg.vocab_size  # global rows past the vocab
            assert int(count.sum()) + len(unwritten) * t.cols == t.rows * t.cols  # no partial rows
