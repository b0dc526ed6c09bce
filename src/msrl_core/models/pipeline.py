"""A differentiable forward through megatron-core's pipeline stages: the logits of the last stage arrive
on one stage's ranks (``dst``, default the first, where a trainer's driver rank lives), and a backward from
a loss there runs every stage's backward, stage by stage, with the activations' gradients sent between them.

Every rank of the pipeline group calls :func:`pipeline_forward` with the same tokens; on ``dst`` it returns
the logits, elsewhere an *anchor* (a scalar): after the ``dst`` rank's ``loss.backward()`` starts, every
other rank calls ``anchor.backward()`` (in any order: each one waits for the gradient it needs). With one
stage it is the model's own forward. Point-to-point sends and receives over ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["finish_grads", "grad_norm", "pipeline_forward"]


def _peer(group: Any, stage: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, stage)


class _SendForward(torch.autograd.Function):
    """Forward: send ``y`` to ``peer``, return an anchor. Backward: receive ``y``'s gradient from ``peer``."""

    @staticmethod
    def forward(ctx, y, peer, group):  # type: ignore[override]
        import torch.distributed as dist

        dist.send(y.detach().contiguous(), dst=peer, group=group)
        ctx.peer, ctx.group, ctx.shape, ctx.dtype = peer, group, y.shape, y.dtype
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        import torch.distributed as dist

        g = torch.empty(ctx.shape, dtype=ctx.dtype, device=_.device)
        dist.recv(g, src=ctx.peer, group=ctx.group)
        return g, None, None


class _Recv(torch.autograd.Function):
    """Forward: receive a tensor of ``shape`` from ``peer`` (``anchor`` orders it after the anchor's graph).
    Backward: send its gradient back to ``peer``."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, peer, group):  # type: ignore[override]
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(x, src=peer, group=group)
        ctx.peer, ctx.group = peer, group
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        import torch.distributed as dist

        dist.send(g.contiguous(), dst=ctx.peer, group=ctx.group)
        return torch.zeros((), dtype=g.dtype, device=g.device), None, None, None, None


def pipeline_forward(
    model: Any,
    tokens: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    group: Any = None,
    dst: int = 0,
) -> torch.Tensor:
    """Logits ``[batch, seq, padded vocab]`` of ``model`` (this rank's ``GPTModel`` stage, built with
    ``parallel_output=False``) on the ranks of stage ``dst``; an anchor elsewhere (see the module docstring).

    ``group``: the pipeline group (default: megatron-core's); ``position_ids`` default ``0..seq-1``. Without
    grad mode it is a plain forward (no anchors to call)."""
    import torch.distributed as dist

    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    if group is None:
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return model(tokens, position_ids, attention_mask)
        group = ps.get_pipeline_model_parallel_group()
    pp, stage = dist.get_world_size(group), dist.get_rank(group)
    if pp == 1:
        return model(tokens, position_ids, attention_mask)
    if not 0 <= dst < pp:
        raise ValueError(f"dst stage {dst} outside [0, {pp})")
    cfg = model.config
    b, s = tokens.shape
    hidden = (s, b, cfg.hidden_size)
    dtype = cfg.pipeline_dtype or cfg.params_dtype
    anchor = torch.zeros((), device=tokens.device, requires_grad=torch.is_grad_enabled())
    if stage > 0:
        h = _Recv.apply(anchor, hidden, dtype, _peer(group, stage - 1), group)
        model.set_input_tensor(h)
    y = model(tokens, position_ids, attention_mask)
    last = stage == pp - 1
    if not last:
        anchor = _SendForward.apply(y, _peer(group, stage + 1), group)
    if last and stage == dst:
        return y
    if last:  # the logits go to dst
        return _SendForward.apply(y, _peer(group, dst), group)
    if stage == dst:
        return _Recv.apply(anchor, (b, s, model.vocab_size), dtype, _peer(group, pp - 1), group)
    return anchor


def finish_grads(model: Any) -> None:
    """Complete the gradients of one batch that every rank of the model's groups ran alike (a driver's
    batch mirrored on its followers), before the optimizer step:

    - TP > 1 with QK norm: the q/k layernorm weights (shared by all heads; each TP rank saw its own heads)
      get the sum of the TP ranks' gradients, as megatron-core's ``finalize_model_grads`` does;
    - PP > 1 with tied embeddings: the first stage's embedding and the last stage's copy of it (the output
      layer) get the sum of both gradients (all-reduce over megatron-core's embedding group), so both copies
      step alike — what megatron-core's ``finalize_model_grads`` does for a DDP-wrapped model;
    - MoE with EP or TP > 1: expert gradients are divided by the expert TP x EP size — the token dispatcher
      gathers the tokens over that group (no sequence parallelism: each of its ranks holds the same batch),
      so every expert saw the batch that many times while the dense layers saw it once.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1 and getattr(model.config, "qk_layernorm", False):
        # QK norm weights are shared by the heads, and each TP rank holds only its heads: sum their grads
        for name, p in model.named_parameters():
            if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if tied and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        w = model.shared_embedding_or_output_weight()
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=ps.get_embedding_group())
    # the token dispatcher gathers the tokens over the expert TP x EP group; without sequence parallelism
    # every rank of it holds the same batch, so each expert saw it that many times
    dispatch = ps.get_expert_tensor_and_model_parallel_world_size()
    if dispatch > 1 and getattr(model.config, "num_moe_experts", None):
        for name, p in model.named_parameters():
            if p.grad is not None and ".mlp.experts." in name:  # routed experts (not the shared expert)
                p.grad.div_(dispatch)


def grad_norm(model: Any) -> float:
    """The global L2 norm of the gradients of the whole model from this rank's shard (every rank of the
    model's TP x PP x EP grid calls it; each gets the same value): TP-sharded parameters summed over the TP
    group, replicated ones once, experts over the EP group (and the expert-TP group when it is larger than
    one), all of it over the PP stages; the last stage's copy of a tied embedding (megatron's ``shared``
    attribute) is not counted twice."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = next(model.parameters()).device
    dense_tp = torch.zeros((), dtype=torch.float64, device=device)
    dense = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    ep = ps.get_expert_model_parallel_world_size()
    for p in model.parameters():
        if p.grad is None or getattr(p, "shared", False):
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if ep > 1 and not getattr(p, "allreduce", True):
            expert += sq
        elif getattr(p, "tensor_model_parallel", False):
            dense_tp += sq
        else:
            dense += sq
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(dense_tp, group=ps.get_tensor_model_parallel_group())
    if ep > 1:
        dist.all_reduce(expert, group=ps.get_expert_model_parallel_group())
        if ps.get_expert_tensor_parallel_world_size() > 1:
            dist.all_reduce(expert, group=ps.get_expert_tensor_parallel_group())
    total = dense_tp + dense + expert
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return float(total.sqrt())
