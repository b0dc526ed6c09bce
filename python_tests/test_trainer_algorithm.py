"""GRPO algorithm functions against values computed by hand (see each test's comment)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from msrl_core.trainer.algorithm import (
    AGG_MODES,
    actor_loss,
    agg_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    log_probs_from_logits,
    mini_batches,
    policy_loss,
)

LN2 = math.log(2.0)


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# --- grpo_advantages -----------------------------------------------------------------------------


def test_advantages_two_groups_hand_computed():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/sqrt(0.5) = +-1/sqrt(2)
    # group [3, 1]: mean 2, unbiased std sqrt(2) -> +-1/sqrt(2)
    adv = grpo_advantages(t([1.0, 0.0, 3.0, 1.0]), group_size=2, eps=0.0)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, t([s, -s, s, -s], torch.float32))


def test_advantages_std_eps_and_no_std():
    # [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1] / (1 + eps)
    adv = grpo_advantages(t([1.0, 2.0, 3.0]), group_size=3, eps=0.5)
    torch.testing.assert_close(adv, t([-1 / 1.5, 0.0, 1 / 1.5], torch.float32))
    raw = grpo_advantages(t([1.0, 2.0, 5.0]), group_size=3, norm_adv_by_std=False)
    torch.testing.assert_close(raw, t([-5 / 3, -2 / 3, 7 / 3], torch.float32))


def test_advantages_identical_group_is_zero_not_nan():
    adv = grpo_advantages(t([0.5, 0.5, 0.5, 1.0, 0.0, 1.0]), group_size=3)
    assert torch.isfinite(adv).all()
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # the other group: [1, 0, 1] mean 2/3, std sqrt(1/3)
    torch.testing.assert_close(adv[3:], t([1 / 3, -2 / 3, 1 / 3], torch.float32) / (math.sqrt(1 / 3) + 1e-6))


def test_advantages_group_of_one_is_zero():
    adv = grpo_advantages(t([3.0, -1.0]), group_size=1)
    assert adv.tolist() == [0.0, 0.0]


def test_advantages_bad_batch_names_both_numbers():
    with pytest.raises(ValueError, match=r"5 .*group_size 2"):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        grpo_advantages(torch.zeros(2), group_size=0)


# --- agg_loss ------------------------------------------------------------------------------------

VALUES = [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]]
MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]  # third row: a zero-length response


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-mean", (2.0 + 4.0) / 2),  # row means 2 and 4; the empty row does not count
        ("seq-mean-token-sum", (6.0 + 4.0) / 2),
    ],
)
def test_agg_loss_modes(mode, expected):
    assert agg_loss(t(VALUES), t(MASK), mode).item() == pytest.approx(expected)


def test_agg_loss_padding_nan_does_not_leak():
    vals = t(VALUES)
    vals[1, 2] = float("nan")
    vals[2, 0] = float("inf")
    for mode in AGG_MODES:
        assert torch.isfinite(agg_loss(vals, t(MASK), mode))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_all_empty_is_zero_with_graph(mode):
    vals = torch.ones(2, 3, requires_grad=True)
    loss = agg_loss(vals, torch.zeros(2, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert vals.grad is not None and vals.grad.abs().sum().item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_micro_batches_sum_to_whole(mode):
    vals, mask = t(VALUES), t(MASK)
    whole = agg_loss(vals, mask, mode)
    num_tokens = float(mask.sum())
    num_seqs = float((mask.sum(1) > 0).sum())
    parts = sum(
        agg_loss(vals[i : i + 1], mask[i : i + 1], mode, num_tokens=num_tokens, num_seqs=num_seqs)
        for i in range(3)
    )
    assert float(parts) == pytest.approx(whole.item())


def test_agg_loss_bad_input():
    with pytest.raises(ValueError, match=r"'token-sum'.*token-mean, seq-mean-token-mean"):
        agg_loss(t(VALUES), t(MASK), "token-sum")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        agg_loss(torch.zeros(2, 3), torch.zeros(2, 2), "token-mean")


# --- policy_loss ---------------------------------------------------------------------------------


def _ratios_case():
    # one token per row; ratio r = exp(lp - old); clip range [0.8, 1.28] (low 0.2, high 0.28)
    ratios = [1.5, 0.5, 0.5, 1.5, 1.25, 0.79]
    adv = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    # per-token max(-A r, -A clip(r)):
    #  A=+1 r=1.5  -> max(-1.5, -1.28) = -1.28  clipped (upper bound)
    #  A=+1 r=0.5  -> max(-0.5, -0.8)  = -0.5   not clipped (lower bound does not bind for A>0)
    #  A=-1 r=0.5  -> max(0.5, 0.8)    =  0.8   clipped (lower bound)
    #  A=-1 r=1.5  -> max(1.5, 1.28)   =  1.5   not clipped
    #  A=+1 r=1.25 -> max(-1.25, -1.25) = -1.25 inside clip-higher (symmetric 0.2 would clip to -1.2)
    #  A=-1 r=0.79 -> max(0.79, 0.8)   =  0.8   clipped at the lower bound
    per_token = [-1.28, -0.5, 0.8, 1.5, -1.25, 0.8]
    clipped = [1, 0, 1, 0, 0, 1]
    old = torch.zeros(6, 1, dtype=torch.float64)
    lp = torch.log(t(ratios)).unsqueeze(1)
    return lp, old, t(adv), per_token, clipped, ratios


def test_policy_loss_asymmetric_clip_hand_computed():
    lp, old, adv, per_token, clipped, ratios = _ratios_case()
    lp.requires_grad_(True)
    loss, stats = policy_loss(lp, old, adv, torch.ones(6, 1), 0.2, 0.28, "token-mean")
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    assert stats["pg_clipfrac"].item() == pytest.approx(3 / 6)
    # ppo_kl = mean(old - lp) = -mean(log r)
    assert stats["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 6)
    loss.backward()
    # d/dlp of -A r is -A r on unclipped tokens, 0 on clipped ones; token-mean divides by 6
    expected = [0.0 if c else -a * r / 6 for c, a, r in zip(clipped, adv.tolist(), ratios)]
    torch.testing.assert_close(lp.grad.squeeze(1), t(expected))


def test_policy_loss_symmetric_clip_clips_1_25():
    lp, old, adv, *_ = _ratios_case()
    loss, stats = policy_loss(lp[4:5], old[4:5], adv[4:5], torch.ones(1, 1), 0.2, 0.2, "token-mean")
    assert loss.item() == pytest.approx(-1.2)
    assert stats["pg_clipfrac"].item() == 1.0


def test_policy_loss_on_policy_equals_minus_advantage_and_token_advantages():
    # ratio 1 everywhere: loss = mean(-A) over masked tokens; A given per token [B, T]
    lp = torch.zeros(2, 2, dtype=torch.float64)
    adv = t([[1.0, 3.0], [2.0, 100.0]])
    mask = t([[1, 1], [1, 0]])
    loss, stats = policy_loss(lp, lp, adv, mask, 0.2, 0.2, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(2.0 + 2.0) / 2)
    assert stats["pg_clipfrac"].item() == 0.0 and stats["ppo_kl"].item() == 0.0


def test_policy_loss_bad_input():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), 1.0, 0.2, "token-mean")
    with pytest.raises(ValueError, match="clip_ratio_high"):
        policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), 0.2, -0.1, "token-mean")
    with pytest.raises(ValueError, match="advantages has 3 rows"):
        policy_loss(z, z, torch.zeros(3), torch.ones(2, 3), 0.2, 0.2, "token-mean")
    with pytest.raises(ValueError, match="old_log_prob shape"):
        policy_loss(z, torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3), 0.2, 0.2, "token-mean")


# --- kl_penalty ----------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    lp, ref = t([0.0, LN2]), t([LN2, 0.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), t([-LN2, LN2]))
    torch.testing.assert_close(kl_penalty(lp, ref, "kl"), t([-LN2, LN2]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), t([0.5 * LN2**2] * 2))
    torch.testing.assert_close(kl_penalty(lp, ref, "mse"), t([0.5 * LN2**2] * 2))
    # k3 = exp(ref - lp) - (ref - lp) - 1: (2 - ln2 - 1, 0.5 + ln2 - 1)
    k3 = t([1 - LN2, LN2 - 0.5])
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), k3)


def test_k3_is_clamped_to_10_and_zero_on_equal():
    lp, ref = t([0.0, 0.0, -3.0]), t([20.0, -50.0, -3.0])
    assert kl_penalty(lp, ref, "k3").tolist() == [10.0, 10.0, 0.0]


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match=r"'k4'.*k1.*low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# --- entropy and log-probs -----------------------------------------------------------------------


def test_entropy_hand_computed():
    logits = t([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]])
    logits[1, 2:] = -1e30  # effectively impossible tokens
    # uniform over 4 -> ln 4; p = (1/4, 3/4) -> -(1/4 ln 1/4 + 3/4 ln 3/4)
    expected = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(entropy_from_logits(logits), t(expected))


def test_entropy_and_logprob_large_logits_and_bf16():
    big = torch.tensor([[1e4, 0.0, 0.0]])
    assert entropy_from_logits(big).item() == pytest.approx(0.0, abs=1e-6)
    assert log_probs_from_logits(big, torch.tensor([1])).item() == pytest.approx(-1e4)
    bf = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.bfloat16)
    out = log_probs_from_logits(bf, torch.tensor([1]))
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(math.log(0.75), abs=2e-3)  # ln 3 rounds in bf16
    assert entropy_from_logits(bf).dtype == torch.float32


def test_log_probs_match_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_probs_from_logits(logits, tokens), ref)
    # hand value: logits (0, ln 3), token 1 -> ln 0.75
    assert log_probs_from_logits(t([[0.0, math.log(3.0)]]), torch.tensor([1])).item() == pytest.approx(
        math.log(0.75)
    )
    with pytest.raises(ValueError, match="vocabulary dim"):
        log_probs_from_logits(logits, tokens[:, :3])


def test_temperature_scales_logits():
    # logits (0, 2 ln 3) at temperature 2 are (0, ln 3): p = (1/4, 3/4)
    logits = t([[0.0, 2 * math.log(3.0)]])
    lp = log_probs_from_logits(logits, torch.tensor([1]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(0.75))
    ent = entropy_from_logits(logits, temperature=2.0)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        entropy_from_logits(logits, temperature=0.0)


# --- actor_loss ----------------------------------------------------------------------------------


def test_actor_loss_combines_terms():
    # on-policy (ratio 1), A = (1, -1): pg per token (-1, 1), token-mean over 3 tokens with mask
    lp = t([[0.0, 0.0], [0.0, 0.0]])
    ref = t([[LN2, LN2], [LN2, 0.0]])
    mask = t([[1, 1], [1, 0]])
    ent = t([[1.0, 2.0], [3.0, 50.0]])
    loss, m = actor_loss(
        lp,
        lp,
        ref,
        t([1.0, -1.0]),
        mask,
        ent,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_loss_coef=0.5,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.1,
        loss_agg_mode="token-mean",
    )
    pg = (-1 - 1 + 1) / 3
    kl = 3 * (1 - LN2) / 3  # k3 at ref - lp = ln 2 on every masked token
    entropy = (1 + 2 + 3) / 3
    assert m["actor/pg_loss"] == pytest.approx(pg)
    assert m["actor/kl_loss"] == pytest.approx(kl)
    assert m["actor/entropy"] == pytest.approx(entropy)
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/ppo_kl"] == 0.0
    assert loss.item() == pytest.approx(pg + 0.5 * kl - 0.1 * entropy)
    assert all(isinstance(v, float) for v in m.values())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_actor_loss_micro_batch_shares_sum_to_the_mini_batch(mode):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 5
    lp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # some tokens clip
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T)
    mask[1, 2:] = 0
    mask[4, :] = 0  # an empty response
    kw = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        entropy_coeff=0.01,
        loss_agg_mode=mode,
    )
    whole_loss, whole = actor_loss(lp, old, ref, adv, mask, ent, **kw)
    assert 0 < whole["actor/pg_clipfrac"] < 1
    ntok, nseq = float(mask.sum()), float((mask.sum(1) > 0).sum())
    total_loss, summed = 0.0, dict.fromkeys(whole, 0.0)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, m = actor_loss(
            lp[rows],
            old[rows],
            ref[rows],
            adv[rows],
            mask[rows],
            ent[rows],
            num_tokens=ntok,
            num_seqs=nseq,
            **kw,
        )
        total_loss += loss.item()
        for k, v in m.items():
            summed[k] += v
    assert total_loss == pytest.approx(whole_loss.item())
    for k, v in whole.items():
        assert summed[k] == pytest.approx(v), k


def test_actor_loss_zero_coefficient_terms_are_metrics_only():
    lp = torch.zeros(1, 2, requires_grad=True)
    ent = torch.sqrt(lp * 0.0) + 1.5  # depends on lp with a NaN gradient: 0 * NaN would poison lp.grad
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, kl_loss_type="k1", loss_agg_mode="token-mean")
    ref = torch.full((1, 2), -1.0)
    loss, m = actor_loss(
        lp, lp.detach(), ref, torch.ones(1), torch.ones(1, 2), ent, kl_loss_coef=0.0, entropy_coeff=0.0, **kw
    )
    assert m["actor/kl_loss"] == 1.0 and m["actor/entropy"] == 1.5
    loss.backward()
    # only the policy term: d/dlp mean(-A * exp(lp - old)) = -1/2 per token
    assert lp.grad.tolist() == [[-0.5, -0.5]]


def test_actor_loss_without_reference_or_entropy():
    lp = torch.zeros(1, 2)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, kl_loss_type="k1", loss_agg_mode="token-mean")
    loss, m = actor_loss(
        lp, lp, None, torch.ones(1), torch.ones(1, 2), None, kl_loss_coef=0.0, entropy_coeff=0.0, **kw
    )
    assert set(m) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"}
    assert loss.item() == -1.0
    with pytest.raises(ValueError, match="kl_loss_coef=0.1 needs ref_log_prob"):
        actor_loss(
            lp, lp, None, torch.ones(1), torch.ones(1, 2), None, kl_loss_coef=0.1, entropy_coeff=0.0, **kw
        )
    with pytest.raises(ValueError, match="entropy_coeff=0.01 needs"):
        actor_loss(
            lp, lp, None, torch.ones(1), torch.ones(1, 2), None, kl_loss_coef=0.0, entropy_coeff=0.01, **kw
        )


# --- mini_batches --------------------------------------------------------------------------------


def test_mini_batches_cover_each_row_once_per_epoch():
    batches = mini_batches(8, 4, ppo_epochs=3, seed=7)
    assert len(batches) == 6 and all(len(b) == 4 for b in batches)
    for e in range(3):
        assert sorted(np.concatenate(batches[2 * e : 2 * e + 2]).tolist()) == list(range(8))
    again = mini_batches(8, 4, ppo_epochs=3, seed=7)
    assert all((a == b).all() for a, b in zip(batches, again))
    epochs = [np.concatenate(batches[2 * e : 2 * e + 2]).tolist() for e in range(3)]
    assert len({tuple(x) for x in epochs}) > 1  # reshuffled per epoch (fixed seed: deterministic)


def test_mini_batches_whole_batch_and_errors():
    (only,) = mini_batches(5, 5, 1, seed=0)
    assert sorted(only.tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"num_rows 6 .*mini_batch_size 4"):
        mini_batches(6, 4, 1, seed=0)
    with pytest.raises(ValueError, match="ppo_epochs \\(0\\)"):
        mini_batches(4, 4, 0, seed=0)
