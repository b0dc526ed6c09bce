"""Model layout specs: Megatron parameter sets per PP stage, HF tensors with their Megatron sources, and the
inference targets (HF layout, or vLLM per-rank layout) as lists of pieces.

Name map, Megatron (local layer spec; TE-spec aliases accepted) -> HF -> vLLM, layer ``i`` global
(``L.`` = ``decoder.layers.i.`` / ``model.layers.i.``):

- ``embedding.word_embeddings.weight`` -> ``model.embed_tokens.weight`` -> same
- ``L.input_layernorm.weight`` (TE: ``L.self_attention.linear_qkv.layer_norm_weight``) -> same HF/vLLM name
- ``L.self_attention.linear_qkv.{weight,bias}`` -> ``L.self_attn.{q,k,v}_proj.*`` -> ``L.self_attn.qkv_proj``
- ``L.self_attention.linear_proj.weight`` -> ``L.self_attn.o_proj.weight`` -> same
- ``L.self_attention.{q,k}_layernorm.weight`` -> ``L.self_attn.{q,k}_norm.weight`` -> same
- ``L.pre_mlp_layernorm.weight`` (TE: ``L.mlp.linear_fc1.layer_norm_weight``) -> ``post_attention_layernorm``
- ``L.mlp.linear_fc1.weight`` -> ``L.mlp.{gate,up}_proj.weight`` -> ``L.mlp.gate_up_proj.weight``
- ``L.mlp.linear_fc2.weight`` -> ``L.mlp.down_proj.weight`` -> same
- ``L.mlp.router.weight`` -> ``L.mlp.gate.weight`` -> same
- ``L.mlp.experts.local_experts.j.linear_fc1.weight`` (TE grouped: ``L.mlp.experts.linear_fc1.weight{j}``)
  -> ``L.mlp.experts.e.{gate,up}_proj.weight`` -> ``L.mlp.experts.w13_weight[e_local]``
- ``L.mlp.experts.local_experts.j.linear_fc2.weight`` -> ``L.mlp.experts.e.down_proj.weight``
  -> ``L.mlp.experts.w2_weight[e_local]``
- ``L.mlp.shared_experts.linear_fc1/fc2.weight`` -> ``L.mlp.shared_expert.{gate,up,down}_proj.weight``
  -> ``L.mlp.shared_expert.gate_up_proj`` / ``down_proj``; ``L.mlp.shared_experts.gate_weight``
  -> ``L.mlp.shared_expert_gate.weight``
- ``decoder.final_layernorm.weight`` -> ``model.norm.weight``; ``output_layer.weight`` -> ``lm_head.weight``
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .errors import ReshardError
from .layout import (
    HFTensor,
    ModelConfig,
    Parallel,
    Piece,
    Source,
    Target,
    megatron_padded_vocab,
    vllm_padded_vocab,
)

# TE layer-spec names accepted as aliases of the local-spec names (fused layernorm weights).
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _divide(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise ReshardError(f"{what}: {a} is not divisible by {b}")
    return a // b


def check_train(cfg: ModelConfig, train: Parallel) -> None:
    t = train.tp
    _divide(cfg.num_attention_heads, t, f"num_attention_heads vs training tp={t}")
    ng = cfg.num_key_value_heads
    if ng % t and t % ng:
        raise ReshardError(f"num_key_value_heads={ng} and training tp={t}: one must divide the other")
    _divide(cfg.intermediate_size, t, f"intermediate_size vs training tp={t}")
    _divide(
        cfg.num_layers, train.pp, f"num_layers vs training pp={train.pp} (uneven stages are not supported)"
    )
    if cfg.is_moe:
        _divide(cfg.num_experts, train.ep, f"num_experts vs training ep={train.ep}")
        if train.ep > 1 and train.expert_tp != 1:
            raise ReshardError(f"training ep={train.ep} needs expert tp 1, got etp={train.expert_tp}")
        if train.ep == 1 and train.expert_tp != t:
            raise ReshardError(f"training ep=1 needs expert tp == tp ({t}), got etp={train.expert_tp}")
        _divide(cfg.moe_intermediate_size, train.expert_tp, "moe_intermediate_size vs training expert tp")
        if cfg.shared_expert_intermediate_size:
            _divide(
                cfg.shared_expert_intermediate_size, t, f"shared_expert_intermediate_size vs training tp={t}"
            )
    elif train.ep != 1:
        raise ReshardError(f"training ep={train.ep} given for dense arch {cfg.arch!r}")


def check_infer(cfg: ModelConfig, infer: Parallel) -> None:
    t = infer.tp
    if infer.pp != 1:
        raise ReshardError(f"inference pp must be 1 (vLLM-style), got {infer.pp}")
    _divide(cfg.num_attention_heads, t, f"num_attention_heads vs inference tp={t}")
    ng = cfg.num_key_value_heads
    if ng % t and t % ng:
        raise ReshardError(f"num_key_value_heads={ng} and inference tp={t}: one must divide the other")
    _divide(cfg.intermediate_size, t, f"intermediate_size vs inference tp={t}")
    _divide(vllm_padded_vocab(cfg.vocab_size), t, f"vLLM-padded vocab (multiple of 64) vs inference tp={t}")
    if cfg.is_moe:
        if infer.ep not in (1, t):
            raise ReshardError(f"inference ep must be 1 or equal to inference tp ({t}), got {infer.ep}")
        if infer.ep > 1:
            _divide(cfg.num_experts, infer.ep, f"num_experts vs inference ep={infer.ep}")
        else:
            _divide(cfg.moe_intermediate_size, t, f"moe_intermediate_size vs inference tp={t}")
        if cfg.shared_expert_intermediate_size:
            _divide(
                cfg.shared_expert_intermediate_size, t, f"shared_expert_intermediate_size vs inference tp={t}"
            )
    elif infer.ep != 1:
        raise ReshardError(f"inference ep={infer.ep} given for dense arch {cfg.arch!r}")


# ----------------------------------------------------------------------------------------------------
# Megatron parameters


def stage_layers(cfg: ModelConfig, train: Parallel, stage: int) -> range:
    n = cfg.num_layers // train.pp
    return range(stage * n, (stage + 1) * n)


def megatron_stage_params(
    cfg: ModelConfig, train: Parallel, stage: int
) -> list[tuple[str, tuple[int, ...], str]]:
    """``(local name, local shape, gather group)`` of each parameter of one PP stage (all TP/EP ranks)."""
    check_train(cfg, train)
    t, H, hd = train.tp, cfg.hidden_size, cfg.hd
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    vpad = megatron_padded_vocab(cfg.vocab_size, cfg.make_vocab_size_divisible_by, t)
    out: list[tuple[str, tuple[int, ...], str]] = []
    last = stage == train.pp - 1
    if stage == 0:
        out.append(("embedding.word_embeddings.weight", (vpad // t, H), "tp"))
    qkv_rows = (nh + 2 * ng) * hd
    for li in range(len(stage_layers(cfg, train, stage))):
        p = f"decoder.layers.{li}."
        out.append((p + "input_layernorm.weight", (H,), "tp"))
        out.append((p + "self_attention.linear_qkv.weight", (qkv_rows // t, H), "tp"))
        if cfg.qkv_bias:
            out.append((p + "self_attention.linear_qkv.bias", (qkv_rows // t,), "tp"))
        out.append((p + "self_attention.linear_proj.weight", (H, nh * hd // t), "tp"))
        if cfg.qk_norm:
            out.append((p + "self_attention.q_layernorm.weight", (hd,), "tp"))
            out.append((p + "self_attention.k_layernorm.weight", (hd,), "tp"))
        out.append((p + "pre_mlp_layernorm.weight", (H,), "tp"))
        if not cfg.is_moe:
            F = cfg.intermediate_size
            out.append((p + "mlp.linear_fc1.weight", (2 * F // t, H), "tp"))
            out.append((p + "mlp.linear_fc2.weight", (H, F // t), "tp"))
            continue
        out.append((p + "mlp.router.weight", (cfg.num_experts, H), "tp"))
        et, El, Fm = train.expert_tp, cfg.num_experts // train.ep, cfg.moe_intermediate_size
        grp = "ep" if train.ep > 1 else "tp"
        for j in range(El):
            q = p + f"mlp.experts.local_experts.{j}."
            out.append((q + "linear_fc1.weight", (2 * Fm // et, H), grp))
            out.append((q + "linear_fc2.weight", (H, Fm // et), grp))
        if cfg.shared_expert_intermediate_size:
            Fs = cfg.shared_expert_intermediate_size
            out.append((p + "mlp.shared_experts.linear_fc1.weight", (2 * Fs // t, H), "tp"))
            out.append((p + "mlp.shared_experts.linear_fc2.weight", (H, Fs // t), "tp"))
            out.append((p + "mlp.shared_experts.gate_weight", (1, H), "tp"))
    if last:
        out.append(("decoder.final_layernorm.weight", (H,), "tp"))
        if not cfg.tie_word_embeddings or train.pp > 1:
            out.append(("output_layer.weight", (vpad // t, H), "tp"))
    return out


def canonical_megatron_name(name: str) -> str:
    """Map TE-spec / grouped-expert names to the local-spec names used by the layout spec."""
    for te, local in TE_ALIASES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    if ".mlp.experts.linear_fc" in name and ".weight" in name:  # TEGroupedMLP: linear_fc1.weight{j}
        head, tail = name.split(".mlp.experts.", 1)
        fc, idx = tail.split(".weight", 1)
        if idx.isdigit():
            return f"{head}.mlp.experts.local_experts.{idx}.{fc}.weight"
    return name


# ----------------------------------------------------------------------------------------------------
# row maps (HF row -> (group member, local row))


def _even(full_rows: np.ndarray, local_rows: int) -> tuple[np.ndarray, np.ndarray]:
    return full_rows // local_rows, full_rows % local_rows


def _qkv_map(cfg: ModelConfig, t: int, which: str, unit: int):
    """HF q/k/v rows -> Megatron interleaved linear_qkv rows. ``unit`` = rows per head-dim element (1)."""
    nh, ng, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd
    qpg = nh // ng
    per_group = (qpg + 2) * hd
    local = (nh + 2 * ng) * hd // t

    def f(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        head, d = rows // hd, rows % hd
        if which == "q":
            full = (head // qpg) * per_group + (head % qpg) * hd + d
        elif which == "k":
            full = head * per_group + qpg * hd + d
        else:
            full = head * per_group + (qpg + 1) * hd + d
        return _even(full, local)

    return f


def _fc1_map(F: int, t: int, which: str):
    """HF gate/up rows -> Megatron fc1 shards ``[gate_r; up_r]``."""
    f_loc = F // t

    def f(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r, pos = rows // f_loc, rows % f_loc
        return r, pos + (f_loc if which == "up" else 0)

    return f


def _owner_map(member: int, offset: int):
    """A whole expert on EP member ``member``; HF rows shifted by ``offset`` inside the fused fc1."""

    def f(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.full_like(rows, member), rows + offset

    return f


def _plain_map(local: int):
    return lambda rows: _even(rows, local)


def hf_tensors(cfg: ModelConfig, train: Parallel) -> dict[str, HFTensor]:
    """Every HF checkpoint tensor with its Megatron source (checkpoint names, per-expert MoE tensors)."""
    check_train(cfg, train)
    t, H, hd, V = train.tp, cfg.hidden_size, cfg.hd, cfg.vocab_size
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    vpad = megatron_padded_vocab(V, cfg.make_vocab_size_divisible_by, t)
    out: dict[str, HFTensor] = {}

    def add(name, shape, src):
        out[name] = HFTensor(name, tuple(shape), src)

    def rep(param, stage, shape):
        return Source(param, stage, "tp", shape, "whole", 1, None, 0)

    def rows_src(param, stage, local_shape, fn, group="tp", members=t):
        return Source(param, stage, group, local_shape, "rows", members, fn)

    def cols_src(param, stage, local_shape, members=t, group="tp"):
        return Source(param, stage, group, local_shape, "cols", members)

    last = train.pp - 1
    add(
        "model.embed_tokens.weight",
        (V, H),
        rows_src("embedding.word_embeddings.weight", 0, (vpad // t, H), _plain_map(vpad // t)),
    )
    qkv_local = (nh + 2 * ng) * hd // t
    for s in range(train.pp):
        for li, gi in enumerate(stage_layers(cfg, train, s)):
            p, h = f"decoder.layers.{li}.", f"model.layers.{gi}."
            add(h + "input_layernorm.weight", (H,), rep(p + "input_layernorm.weight", s, (H, 1)))
            for w, n in (("q", nh), ("k", ng), ("v", ng)):
                add(
                    h + f"self_attn.{w}_proj.weight",
                    (n * hd, H),
                    rows_src(
                        p + "self_attention.linear_qkv.weight", s, (qkv_local, H), _qkv_map(cfg, t, w, 1)
                    ),
                )
                if cfg.qkv_bias:
                    add(
                        h + f"self_attn.{w}_proj.bias",
                        (n * hd,),
                        rows_src(
                            p + "self_attention.linear_qkv.bias", s, (qkv_local, 1), _qkv_map(cfg, t, w, 1)
                        ),
                    )
            add(
                h + "self_attn.o_proj.weight",
                (H, nh * hd),
                cols_src(p + "self_attention.linear_proj.weight", s, (H, nh * hd // t)),
            )
            if cfg.qk_norm:
                add(
                    h + "self_attn.q_norm.weight",
                    (hd,),
                    rep(p + "self_attention.q_layernorm.weight", s, (hd, 1)),
                )
                add(
                    h + "self_attn.k_norm.weight",
                    (hd,),
                    rep(p + "self_attention.k_layernorm.weight", s, (hd, 1)),
                )
            add(h + "post_attention_layernorm.weight", (H,), rep(p + "pre_mlp_layernorm.weight", s, (H, 1)))

            def mlp(mp: str, hp: str, F: int, tt: int, group: str, member: int | None, s: int = s):
                fc1, fc2 = mp + "linear_fc1.weight", mp + "linear_fc2.weight"
                if member is None:  # TP-sharded
                    for w in ("gate", "up"):
                        add(
                            hp + f"{w}_proj.weight",
                            (F, H),
                            rows_src(fc1, s, (2 * F // tt, H), _fc1_map(F, tt, w), group, tt),
                        )
                    add(hp + "down_proj.weight", (H, F), cols_src(fc2, s, (H, F // tt), tt, group))
                else:  # whole expert on EP member `member`
                    for w in ("gate", "up"):
                        off = F if w == "up" else 0
                        add(
                            hp + f"{w}_proj.weight",
                            (F, H),
                            Source(
                                fc1,
                                s,
                                group,
                                (2 * F, H),
                                "rows",
                                1,
                                _owner_map(member, off),
                            ),
                        )
                    add(
                        hp + "down_proj.weight",
                        (H, F),
                        Source(fc2, s, group, (H, F), "whole", 1, None, member),
                    )

            if not cfg.is_moe:
                mlp(p + "mlp.", h + "mlp.", cfg.intermediate_size, t, "tp", None)
                continue
            E = cfg.num_experts
            add(h + "mlp.gate.weight", (E, H), rep(p + "mlp.router.weight", s, (E, H)))
            El = E // train.ep
            for e in range(E):
                mp = p + f"mlp.experts.local_experts.{e % El}."
                hp = h + f"mlp.experts.{e}."
                if train.ep > 1:
                    mlp(mp, hp, cfg.moe_intermediate_size, 1, "ep", e // El)
                else:
                    mlp(mp, hp, cfg.moe_intermediate_size, train.expert_tp, "tp", None)
            if cfg.shared_expert_intermediate_size:
                mlp(
                    p + "mlp.shared_experts.",
                    h + "mlp.shared_expert.",
                    cfg.shared_expert_intermediate_size,
                    t,
                    "tp",
                    None,
                )
                add(
                    h + "mlp.shared_expert_gate.weight",
                    (1, H),
                    rep(p + "mlp.shared_experts.gate_weight", s, (1, H)),
                )
    add("model.norm.weight", (H,), rep("decoder.final_layernorm.weight", last, (H, 1)))
    if not cfg.tie_word_embeddings:
        add(
            "lm_head.weight",
            (V, H),
            rows_src("output_layer.weight", last, (vpad // t, H), _plain_map(vpad // t)),
        )
    return out


# ----------------------------------------------------------------------------------------------------
# inference targets


def _whole(hf: HFTensor, name: str | None = None) -> Target:
    return Target(name or hf.name, hf.shape, [Piece(hf.name, 0, hf.rows, 0, hf.cols, 0)])


def hf_targets(cfg: ModelConfig, hf: dict[str, HFTensor]) -> list[Target]:
    """The HF checkpoint layout: every tensor whole (what ``to_hf`` produces on every rank)."""
    return [_whole(t) for t in hf.values()]


def vllm_targets(cfg: ModelConfig, hf: dict[str, HFTensor], infer: Parallel, rank: int) -> list[Target]:
    """vLLM's per-rank tensors for inference TP rank ``rank`` (vLLM's weight-loader rules)."""
    check_infer(cfg, infer)
    t, H, hd, V = infer.tp, cfg.hidden_size, cfg.hd, cfg.vocab_size
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    if not 0 <= rank < t:
        raise ReshardError(f"inference rank {rank} outside [0, {t})")
    out: list[Target] = []

    def vocab(hf_name: str, name: str) -> Target:
        per = vllm_padded_vocab(V) // t
        start, end = rank * per, min((rank + 1) * per, V)
        pieces = [Piece(hf_name, start, end - start, 0, H, 0)] if end > start else []
        return Target(name, (per, H), pieces)  # rows [end-start, per) stay zero (vLLM fills 0)

    def col_split(names: Iterable[str], name: str, ncols: int) -> Target:
        # MergedColumnParallelLinear: concat of each input's rank slice on dim 0
        pieces, row = [], 0
        for n in names:
            r = hf[n].rows // t
            pieces.append(Piece(n, rank * r, r, 0, ncols, row))
            row += r
        return Target(name, (row, ncols) if ncols > 1 else (row,), pieces)

    def row_split(n: str, name: str) -> Target:
        rows, cols = hf[n].rows, hf[n].cols // t
        return Target(name, (rows, cols), [Piece(n, 0, rows, rank * cols, cols, 0)])

    qh = nh // t
    if ng >= t:
        kvh, kv_rank = ng // t, rank
    else:
        kvh, kv_rank = 1, rank // (t // ng)  # vLLM: shard_rank = tp_rank // num_kv_head_replicas

    def qkv(h: str, suffix: str) -> Target:
        cols = H if suffix == "weight" else 1
        pieces = [
            Piece(h + f"self_attn.q_proj.{suffix}", rank * qh * hd, qh * hd, 0, cols, 0),
            Piece(h + f"self_attn.k_proj.{suffix}", kv_rank * kvh * hd, kvh * hd, 0, cols, qh * hd),
            Piece(h + f"self_attn.v_proj.{suffix}", kv_rank * kvh * hd, kvh * hd, 0, cols, (qh + kvh) * hd),
        ]
        rows = (qh + 2 * kvh) * hd
        return Target(h + f"self_attn.qkv_proj.{suffix}", (rows, H) if cols > 1 else (rows,), pieces)

    out.append(vocab("model.embed_tokens.weight", "model.embed_tokens.weight"))
    for i in range(cfg.num_layers):
        h = f"model.layers.{i}."
        out.append(_whole(hf[h + "input_layernorm.weight"]))
        out.append(qkv(h, "weight"))
        if cfg.qkv_bias:
            out.append(qkv(h, "bias"))
        out.append(row_split(h + "self_attn.o_proj.weight", h + "self_attn.o_proj.weight"))
        if cfg.qk_norm:
            out.append(_whole(hf[h + "self_attn.q_norm.weight"]))
            out.append(_whole(hf[h + "self_attn.k_norm.weight"]))
        out.append(_whole(hf[h + "post_attention_layernorm.weight"]))
        if not cfg.is_moe:
            out.append(
                col_split(
                    [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], h + "mlp.gate_up_proj.weight", H
                )
            )
            out.append(row_split(h + "mlp.down_proj.weight", h + "mlp.down_proj.weight"))
            continue
        out.append(_whole(hf[h + "mlp.gate.weight"]))
        E, Fm = cfg.num_experts, cfg.moe_intermediate_size
        if infer.ep > 1:
            El, experts, et, er = (
                E // infer.ep,
                range(rank * (E // infer.ep), (rank + 1) * (E // infer.ep)),
                1,
                0,
            )
        else:
            El, experts, et, er = E, range(E), t, rank
        f = Fm // et
        w13, w2 = (
            Target(h + "mlp.experts.w13_weight", (El, 2 * f, H)),
            Target(h + "mlp.experts.w2_weight", (El, H, f)),
        )
        for k, e in enumerate(experts):
            x = h + f"mlp.experts.{e}."
            w13.pieces.append(
                Piece(x + "gate_proj.weight", er * f, f, 0, H, k * 2 * f)
            )  # w1 = gate, first half
            w13.pieces.append(Piece(x + "up_proj.weight", er * f, f, 0, H, k * 2 * f + f))  # w3 = up
            w2.pieces.append(Piece(x + "down_proj.weight", 0, H, er * f, f, k * H))
        out += [w13, w2]
        if cfg.shared_expert_intermediate_size:
            s = h + "mlp.shared_expert."
            out.append(
                col_split([s + "gate_proj.weight", s + "up_proj.weight"], s + "gate_up_proj.weight", H)
            )
            out.append(row_split(s + "down_proj.weight", s + "down_proj.weight"))
            out.append(_whole(hf[h + "mlp.shared_expert_gate.weight"]))
    out.append(_whole(hf["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        out.append(vocab("lm_head.weight", "lm_head.weight"))
    return out


# ----------------------------------------------------------------------------------------------------
# the reverse direction: HF checkpoint -> one rank's Megatron shards


def _reverse_pieces(t: HFTensor, member: int) -> list[Piece]:
    """The pieces of HF tensor ``t`` that group member ``member`` holds, in its local parameter's rows/cols:
    the inverse of ``t.src`` (one rule read both ways)."""
    src = t.src
    if src.mode == "whole":
        # replicated (tp group): on every member; a whole expert (ep group): on its owner only
        if src.group == "ep" and src.member != member:
            return []
        return [Piece(t.name, 0, t.rows, 0, t.cols, 0)]
    if src.mode == "cols":
        lcols = src.local_shape[1]
        if member >= src.members:
            return []
        return [Piece(t.name, 0, t.rows, member * lcols, lcols, 0)]
    assert src.row_map is not None
    rows = np.arange(t.rows, dtype=np.int64)
    owner, lrow = src.row_map(rows)
    sel = owner == member
    hr, lr = rows[sel], lrow[sel]
    if not len(hr):
        return []
    brk = np.flatnonzero((np.diff(hr) != 1) | (np.diff(lr) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(hr)]))
    return [Piece(t.name, int(hr[a]), int(b - a), 0, t.cols, int(lr[a])) for a, b in zip(starts, ends)]


def megatron_targets(
    cfg: ModelConfig, train: Parallel, hf: dict[str, HFTensor], stage: int, tp_rank: int, ep_rank: int
) -> list[Target]:
    """The Megatron parameters of one training rank (PP ``stage``, TP rank, EP rank) as targets built from
    HF checkpoint pieces: :func:`hf_tensors`' sources read in reverse. ``Piece`` coordinates: HF rows/cols
    (``row0``, ``col0``) -> local rows (``dst_row``) of the parameter seen as ``[rows, cols]``; local rows no
    piece covers are Megatron's vocab padding (zero). A tied output layer on a later PP stage (Megatron's
    copy of the embedding) is built from ``model.embed_tokens.weight`` by the embedding's own rule."""
    check_train(cfg, train)
    for what, v, n in (
        ("stage", stage, train.pp),
        ("tp_rank", tp_rank, train.tp),
        ("ep_rank", ep_rank, train.ep),
    ):
        if not 0 <= v < n:
            raise ReshardError(f"{what} {v} outside [0, {n})")
    member = {"tp": tp_rank, "ep": ep_rank}
    out = {n: Target(n, shape) for n, shape, _ in megatron_stage_params(cfg, train, stage)}
    for t in hf.values():
        if t.src.stage == stage:
            out[t.src.param].pieces += _reverse_pieces(t, member[t.src.group])
    tied = out.get("output_layer.weight")
    if tied is not None and cfg.tie_word_embeddings:
        emb = hf["model.embed_tokens.weight"]
        tied.pieces += _reverse_pieces(emb, member[emb.src.group])
    return list(out.values())
