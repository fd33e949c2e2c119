"""Dropped scores (``scoring.on_nonfinite: drop``) do not bias the group baselines: the estimators see which
rows are kept and compute their baselines over those rows only, as if the others had not been sampled."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import tiny_critic_free

from lit_rlhf import functional as F

NAN = float("nan")


def test_rloo_leaves_one_out_over_the_kept_rows_only():
    # K = 3, the middle row dropped: the leave-one-out baseline of row 0 is row 2 alone (not the filled mean)
    scores = torch.tensor([0.0, NAN, 2.0])
    keep = torch.tensor([True, False, True])
    assert F.rloo_advantages(scores, 3, keep=keep).tolist() == [-2.0, 0.0, 2.0]
    filled = F.fill_dropped_scores(scores, keep, 3)  # [0, 1, 2]: the earlier treatment shrank them
    assert F.rloo_advantages(filled, 3).tolist() == [-1.5, 0.0, 1.5]


def test_grpo_takes_the_mean_and_std_of_the_kept_rows():
    scores = torch.tensor([0.0, NAN, 2.0, 5.0, 5.0, 5.0])
    keep = torch.tensor([True, False, True, True, True, True])
    adv = F.grpo_advantages(scores, 3, keep=keep)
    s = 1 / math.sqrt(2)  # (0 - 1) / std([0, 2]) with the unbiased std sqrt(2)
    assert adv[:3].tolist() == pytest.approx([-s, 0.0, s], abs=1e-6)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0], "equal kept scores: no signal"
    dr = F.grpo_advantages(scores, 3, scale_by_std=False, keep=keep)
    assert dr[:3].tolist() == [-1.0, 0.0, 1.0]


def test_a_group_with_one_kept_row_has_no_baseline():
    scores, keep = torch.tensor([3.0, NAN, NAN, 1.0]), torch.tensor([True, False, False, True])
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        adv = F.sequence_advantages(scores, estimator, 2, keep)
        assert adv.tolist() == [0.0, 0.0, 0.0, 0.0], estimator
    assert F.sequence_advantages(scores, "reinforce_pp", 2, keep).tolist() == [3.0, 0.0, 0.0, 1.0]


def test_all_kept_is_the_unmasked_estimator_exactly():
    torch.manual_seed(0)
    scores = torch.randn(12)
    keep = torch.ones(12, dtype=torch.bool)
    for scale in (True, False):
        plain, masked = F.grpo_advantages(scores, 4, scale), F.grpo_advantages(scores, 4, scale, keep=keep)
        assert torch.allclose(plain, masked, atol=1e-6)
    assert torch.allclose(F.rloo_advantages(scores, 4), F.rloo_advantages(scores, 4, keep=keep), atol=1e-6)


def test_the_module_passes_the_kept_rows_to_the_estimator(tokenizer_dir):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), advantage={"estimator": "rloo"}, kl={"coef": 0.0},
                              generation={"num_samples": 3}, scoring={"on_nonfinite": "drop"})  # fmt: skip
    mask = torch.ones(3, 4, dtype=torch.bool)
    logprobs = torch.zeros(3, 4)
    keep = torch.tensor([True, False, True])
    scores = F.fill_dropped_scores(torch.tensor([0.0, NAN, 2.0]), keep, 3)
    adv = module.estimate_advantages(scores, logprobs, logprobs, mask, keep)
    assert adv[:, 0].tolist() == [-2.0, 0.0, 2.0] and (adv == adv[:, :1]).all()


def test_a_resume_that_changes_k_is_refused_in_python_too(tokenizer_dir, tmp_path):
    from ppo_helpers import prompt_loader, trainer

    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1)
    fit = trainer(tmp_path)
    fit.fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    fit.save_checkpoint(tmp_path / "k4.ckpt")
    other = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=2, generation={"num_samples": 2})
    with pytest.raises(ValueError, match=r"generation.num_samples \(K\) cannot change on resume: the checkpoint has 4"):
        trainer(tmp_path / "b").fit(other, prompt_loader(tokenizer_dir, n=4, batch_size=4), ckpt_path=tmp_path / "k4.ckpt")
