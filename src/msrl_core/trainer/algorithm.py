"""GRPO as pure torch functions: advantages, loss aggregation, the clipped policy loss, KL estimators,
entropy, log-probs and mini-batch order. No state, no engine: each is unit-tested on hand-computed values.

Shapes: ``B`` rows (responses), ``T`` response tokens; ``mask`` is 1 on real response tokens and 0 on
padding. Names and formulas follow verl's ``core_algos`` so practitioners recognise them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

#: Loss aggregation modes of :func:`agg_loss` (verl's names).
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

#: KL estimators of :func:`kl_penalty`, each alias mapped to its canonical name.
KL_KINDS: Mapping[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}

#: verl clamps the k3 estimate to this range so one outlier token cannot dominate the loss.
K3_CLAMP = 10.0
#: The log-ratio is clamped before ``exp`` so a stale token cannot overflow the ratio (verl: 20).
LOG_RATIO_CLAMP = 20.0


def grpo_advantages(
    rewards: Tensor, group_size: int, norm_adv_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, divided by the group's std + eps
    when ``norm_adv_by_std`` (Dr. GRPO turns it off). Rows are ordered group by group.

    A group of identical rewards gets advantage 0 (no NaN); the std is the unbiased one, as in verl.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    num_rows = rewards.shape[0]
    if num_rows % group_size:
        raise ValueError(
            f"number of rows {num_rows} is not a multiple of group_size {group_size}; "
            f"rows must come in whole groups of {group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = grouped - mean
    if norm_adv_by_std:
        # A group of one has no spread: its advantage is 0 either way, so avoid std's NaN for n=1.
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        centred = centred / (std + eps)
    return centred.reshape(num_rows)


def _check_masked(values: Tensor, mask: Tensor) -> None:
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values and mask must both be [B, T]; got {tuple(values.shape)} and {tuple(mask.shape)}"
        )


def agg_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> Tensor:
    """Reduce a per-token ``values`` [B, T] to a scalar over the masked tokens.

    - ``token-mean``: sum of all tokens / number of tokens (long answers weigh more; verl's default);
    - ``seq-mean-token-mean``: mean over rows of each row's token mean (the original GRPO);
    - ``seq-mean-token-sum``: mean over rows of each row's token sum (Dr. GRPO style).

    Rows with no response token do not count as sequences; an all-empty batch gives 0 (no NaN), with the
    graph kept. For gradient accumulation over micro-batches, pass the whole mini-batch's ``num_tokens``
    (token-mean) or ``num_seqs`` (seq-mean-*) as the denominator, so that summing the micro-batch losses
    gives exactly the mini-batch loss.
    """
    _check_masked(values, mask)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(AGG_MODES)}")
    keep = mask.bool()
    # where, not multiply: a NaN or inf on a padded position must not leak into the loss.
    masked = torch.where(keep, values, torch.zeros_like(values))
    if mode == "token-mean":
        if num_tokens is not None:
            return masked.sum() / max(float(num_tokens), 1.0)
        return masked.sum() / keep.sum().clamp(min=1).to(values.dtype)
    lengths = keep.sum(dim=1)
    present = lengths > 0
    seq = masked.sum(dim=1)
    if mode == "seq-mean-token-mean":
        seq = seq / lengths.clamp(min=1).to(values.dtype)
    if num_seqs is not None:
        return seq.sum() / max(float(num_seqs), 1.0)
    return seq.sum() / present.sum().clamp(min=1).to(values.dtype)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is 1 (0 when the mask is empty)."""
    return agg_loss(values, mask, "token-mean")


def _expand_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} rows, log_prob has {like.shape[0]}")
        return advantages.unsqueeze(1).expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
        )
    return advantages


def check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float) -> None:
    """The clip range [1 - low, 1 + high] must contain 1 and stay positive: 0 <= low < 1, high >= 0."""
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


def policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate loss with an asymmetric clip range (DAPO's clip-higher).

    Per token: ``max(-A * r, -A * clip(r, 1 - low, 1 + high))`` with ``r = exp(log_prob - old_log_prob)``,
    aggregated by ``loss_agg_mode``. Returns the loss and detached stats ``pg_clipfrac`` (share of tokens
    where the clipped term was chosen) and ``ppo_kl`` (masked mean of ``old_log_prob - log_prob``).
    ``num_tokens``/``num_seqs`` pass through to :func:`agg_loss` (the stats, token fractions, use
    ``num_tokens``), so over the micro-batches of a mini-batch the loss and the stats each sum to the
    mini-batch's value.
    """
    check_clip_ratios(clip_ratio_low, clip_ratio_high)
    _check_masked(log_prob, mask)
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {tuple(old_log_prob.shape)} != log_prob shape {tuple(log_prob.shape)}"
        )
    adv = _expand_advantages(advantages, log_prob)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        stats = {
            "pg_clipfrac": agg_loss(
                torch.gt(clipped, unclipped).to(log_prob.dtype), mask, "token-mean", num_tokens=num_tokens
            ),
            "ppo_kl": agg_loss(-log_ratio, mask, "token-mean", num_tokens=num_tokens),
        }
    return loss, stats


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the log-probs of the sampled tokens.

    ``k1`` (``kl``): ``log_prob - ref_log_prob``; ``k2`` (``mse``): ``0.5 * (log_prob - ref_log_prob)^2``;
    ``k3`` (``low_var_kl``): ``exp(ref - lp) - (ref - lp) - 1``, non-negative and clamped to [-10, 10]
    as in verl (Schulman's estimators, http://joschu.net/blog/kl-approx.html).
    """
    canonical = KL_KINDS.get(kind)
    if canonical is None:
        raise ValueError(f"unknown kl_loss_type {kind!r}; allowed: {', '.join(KL_KINDS)}")
    if ref_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"ref_log_prob shape {tuple(ref_log_prob.shape)} != log_prob shape {tuple(log_prob.shape)}"
        )
    diff = log_prob - ref_log_prob
    if canonical == "k1":
        return diff
    if canonical == "k2":
        return 0.5 * diff.square()
    neg = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(neg) - neg - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def _stable(logits: Tensor, temperature: float) -> Tensor:
    """Half-precision logits are reduced in float32 (a bf16 logsumexp over a large vocabulary loses bits);
    logits are divided by the sampling temperature, so the figures describe the distribution sampled."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return z if temperature == 1.0 else z / temperature


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of the categorical distribution over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``
    with ``z = logits / temperature``."""
    z = _stable(logits, temperature)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def log_probs_from_logits(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probability of each ``tokens`` entry under ``logits / temperature`` [..., V]:
    ``z[token] - logsumexp(z)``. Pass the rollout's temperature so the trainer's recompute matches the
    sampler's log-probs. Gathers before normalising, so no [..., V] log-softmax is materialised.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be tokens {tuple(tokens.shape)} plus a vocabulary dim"
        )
    z = _stable(logits, temperature)
    picked = torch.gather(z, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def actor_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    kl_loss_coef: float,
    kl_loss_type: str,
    entropy_coeff: float,
    loss_agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO actor objective: ``pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy``.

    All three terms use ``loss_agg_mode``. Metrics: ``actor/pg_loss``, ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, plus ``actor/kl_loss`` when ``ref_log_prob`` is given and ``actor/entropy`` when
    ``entropy`` is given (a figure that was not computed is left out, never reported as 0).

    Gradient accumulation: pass the whole mini-batch's ``num_tokens`` and ``num_seqs`` to every
    micro-batch's call; then the losses *and every metric* are that micro-batch's share, and summing
    them over the micro-batches gives exactly the mini-batch's values (no further weighting).
    """
    if kl_loss_coef != 0.0 and ref_log_prob is None:
        raise ValueError(f"kl_loss_coef={kl_loss_coef} needs ref_log_prob (the reference policy's log-probs)")
    if entropy_coeff != 0.0 and entropy is None:
        raise ValueError(f"entropy_coeff={entropy_coeff} needs the per-token entropy")

    def agg(values: Tensor) -> Tensor:
        return agg_loss(values, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)

    pg_loss, stats = policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        clip_ratio_low,
        clip_ratio_high,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    loss = pg_loss
    metrics = {
        "actor/pg_loss": float(pg_loss.detach()),
        "actor/pg_clipfrac": float(stats["pg_clipfrac"]),
        "actor/ppo_kl": float(stats["ppo_kl"]),
    }
    # A term with coefficient 0 is reported but kept out of the graph (no backward through it).
    if ref_log_prob is not None:
        kl = agg(kl_penalty(log_prob if kl_loss_coef else log_prob.detach(), ref_log_prob, kl_loss_type))
        loss = loss + kl_loss_coef * kl if kl_loss_coef else loss
        metrics["actor/kl_loss"] = float(kl.detach())
    if entropy is not None:
        ent = agg(entropy if entropy_coeff else entropy.detach())
        loss = loss - entropy_coeff * ent if entropy_coeff else loss
        metrics["actor/entropy"] = float(ent.detach())
    return loss, metrics


def mini_batches(num_rows: int, mini_batch_size: int, ppo_epochs: int, seed: int) -> list[np.ndarray]:
    """Row indices of every mini-batch of every PPO epoch, in order: each epoch is a fresh permutation
    of all rows cut into whole mini-batches, so each row is used exactly once per epoch.

    Deterministic in ``seed`` (pass e.g. the step's seed); the same call always returns the same order.
    """
    if num_rows < 1 or mini_batch_size < 1 or ppo_epochs < 1:
        raise ValueError(
            f"num_rows ({num_rows}), mini_batch_size ({mini_batch_size}) and ppo_epochs ({ppo_epochs}) "
            "must all be >= 1"
        )
    if num_rows % mini_batch_size:
        raise ValueError(
            f"num_rows {num_rows} is not a multiple of mini_batch_size {mini_batch_size}; "
            f"divisors of {num_rows} are allowed"
        )
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for _ in range(ppo_epochs):
        order = rng.permutation(num_rows)
        out.extend(np.split(order, num_rows // mini_batch_size))
    return out
