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
