"""PPOModule options: argument checks, score adjustments, the ratio-threshold skip, reward sources."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_ppo, trainer

from lit_rlhf.models import ModelSpec, build_score_model, load_tokenizer, sequence_scores
from lit_rlhf.rewards import RewardSource, import_reward_fn


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"reward_fn": None}, "exactly one of reward_model"),
        ({"update": {"epochs": 0}}, "PPOModule: update.epochs must be > 0"),
        ({"advantage": {"gamma": 1.5}}, r"PPOModule: advantage.gamma must be in \[0, 1\]"),
        ({"kl": {"coef": -0.1}}, "PPOModule: kl.coef must be >= 0"),
        (
            {"share_critic_backbone": True, "critic": ModelSpec(config=gpt2_config(), tokenizer="x")},
            "share_critic_backbone",
        ),
        ({"max_rollouts": 0}, "max_rollouts must be >= 1"),
        ({"update": {"clip_coef": float("nan")}}, "PPOModule: update.clip_coef must be a finite number, got nan"),
        ({"update": {"vf_coef": float("inf")}}, "PPOModule: update.vf_coef must be a finite number"),
        ({"update": {"clip_coef_value": 0.0}}, "PPOModule: update.clip_coef_value must be > 0"),
        (
            {"scoring": {"on_nonfinite": "ignore"}},
            r"PPOModule: scoring.on_nonfinite must be one of \['raise', 'drop'\], got 'ignore'",
        ),
    ],
)
def test_invalid_arguments_fail_early_with_a_named_argument(tokenizer_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_ppo(tokenizer_dir, gpt2_config(), **overrides)


def test_reward_fn_path_errors_name_the_path():
    with pytest.raises(ValueError, match="package.module:function"):
        import_reward_fn("no_colon_here")
    with pytest.raises(ValueError, match="has no attribute 'does_not_exist'"):
        import_reward_fn("ppo_rewards:does_not_exist")


@pytest.mark.parametrize(
    "overrides",
    [{"update": {"clip_coef": float("nan")}}, {"kl": {"coef": float("inf")}}, {"scoring": {"on_nonfinite": "skip"}}],
)
def test_critic_free_refuses_nonfinite_floats_and_unknown_policies(tokenizer_dir, overrides):
    from ppo_helpers import tiny_critic_free

    ((group, values),) = overrides.items()
    name = f"{group}.{next(iter(values))}"
    with pytest.raises(ValueError, match=f"CriticFreeModule: {name} must"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), **overrides)


@pytest.mark.parametrize(
    ("fn", "message"),
    [("as_strings", "returned a str at position 0"), ("with_none", "returned a NoneType at position 1")],
)
def test_reward_source_names_the_function_and_the_bad_value(tokenizer_dir, fn, message):
    tok = load_tokenizer(tokenizer_dir, padding_side="left")
    source = RewardSource(None, f"ppo_rewards:{fn}", tok, "monitor_reward_fn")
    ids = torch.tensor(tok(["ab", "cd"])["input_ids"])
    with pytest.raises(TypeError, match=f"monitor_reward_fn ppo_rewards:{fn} {message}"):
        source.score(ids, torch.ones_like(ids), 1, 4)


def test_missing_eos_penalty_then_score_clip(tokenizer_dir):
    module = tiny_ppo(tokenizer_dir, gpt2_config(), scoring={"missing_eos_penalty": 1.0, "score_clip": 2.0})
    scores = torch.tensor([3.0, 0.5, -1.5, 0.5])
    truncated = torch.tensor([False, True, True, False])
    # [3, 0.5-1, -1.5-1, 0.5] = [3, -0.5, -2.5, 0.5] -> clipped to [-2, 2]: [2, -0.5, -2, 0.5]
    assert module.adjust_scores(scores, truncated).tolist() == [2.0, -0.5, -2.0, 0.5]


def test_ratio_threshold_skips_every_minibatch_without_changing_weights(tokenizer_dir, tmp_path):
    # A threshold below 1 rejects even the first minibatch (ratio = 1): no optimiser step happens.
    module = tiny_ppo(tokenizer_dir, gpt2_config(), update={"ratio_threshold": 0.5}, max_rollouts=1)
    before = [p.detach().clone() for p in module.actor.parameters()]
    t = trainer(tmp_path)
    t.fit(module, prompt_loader(tokenizer_dir))
    assert all(torch.equal(a, b) for a, b in zip(before, module.actor.parameters()))
    assert t.logged_metrics["ppo/skipped_minibatches"] == 1.0


def test_reward_model_with_another_vocabulary_scores_retokenised_text(
    tokenizer_dir, chat_tokenizer_dir, tmp_path
):
    # The RM's tokenizer differs from the actor's (it has chat special tokens): the decoded text is
    # re-tokenised, so its scores equal scoring that text directly.
    actor_tok = load_tokenizer(tokenizer_dir)
    rm_tok = load_tokenizer(chat_tokenizer_dir)
    rm = build_score_model(
        ModelSpec(config=gpt2_config(len(rm_tok)), tokenizer=chat_tokenizer_dir, seed=0), rm_tok
    )
    rm.save_pretrained(tmp_path / "rm")
    rm_tok.save_pretrained(tmp_path / "rm")
    source = RewardSource(ModelSpec(name_or_path=str(tmp_path / "rm")), None, actor_tok)
    assert source.model_tokenizer is not None
    prompt, response = "the food was", " very good"
    ids = actor_tok(prompt)["input_ids"] + actor_tok(response)["input_ids"] + [actor_tok.eos_token_id]
    T = len(ids) - len(actor_tok(prompt)["input_ids"])
    input_ids = torch.tensor([ids])
    got = source.score(input_ids, torch.ones_like(input_ids), T, chunk_size=4)
    enc = rm_tok([prompt + response + rm_tok.eos_token], return_tensors="pt")
    with torch.no_grad():
        want = sequence_scores(rm.eval(), enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(got, want)
    # a response cut at max_new_tokens (no EOS) is scored as unfinished text: no EOS added for the reward model
    cut = torch.tensor([actor_tok(prompt)["input_ids"] + actor_tok(response)["input_ids"]])
    got = source.score(cut, torch.ones_like(cut), T - 1, chunk_size=4)
    enc = rm_tok([prompt + response], return_tensors="pt")
    with torch.no_grad():
        want = sequence_scores(rm.eval(), enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(got, want)


def test_a_shared_critic_reads_the_lm_heads_input_width(tokenizer_dir, tmp_path):
    # OPT-350m projects hidden_size 1024 down to word_embed_proj_dim 512 before its LM head: the value head
    # reads those 512 features (it was sized by hidden_size: a matmul shape error in the first rollout)
    opt = dict(model_type="opt", vocab_size=322, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, word_embed_proj_dim=16)  # fmt: skip
    module = tiny_ppo(tokenizer_dir, opt, share_critic_backbone=True, max_rollouts=1)
    assert module.value_head.linear.in_features == 16
    t = trainer(tmp_path)
    t.fit(module, prompt_loader(tokenizer_dir, n=8))
    assert torch.isfinite(t.logged_metrics["ppo/value_loss"])


def _seq_mean_gradients(make, tokenizer_dir, aggregation: str, forward_batch_size: int) -> list[torch.Tensor]:
    """The accumulated gradients of one 8-row minibatch (responses of 1 to 6 tokens) in micro-batches of
    ``forward_batch_size`` rows, with an entropy bonus (and PPO's value loss)."""
    from lit_rlhf.rollout import Rollout

    update = {"epochs": 1, "num_minibatches": 1, "loss_aggregation": aggregation, "ent_coef": 0.5}
    module = make(tokenizer_dir, gpt2_config(), update=update,
                  scoring={"forward_batch_size": forward_batch_size, "bucketing": {"enabled": False}})  # fmt: skip
    module.manual_backward = lambda loss: loss.backward()
    g = torch.Generator().manual_seed(1)
    B, P, T, critic = 8, 4, 6, hasattr(module, "ppo_loss")
    ids = torch.randint(5, 300, (B, P + T), generator=g)
    response_mask = torch.arange(T)[None] < torch.tensor([1, 6, 2, 6, 1, 5, 6, 3])[:, None]
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask.long()], dim=1)
    noise = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    rollout = Rollout(ids, attention, response_mask, -2 + 0.3 * noise(), -2 + 0.3 * noise(),
                      noise() if critic else None, None, noise(), noise() if critic else None, torch.randn(B, generator=g))  # fmt: skip
    module.accumulate_minibatch(module.ppo_loss if critic else module.policy_loss, rollout)
    models = [module.actor, module.critic] if critic else [module.actor]
    return [torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]) for m in models]


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_sequence_mean_losses_accumulate_independently_of_the_micro_batches(tokenizer_dir, aggregation, algorithm):
    """The value loss and the entropy bonus are token means: weighted by the micro-batch's tokens, not its
    rows (before, the gradient moved by 2-7% between 2-row and 8-row micro-batches)."""
    from ppo_helpers import tiny_critic_free

    make = tiny_ppo if algorithm == "ppo" else tiny_critic_free
    whole, parts = (_seq_mean_gradients(make, tokenizer_dir, aggregation, n) for n in (8, 2))
    for a, b in zip(parts, whole):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_ppo_penalty_beta_reads_the_kl_of_the_updated_policy(tokenizer_dir, tmp_path):
    """PPO-Penalty's d is measured after the epochs (arXiv:1707.06347 sec. 4). Before, the last minibatch's
    KL from before its step was used: 0 with one step per rollout, so beta halved every rollout."""
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=3, kl={"coef": 0.0},
                      update={"epochs": 1, "num_minibatches": 1, "policy_loss": "kl_penalty", "init_beta": 1.0,
                              "beta_target": 1e-4},
                      actor_optimizer=lambda p: torch.optim.AdamW(p, lr=0.05))  # fmt: skip
    fed, update = [], module.beta_ctl.update
    module.beta_ctl.update = lambda kl, n_steps: (fed.append(kl), update(kl, n_steps))
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert len(fed) == 3 and all(d > 1.5e-4 for d in fed), fed  # a real step moves the policy
    assert module.beta_ctl.value == 8.0  # doubled after each rollout


def test_logged_coefficients_are_the_ones_the_rollout_used(tokenizer_dir, tmp_path):
    """rollout/reward = score - kl_coef * kl_ref with the logged kl_coef of the same row (before, the
    coefficient after the controller's update was logged)."""
    from ppo_helpers import tiny_critic_free
    from test_online_contract import read_metrics

    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=3, kl={"coef": 0.5, "target": 0.01, "horizon": 8})
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    rows = read_metrics(tmp_path)
    assert rows[0]["policy/kl_coef"] == pytest.approx(0.5)
    for row in rows:
        assert row["rollout/reward"] == pytest.approx(row["rollout/score"] - row["policy/kl_coef"] * row["rollout/kl_ref"], abs=1e-4)


def test_logged_reward_is_score_minus_kl_penalty_with_whitened_rewards(tokenizer_dir, tmp_path):
    """With advantage.whiten_rewards the per-token rewards are whitened for GAE, but the logged sequence rewards
    stay the README's score - kl_coef * KL of each row (TRL's objective/rlhf_reward); before, they were the
    whitened row sums (whose mean over rows of equal length happens to match; the rows do not)."""
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=2, kl={"coef": 0.5}, advantage={"whiten_rewards": True})
    logged, log = [], module.log_rollout_stats
    module.log_rollout_stats = lambda sample, scores, rewards, kl, *a, **k: (
        logged.append((scores.clone(), rewards.clone(), kl.clone())), log(sample, scores, rewards, kl, *a, **k))
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert len(logged) == 2
    for scores, rewards, kl in logged:
        assert float(rewards.std()) > 0
        torch.testing.assert_close(rewards, scores - 0.5 * kl.sum(-1), atol=1e-4, rtol=1e-4)
