"""Padding invariance of every masked function (hypothesis).

A batch is built twice: "clean" (T = longest row, padding = 0) and "padded" (extra columns appended, all
padding filled with garbage: nan, +-inf, huge or ordinary numbers). Results on real tokens must be the
same, masked outputs must be 0 on padding, and losses must give exactly zero gradient to padded positions.
"""

import math
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import (
    KL_ESTIMATORS,
    clipped_value_loss,
    compute_gae,
    explained_variance,
    kl_penalty,
    kl_penalty_policy_loss,
    kl_shaped_rewards,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
)

CLOSE = {"atol": 1e-5, "rtol": 1e-5}


@dataclass
class Batch:
    lengths: list[int]
    steps: int  # clean T
    padded_steps: int
    garbage: float
    gen: torch.Generator

    def mask(self, padded: bool) -> torch.Tensor:
        steps = self.padded_steps if padded else self.steps
        return torch.tensor([[1] * n + [0] * (steps - n) for n in self.lengths])

    def pair(self, scale: float = 1.0, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The same real values as (clean, padded-with-garbage) tensors."""
        x = shift + scale * torch.randn(len(self.lengths), self.padded_steps, generator=self.gen)
        clean = torch.where(self.mask(True).bool(), x, 0.0)[:, : self.steps]
        return clean, torch.where(self.mask(True).bool(), x, self.garbage)


@st.composite
def batches(draw) -> Batch:
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    if sum(lengths) < 2:  # the unbiased variance needs two real tokens
        lengths = [*lengths, 2]
    extra = draw(st.integers(1, 3))
    garbage = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -7.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return Batch(lengths, max(lengths), max(lengths) + extra, garbage, gen)


def _real(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    return x[:, : batch.steps][batch.mask(False).bool()]


def _assert_same_on_real(clean: torch.Tensor, padded: torch.Tensor, batch: Batch, zero_padding: bool = True):
    torch.testing.assert_close(_real(padded, batch), _real(clean, batch), **CLOSE)
    if zero_padding:
        assert (padded[~batch.mask(True).bool()] == 0).all()


SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(batch=batches())
def test_stats_ignore_padding(batch):
    (x, x_pad), (y, y_pad) = batch.pair(3.0, 1.0), batch.pair()
    mask, mask_pad = batch.mask(False), batch.mask(True)
    torch.testing.assert_close(masked_mean(x_pad, mask_pad), masked_mean(x, mask), **CLOSE)
    torch.testing.assert_close(masked_mean(x_pad, mask_pad, dim=1), masked_mean(x, mask, dim=1), **CLOSE)
    torch.testing.assert_close(
        masked_mean(x_pad, mask_pad, dim=0)[: batch.steps], masked_mean(x, mask, dim=0), **CLOSE
    )
    for unbiased in (True, False):
        torch.testing.assert_close(
            masked_var(x_pad, mask_pad, unbiased), masked_var(x, mask, unbiased), **CLOSE
        )
    for shift_mean in (True, False):
        _assert_same_on_real(
            masked_whiten(x, mask, shift_mean), masked_whiten(x_pad, mask_pad, shift_mean), batch
        )
    torch.testing.assert_close(
        explained_variance(y_pad, x_pad, mask_pad), explained_variance(y, x, mask), equal_nan=True, **CLOSE
    )


@SETTINGS
@given(batch=batches(), estimator=st.sampled_from(KL_ESTIMATORS), kl_coef=st.floats(0, 1))
def test_kl_and_rewards_ignore_padding(batch, estimator, kl_coef):
    (lp, lp_pad), (ref, ref_pad) = batch.pair(1.0, -2.0), batch.pair(1.0, -2.0)
    scores = torch.randn(len(batch.lengths), generator=batch.gen)
    mask, mask_pad = batch.mask(False), batch.mask(True)
    _assert_same_on_real(kl_penalty(lp, ref, estimator), kl_penalty(lp_pad, ref_pad, estimator), batch, False)
    rewards, kl = kl_shaped_rewards(scores, lp, ref, mask, kl_coef, estimator)
    rewards_pad, kl_pad = kl_shaped_rewards(scores, lp_pad, ref_pad, mask_pad, kl_coef, estimator)
    _assert_same_on_real(rewards, rewards_pad, batch)
    _assert_same_on_real(kl, kl_pad, batch)


@SETTINGS
@given(batch=batches(), gamma=st.floats(0, 1), gae_lambda=st.floats(0, 1))
def test_gae_ignores_padding(batch, gamma, gae_lambda):
    (rewards, rewards_pad), (values, values_pad) = batch.pair(), batch.pair()
    mask, mask_pad = batch.mask(False), batch.mask(True)
    adv, ret = compute_gae(rewards, values, mask, gamma, gae_lambda)
    adv_pad, ret_pad = compute_gae(rewards_pad, values_pad, mask_pad, gamma, gae_lambda)
    _assert_same_on_real(adv, adv_pad, batch)
    _assert_same_on_real(ret, ret_pad, batch)


def _loss_and_grad(loss_fn, differentiable: torch.Tensor, *others: torch.Tensor, **kwargs):
    leaf = differentiable.clone().requires_grad_()
    loss, stats = loss_fn(leaf, *others, **kwargs)
    loss.backward()
    return loss.detach(), stats, leaf.grad


def _assert_loss_ignores_padding(batch: Batch, loss_fn, clean_args, padded_args, **kwargs):
    loss, stats, grad = _loss_and_grad(loss_fn, *clean_args, batch.mask(False), **kwargs)
    loss_pad, stats_pad, grad_pad = _loss_and_grad(loss_fn, *padded_args, batch.mask(True), **kwargs)
    torch.testing.assert_close(loss_pad, loss, **CLOSE)
    assert stats_pad.keys() == stats.keys()
    for key in stats:
        torch.testing.assert_close(stats_pad[key], stats[key], **CLOSE, msg=key)
    # exactly zero (not nan) at every padded position, same gradient on real tokens
    _assert_same_on_real(grad, grad_pad, batch)


@SETTINGS
@given(batch=batches(), clip_coef=st.floats(0.05, 0.5), beta=st.floats(0, 2))
def test_policy_losses_ignore_padding(batch, clip_coef, beta):
    # logprobs within +-0.5 of old: ratios in [0.6, 1.6], both sides of the clip range
    (old, old_pad), (delta, delta_pad), (adv, adv_pad) = batch.pair(1.0, -2.0), batch.pair(0.25), batch.pair()
    lp, lp_pad = old + delta.clamp(-0.5, 0.5), old_pad + delta_pad.clamp(-0.5, 0.5)
    clean, padded = (lp, old, adv), (lp_pad, old_pad, adv_pad)
    _assert_loss_ignores_padding(batch, ppo_policy_loss, clean, padded, clip_coef=clip_coef)
    _assert_loss_ignores_padding(batch, kl_penalty_policy_loss, clean, padded, beta=beta)


@SETTINGS
@given(batch=batches(), clip_coef_value=st.floats(0.05, 1.0))
def test_value_loss_ignores_padding(batch, clip_coef_value):
    (old, old_pad), (delta, delta_pad), (ret, ret_pad) = batch.pair(), batch.pair(0.5), batch.pair()
    clean, padded = (old + delta, old, ret), (old_pad + delta_pad, old_pad, ret_pad)
    _assert_loss_ignores_padding(batch, clipped_value_loss, clean, padded, clip_coef_value=clip_coef_value)
