"""Reference (slow) path written with plain torch reshapes and slicing, independent of the descriptor
builder: Megatron shards -> HF tensors -> vLLM per-rank tensors. Used by ``verify=True``, by the naive
baseline (per-parameter all-gather + torch slicing) and by the benchmark.
"""

from __future__ import annotations

from typing import Any

from .layout import ModelConfig, Parallel, megatron_padded_vocab, vllm_padded_vocab
from .spec import stage_layers

Shards = dict  # (stage, tp_rank, ep_rank) -> {local name: tensor}


def megatron_to_hf(cfg: ModelConfig, train: Parallel, shards: Shards) -> dict[str, Any]:
    import torch

    t, H, hd, V = train.tp, cfg.hidden_size, cfg.hd, cfg.vocab_size
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    qpg = nh // ng
    out: dict[str, Any] = {}

    def tp(stage: int, name: str, ep: int = 0) -> list:
        return [shards[(stage, r, ep)][name] for r in range(t)]

    def fc1_split(parts: list) -> tuple[Any, Any]:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])

    last = train.pp - 1
    vpad = megatron_padded_vocab(V, cfg.make_vocab_size_divisible_by, t)
    emb = torch.cat(tp(0, "embedding.word_embeddings.weight"))
    assert emb.shape[0] == vpad
    out["model.embed_tokens.weight"] = emb[:V]
    for s in range(train.pp):
        for li, gi in enumerate(stage_layers(cfg, train, s)):
            p, h = f"decoder.layers.{li}.", f"model.layers.{gi}."
            r0 = shards[(s, 0, 0)]
            out[h + "input_layernorm.weight"] = r0[p + "input_layernorm.weight"]
            for suf in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                full = torch.cat(tp(s, p + f"self_attention.linear_qkv.{suf}"))
                g = full.reshape(ng, qpg + 2, hd, -1)
                tail = (H,) if suf == "weight" else ()
                out[h + f"self_attn.q_proj.{suf}"] = g[:, :qpg].reshape(nh * hd, *tail)
                out[h + f"self_attn.k_proj.{suf}"] = g[:, qpg].reshape(ng * hd, *tail)
                out[h + f"self_attn.v_proj.{suf}"] = g[:, qpg + 1].reshape(ng * hd, *tail)
            out[h + "self_attn.o_proj.weight"] = torch.cat(
                tp(s, p + "self_attention.linear_proj.weight"), dim=1
            )
            if cfg.qk_norm:
                out[h + "self_attn.q_norm.weight"] = r0[p + "self_attention.q_layernorm.weight"]
                out[h + "self_attn.k_norm.weight"] = r0[p + "self_attention.k_layernorm.weight"]
            out[h + "post_attention_layernorm.weight"] = r0[p + "pre_mlp_layernorm.weight"]
            if not cfg.is_moe:
                gate, up = fc1_split(tp(s, p + "mlp.linear_fc1.weight"))
                out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
                out[h + "mlp.down_proj.weight"] = torch.cat(tp(s, p + "mlp.linear_fc2.weight"), dim=1)
                continue
            out[h + "mlp.gate.weight"] = r0[p + "mlp.router.weight"]
            El = cfg.num_experts // train.ep
            for e in range(cfg.num_experts):
                q, x = p + f"mlp.experts.local_experts.{e % El}.", h + f"mlp.experts.{e}."
                if train.ep > 1:
                    own = shards[(s, 0, e // El)]
                    gate, up = own[q + "linear_fc1.weight"].chunk(2, dim=0)
                    down = own[q + "linear_fc2.weight"]
                else:
                    gate, up = fc1_split(tp(s, q + "linear_fc1.weight"))
                    down = torch.cat(tp(s, q + "linear_fc2.weight"), dim=1)
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"], out[x + "down_proj.weight"] = (
                    gate,
                    up,
                    down,
                )
            if cfg.shared_expert_intermediate_size:
                q, x = p + "mlp.shared_experts.", h + "mlp.shared_expert."
                gate, up = fc1_split(tp(s, q + "linear_fc1.weight"))
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate, up
                out[x + "down_proj.weight"] = torch.cat(tp(s, q + "linear_fc2.weight"), dim=1)
                out[h + "mlp.shared_expert_gate.weight"] = r0[q + "gate_weight"]
    out["model.norm.weight"] = shards[(last, 0, 0)]["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = torch.cat(tp(last, "output_layer.weight"))[:V]
    return out


def hf_to_vllm(cfg: ModelConfig, infer: Parallel, rank: int, hf: dict[str, Any]) -> dict[str, Any]:
    """vLLM loader rules applied with torch slicing (QKVParallelLinear, MergedColumnParallelLinear,
    RowParallelLinear, VocabParallelEmbedding padded to 64, FusedMoE w13/w2)."""
    import torch

    t, hd, V = infer.tp, cfg.hd, cfg.vocab_size
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, Any] = {}

    def chunk(x, dim=0):
        return x.chunk(t, dim=dim)[rank]

    def vocab(x):
        per = vllm_padded_vocab(V) // t
        y = x.new_zeros((per, x.shape[1]))
        part = x[rank * per : min((rank + 1) * per, V)]
        y[: part.shape[0]] = part
        return y

    reps = max(1, t // ng)
    kr = rank // reps
    kvh = max(1, ng // t)
    for name, x in hf.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab(x)
        elif ".self_attn.q_proj." in name:
            suf = name.rsplit(".", 1)[1]
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            qh = nh // t
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [
                    x[rank * qh * hd : (rank + 1) * qh * hd],
                    k[kr * kvh * hd : (kr + 1) * kvh * hd],
                    v[kr * kvh * hd : (kr + 1) * kvh * hd],
                ]
            )
            del suf
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        elif name.endswith("o_proj.weight") or (
            name.endswith("down_proj.weight") and ".experts." not in name
        ):
            out[name] = chunk(x, 1)
        elif name.endswith("gate_proj.weight") and ".experts." not in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [chunk(x), chunk(hf[name.replace("gate_proj", "up_proj")])]
            )
        elif name.endswith("up_proj.weight") and ".experts." not in name or ".mlp.experts." in name:
            continue
        else:
            out[name] = x
    if cfg.is_moe:
        E = cfg.num_experts
        for i in range(cfg.num_layers):
            h = f"model.layers.{i}.mlp.experts."
            if infer.ep > 1:
                El = E // infer.ep
                ids = range(rank * El, (rank + 1) * El)

                def sl(x, dim=0):
                    return x
            else:
                ids = range(E)
                sl = chunk
            out[h + "w13_weight"] = torch.stack(
                [
                    torch.cat([sl(hf[h + f"{e}.gate_proj.weight"]), sl(hf[h + f"{e}.up_proj.weight"])])
                    for e in ids
                ]
            )
            out[h + "w2_weight"] = torch.stack([sl(hf[h + f"{e}.down_proj.weight"], 1) for e in ids])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
