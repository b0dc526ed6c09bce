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
from safetensors.torch import save_file

from msrl_core.models import CheckpointError, ShardLayout, load_hf_checkpoint
from msrl_core.reshard import Parallel, reference, to_hf
from reshard_util import CONFIGS

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


def _attempt(path, cfg, train=TP2, rank=1, shards=None):
    plan = to_hf(cfg, train)
    sh = shards if shards is not None else {n: torch.full(s, 7.0) for n, s in plan.train_shapes(0).items()}
    before = {n: t.clone() for n, t in sh.items()}
    with pytest.raises(CheckpointError) as ei:
        load_hf_checkpoint(sh, str(path), ShardLayout(train, 0, rank, 0), config=cfg)
    assert all(torch.equal(before[n], sh[n]) for n in sh)  # nothing written
    return str(ei.value)


def test_bad_checkpoints_name_the_file_and_the_tensor(tmp_path):
    cfg = CONFIGS["qwen2_gqa_bias"]
    _checkpoint(cfg, str(tmp_path))
    f = os.path.join(str(tmp_path), "model.safetensors")

    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    msg = _attempt(tmp_path, cfg)
    assert "'model.layers.1.self_attn.v_proj.bias'" in msg and str(tmp_path) in msg

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
