"""OnlineDPOModule: argument checks, its loss equals functional DPO of the ranked pairs (ties give nothing), a
tiny fit raises a rule reward, exact resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import adamw, merge_groups, prompt_loader, trainer
from test_ppo import assert_resumed_rows_equal, read_metrics, uninterrupted_and_resumed

from lit_rlhf import functional as F
from lit_rlhf.models import policy_forward
from lit_rlhf.modules import OnlineDPOModule
from lit_rlhf.rollout import Rollout


def tiny_online_dpo(tokenizer_dir: str, **overrides) -> OnlineDPOModule:
    """Online DPO with K = 4 samples per prompt on the 'the' count."""
    kwargs = dict(
        actor={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0},
        reward_fn="ppo_rewards:the_count",
        generation={"max_new_tokens": 8, "num_samples": 4, "sampler": "multinomial"},
        scoring={"forward_batch_size": 8},
        samples={"every": 0},
        actor_optimizer=adamw(1e-2),
        rng_seed=0,
    )
    return OnlineDPOModule(**merge_groups(kwargs, overrides))


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"generation": {"num_samples": 1}}, ValueError, "generation.num_samples must be >= 2"),
        (
            {"scoring": {"forward_batch_size": 6}},
            ValueError,
            r"scoring.forward_batch_size \(6\) must be a multiple of generation.num_samples \(4\)",
        ),
        ({"kl": {"coef": -0.05}}, ValueError, "kl.coef must be >= 0"),
        ({"kl": {"loss_coef": 0.1}}, ValueError, "kl.loss_coef must be 0"),
        ({"preference": {"beta": 0.0}}, ValueError, "preference.beta must be > 0"),
        ({"preference": {"loss_type": "simpo"}}, ValueError, "preference.loss_type must be one of"),
        (
            {"preference": {"loss_type": "ipo", "label_smoothing": 0.1}},
            ValueError,
            "label_smoothing must be 0 with",
        ),
        (
            {"update": {"clip_coef_high": 0.3}},
            ValueError,
            "update.clip_coef_high must be None .it does not apply",
        ),
        (
            {"update": {"loss_aggregation": "seq_mean_token_mean"}},
            ValueError,
            "update.loss_aggregation must be 'token_mean'",
        ),
        (
            {"update": {"is_correction": {"mode": "token_truncate"}}},
            ValueError,
            "must be 'auto' or 'none' for online DPO",
        ),
        ({"reward_fn": None}, ValueError, "exactly one of reward_model"),
        ({"preference": {"nll_coef": -1.0}}, ValueError, "preference.nll_coef must be >= 0"),
        ({"kl": {"target": 0.0}}, ValueError, "kl.target must be > 0 or None"),
        ({"kl": {"target": 2.0, "horizon": 0}}, ValueError, "kl.horizon must be >= 1"),
    ],
)
def test_invalid_arguments_fail_at_construction(tokenizer_dir, overrides, error, message):
    with pytest.raises(error, match=message) as err:
        tiny_online_dpo(tokenizer_dir, **overrides)
    assert str(err.value).startswith("OnlineDPOModule: ")  # the module names itself


def test_defaults_two_samples_one_step_no_kl_in_the_reward(tokenizer_dir):
    module = OnlineDPOModule(
        actor={"config": gpt2_config(), "tokenizer": tokenizer_dir}, reward_fn="ppo_rewards:the_count"
    )
    assert module.num_samples == 2 and module.kl.coef == 0.0
    assert (module.update.epochs, module.update.num_minibatches, module.update.is_correction.mode) == (
        1,
        1,
        "none",
    )
    kept = tiny_online_dpo(tokenizer_dir, kl={"estimator": "k3"})  # a kl dict without coef: coef 0, not 0.05
    assert (kept.kl.coef, kept.kl.estimator) == (0.0, "k3")
    assert module.hparams.kl["coef"] == 0.0


def test_kl_target_adapts_beta_from_preference_beta(tokenizer_dir):
    fixed = tiny_online_dpo(tokenizer_dir, preference={"beta": 0.3})
    assert isinstance(fixed.kl_ctl, F.FixedKLController) and fixed.kl_ctl.value == 0.3
    adaptive = tiny_online_dpo(tokenizer_dir, preference={"beta": 0.3}, kl={"target": 2.0, "horizon": 64})
    ctl = adaptive.kl_ctl
    assert isinstance(ctl, F.AdaptiveKLController) and (ctl.value, ctl.target, ctl.horizon, ctl.floor) == (
        0.3, 2.0, 64, 0.3
    )  # one-sided: never below preference.beta
    assert adaptive.kl.coef == 0.0  # no penalty in the reward: the target steers beta


def test_kl_coef_ranks_the_samples_by_the_kl_regularised_score(tokenizer_dir, tmp_path, monkeypatch):
    # a reference unlike the actor (another seed): every response has a KL from the first rollout on
    calls = []
    real_rank, real_pairs = F.kl_regularized_scores, F.best_worst_pairs

    def rank(scores, sequence_kl, coef):
        calls.append({"scores": scores, "kl": sequence_kl, "coef": coef})
        return real_rank(scores, sequence_kl, coef)

    def pairs(ranking, group_size, keep=None):
        calls[-1]["ranking"] = ranking
        return real_pairs(ranking, group_size, keep)

    monkeypatch.setattr(F, "kl_regularized_scores", rank)
    monkeypatch.setattr(F, "best_worst_pairs", pairs)
    torch.manual_seed(0)
    module = tiny_online_dpo(tokenizer_dir, max_rollouts=3, kl={"coef": 0.5}, reward_fn="ppo_rewards:e_rate",
                             reference={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 1})  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=12, batch_size=4))
    rows = read_metrics(tmp_path)
    assert len(calls) == len(rows) == 3
    for call, row in zip(calls, rows, strict=True):
        assert call["coef"] == 0.5
        torch.testing.assert_close(call["ranking"], call["scores"] - 0.5 * call["kl"])  # what was ranked
        # the KL of the ranking is the rollout's logged KL to the reference (per response, k1)
        assert call["kl"].mean().item() == pytest.approx(row["rollout/kl_ref"], rel=1e-4)
        assert call["scores"].mean().item() == pytest.approx(row["rollout/score"], rel=1e-4)
        assert (call["kl"] != 0).all() and call["kl"].abs().max() > 0.1  # the models differ: the term is not idle


def constructed_rollout(
    module: OnlineDPOModule, scores: list[float]
) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """A rollout of len(scores) rows (K = 3 per prompt) of random tokens: prompts of 3 tokens, responses of
    up to 5 (right-padded), with the module's old and reference log-probs; returns it and the policy's and
    reference's (B, T) token log-probs."""
    g = torch.Generator().manual_seed(0)
    B, P, T = len(scores), 3, 5
    ids = torch.randint(5, 300, (B, P + T), generator=g)
    lengths = torch.tensor([5, 3, 4, 2, 5, 1][:B])
    response_mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask.long()], dim=1)
    with torch.no_grad():
        logprobs, _, _ = policy_forward(module.actor, ids, attention, T, 1.0)
        ref_logprobs, _, _ = policy_forward(module.reference, ids, attention, T, 1.0)
    rollout = Rollout(ids, attention, response_mask, logprobs, ref_logprobs, None, None, torch.zeros(B, T), None,
                      torch.tensor(scores), rows=torch.arange(B))  # fmt: skip
    return rollout, logprobs, ref_logprobs


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_loss_is_functional_dpo_of_each_prompts_best_and_worst(tokenizer_dir, loss_type):
    # prompt 0 (rows 0-2) ranks row 1 (3.0) over row 0 (1.0); prompt 1 (rows 3-5) is a tie: no pair
    module = tiny_online_dpo(tokenizer_dir, generation={"max_new_tokens": 5, "num_samples": 3}, scoring={"forward_batch_size": 6},
                             reference={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 1},
                             preference={"beta": 0.5, "loss_type": loss_type})  # fmt: skip
    scores = [1.0, 3.0, 2.0, 4.0, 4.0, 4.0]
    rollout, logprobs, ref = constructed_rollout(module, scores)
    chosen, rejected, paired = F.best_worst_pairs(rollout.scores, 3)
    assert paired.tolist() == [True, False]
    module.pair_roles = torch.tensor([-1, 1, 0, 0, 0, 0])  # as log_pairs sets it from these pairs
    loss, stats = module.preference_loss(rollout)
    # by hand: h = (log pi - log pi_ref)(row 1) - (log pi - log pi_ref)(row 0), summed (DPO) or averaged (IPO)
    mask = rollout.loss_mask
    seq = lambda lp, row: lp[row][mask[row]].sum() / (mask[row].sum() if loss_type == "ipo" else 1)  # noqa: E731
    h = (seq(logprobs, 1) - seq(ref, 1)) - (seq(logprobs, 0) - seq(ref, 0))
    expected = -torch.nn.functional.logsigmoid(0.5 * h) if loss_type == "sigmoid" else (h - 1.0) ** 2
    torch.testing.assert_close(loss, expected)
    functional, functional_stats = F.dpo_loss(
        seq(logprobs, 1)[None], seq(logprobs, 0)[None], seq(ref, 1)[None], seq(ref, 0)[None], 0.5, loss_type
    )
    torch.testing.assert_close(loss, functional)
    for name, value in functional_stats.items():
        torch.testing.assert_close(stats[name], value)
    # the loss takes the controller's current beta (adapted with kl.target), not the configured one
    module.kl_ctl.value = 0.25
    adapted, _ = module.preference_loss(rollout)
    expected = -torch.nn.functional.logsigmoid(0.25 * h) if loss_type == "sigmoid" else (h - 2.0) ** 2
    torch.testing.assert_close(adapted, expected)
    module.kl_ctl.value = 0.5
    assert stats["scores_margin"] == 2.0 and stats["ratio_mean"] == pytest.approx(1.0)
    # the tied prompt gives no gradient: its responses' tokens do not change the loss
    other = rollout.input_ids.clone()
    other[3:, 3:] = torch.randint(5, 300, (3, 5), generator=torch.Generator().manual_seed(1))
    again, _ = module.preference_loss(dataclasses.replace(rollout, input_ids=other))
    torch.testing.assert_close(again, loss)


def test_nll_coef_adds_the_chosen_responses_per_token_nll(tokenizer_dir):
    # the pair of prompt 0: row 1 chosen over row 0; the loss gains alpha * -(log pi of row 1) / its tokens
    overrides = dict(generation={"max_new_tokens": 5, "num_samples": 3}, scoring={"forward_batch_size": 6})
    plain = tiny_online_dpo(tokenizer_dir, **overrides, preference={"beta": 0.5})
    rpo = tiny_online_dpo(tokenizer_dir, **overrides, preference={"beta": 0.5, "nll_coef": 0.7})
    rollout, logprobs, _ = constructed_rollout(plain, [1.0, 3.0, 2.0, 4.0, 4.0, 4.0])
    for module in (plain, rpo):
        module.pair_roles = torch.tensor([-1, 1, 0, 0, 0, 0])
    base, base_stats = plain.preference_loss(rollout)
    loss, stats = rpo.preference_loss(rollout)
    mask = rollout.loss_mask
    nll = -logprobs[1][mask[1]].sum() / mask[1].sum()
    torch.testing.assert_close(stats["nll_loss"], nll)
    torch.testing.assert_close(base_stats["nll_loss"], nll)  # logged with nll_coef 0 too
    torch.testing.assert_close(loss, base + 0.7 * nll)


def test_a_micro_batch_without_pairs_has_zero_loss_and_gradient(tokenizer_dir):
    module = tiny_online_dpo(
        tokenizer_dir, generation={"max_new_tokens": 5, "num_samples": 3}, scoring={"forward_batch_size": 6}
    )
    rollout, _, _ = constructed_rollout(module, [4.0] * 6)
    module.pair_roles = torch.zeros(6, dtype=torch.long)
    loss, stats = module.preference_loss(rollout)
    loss.backward()
    assert loss == 0.0 and stats["loss"] == 0.0 and stats["rewards/accuracies"] == 0.0
    grads = [p.grad for p in module.actor.parameters() if p.grad is not None]
    assert grads and all(bool((g == 0).all()) for g in grads)
    # the micro-batch weight: its share of the minibatch's pairs (token share when the minibatch has none)
    module.pair_roles = torch.tensor([1, -1, 0, 0, 0, 0])
    assert module.micro_batch_weight(rollout.select(slice(0, 3)), rollout) == 1.0
    assert module.micro_batch_weight(rollout.select(slice(3, 6)), rollout) == 0.0


def test_the_micro_batch_weights_are_float32_under_a_bfloat16_default_dtype(tokenizer_dir):
    # Lightning's bf16-true makes bfloat16 the default dtype inside training_step: 1/3 in bfloat16 is 0.333984
    module = tiny_online_dpo(
        tokenizer_dir, generation={"max_new_tokens": 5, "num_samples": 2}, scoring={"forward_batch_size": 6}
    )
    rollout, _, _ = constructed_rollout(module, [1.0, 0.0] * 3)
    module.pair_roles = torch.tensor([1, -1] * 3)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        weights = [module.micro_batch_weight(rollout.select(slice(i, i + 2)), rollout) for i in (0, 2, 4)]
    finally:
        torch.set_default_dtype(default)
    assert all(w.dtype == torch.float32 and w == torch.tensor(1 / 3) for w in weights)


def test_online_dpo_raises_the_rule_reward(tokenizer_dir, tmp_path):
    # 4 prompts x K = 4 responses per rollout; the random policy writes 'the' rarely, so most prompts start
    # as ties (no pair) and the pairs grow as the count rises (seeds 0-4 measured with 2 epochs: the last five
    # rollouts' mean score 8.0, 8.0, 0.8, 2.0, 4.3 from at most 0.06; 1.8, 3.8, 0.4, 0.1, 1.3 with one epoch)
    torch.manual_seed(0)
    module = tiny_online_dpo(tokenizer_dir, max_rollouts=20, update={"epochs": 2})
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    rows = read_metrics(tmp_path)
    assert len(rows) == 20
    first = sum(r["rollout/score"] for r in rows[:5]) / 5
    last = sum(r["rollout/score"] for r in rows[-5:]) / 5
    assert first < 0.5 and last > first + 1.5, (first, last)
    assert rows[0]["rollout/kl_ref"] == pytest.approx(0.0, abs=1e-5)
    assert all(r["dpo/pairs"] + r["dpo/ties"] == 4 for r in rows) and rows[0]["dpo/ties"] > 0
    paired = [r for r in rows if r["dpo/pairs"] > 0]
    assert sum(r["dpo/rewards/margins"] for r in paired[-5:]) > 0  # the implicit reward learns the ranking
    expected = {"dpo/loss", "dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/accuracies", "dpo/logps/chosen",
                "dpo/logps/rejected", "dpo/scores_margin", "dpo/beta", "dpo/lr_actor", "dpo/policy_kl", "rollout/entropy"}  # fmt: skip
    assert expected <= set(rows[-1])
    for row in rows:  # score - beta * KL (TRL's objective/rlhf_reward)
        assert row["dpo/beta"] == pytest.approx(0.1)
        assert row["rollout/reward"] == pytest.approx(
            row["rollout/score"] - 0.1 * row["rollout/kl_ref"], abs=1e-4
        )


def test_kl_target_steers_beta_by_the_rollouts_kl(tokenizer_dir, tmp_path):
    # Ziegler et al.'s controller on beta, by hand from the logged KL: beta' = max(beta (1 + clip(KL / target - 1,
    # +-0.2) B / horizon), 0.2), B = 16 rows; the first rollout (KL 0) would lower beta by 10%: held at 0.2
    torch.manual_seed(0)
    module = tiny_online_dpo(tokenizer_dir, max_rollouts=8, update={"epochs": 2}, preference={"beta": 0.2},
                             kl={"target": 0.5, "horizon": 32})  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=32, batch_size=4))
    rows = read_metrics(tmp_path)
    assert rows[0]["dpo/beta"] == pytest.approx(0.2) and rows[1]["dpo/beta"] == pytest.approx(0.2)
    beta = 0.2
    for row in rows:
        assert row["dpo/beta"] == pytest.approx(beta, rel=1e-5)
        assert row["rollout/reward"] == pytest.approx(row["rollout/score"] - beta * row["rollout/kl_ref"], abs=1e-4)
        beta = max(beta * (1 + min(max(row["rollout/kl_ref"] / 0.5 - 1, -0.2), 0.2) * 16 / 32), 0.2)
    assert module.kl_ctl.value == pytest.approx(beta, rel=1e-5)
    assert any(r["rollout/kl_ref"] > 0.5 for r in rows) and rows[-1]["dpo/beta"] > 0.2


def test_resume_reproduces_the_uninterrupted_run(tokenizer_dir, tmp_path, prompt_file):
    from lit_rlhf.data import PromptDataModule

    def run(root, callbacks=(), ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_online_dpo(tokenizer_dir, max_rollouts=4, update={"epochs": 2, "num_minibatches": 2},
                                 reward_fn="ppo_rewards:e_rate", kl={"target": 0.05, "horizon": 16})  # fmt: skip
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=4, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(
            module, data, ckpt_path=ckpt_path
        )
        return read_metrics(root)

    full, resumed = uninterrupted_and_resumed(run, tmp_path)
    assert len(full) == 4 and len(resumed) == 2
    assert full[-1]["dpo/pairs"] > 0  # e_rate is dense: few ties
    assert len({r["dpo/beta"] for r in full}) == 3  # raised after rollouts 2 and 3 (KL 0 after the first): resumed too
    assert_resumed_rows_equal(full, resumed)


@pytest.mark.parametrize("kl", [{}, {"target": 0.05, "horizon": 16}], ids=["fixed", "adaptive"])
def test_a_run_resumed_with_another_beta_uses_it(tokenizer_dir, tmp_path, prompt_file, kl):
    # a fixed beta is a setting: the resumed run's; an adapted one is state, at least the resumed run's floor
    from test_ppo import StopAfter

    from lit_rlhf.data import PromptDataModule

    def run(root, beta, callbacks=(), ckpt_path=None):
        module = tiny_online_dpo(tokenizer_dir, max_rollouts=3, preference={"beta": beta}, kl=kl,
                                 update={"epochs": 1, "num_minibatches": 1}, reward_fn="ppo_rewards:e_rate")  # fmt: skip
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=4, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(module, data, ckpt_path=ckpt_path)
        return read_metrics(root)

    run(tmp_path / "part", 0.1, callbacks=[StopAfter(2)])
    resumed = run(tmp_path / "resumed", 1.0, ckpt_path=str(tmp_path / "part" / "mid.ckpt"))
    assert [r["dpo/beta"] for r in resumed] == [1.0]


def test_a_minibatch_of_ties_takes_no_step_and_logs_no_dpo_statistics(tokenizer_dir, tmp_path):
    """Every prompt ties (a constant reward): no minibatch has a pair. Before, each still stepped AdamW (its
    momentum and weight decay moved the policy) and logged zeros as the DPO loss and accuracy."""
    module = tiny_online_dpo(tokenizer_dir, reward_fn="ppo_rewards:constant", max_rollouts=2,
                             update={"num_minibatches": 2})  # fmt: skip
    before = [p.detach().clone() for p in module.actor.parameters()]
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert all(torch.equal(p, b) for p, b in zip(module.actor.parameters(), before)), "a tie moved the policy"
    for row in read_metrics(tmp_path):
        assert row["dpo/ties"] == 4 and row["dpo/skipped_minibatches"] == 1.0
        assert "dpo/loss" not in row and "dpo/rewards/accuracies" not in row
        assert "dpo/policy_kl" in row  # the drift statistics are still measured
