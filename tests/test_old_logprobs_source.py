"""Where a rollout's old log-probs come from (``scoring.old_logprobs``, ``modules.online_old_logprobs``).

Under ``auto`` with the Hugging Face engine in float32 the sampler's record stands in for the actor's
scoring forward: checked here against that forward on the very rollouts of a fit (old log-probs and entropy
to 1e-5, the critic's values and the reference log-probs equal), with the actor's forward skipped during the
scoring; the cases where the forward must run (a value head on the actor, bf16-mixed, an engine with its
own policy copy, a corrected rollout, a critic-free on-policy update) keep it, and ``sampler`` refuses them
naming why. Learning and exact resume under the default are checked by the PPO and critic-free suites.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from test_is_correction import PerturbedEngine

from lit_rlhf.modules.online_settings import ScoringSettings


def count_calls(model: torch.nn.Module) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def compare_with_the_forward(module) -> list[dict]:
    """Wrap ``module.score_rollout``: each call with ``responses`` is checked against the same call
    without them (the scoring forward); returns per call the actor forwards it ran and what it returned."""
    records, original, actor_calls = [], module.score_rollout, count_calls(module.actor)

    def score_rollout(ids, attention, T, policy=True, responses=None):
        actor_calls.clear()
        out = original(ids, attention, T, policy=policy, responses=responses)
        record = {"actor_forwards": len(actor_calls), "out": out, "mask": responses.mask}
        record["forward"] = original(ids, attention, T, policy=policy)
        records.append(record)
        return out

    module.score_rollout = score_rollout
    return records


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_auto_takes_the_sampler_record_and_skips_the_actor_forward(tokenizer_dir, tmp_path, kind):
    build = tiny_ppo if kind == "ppo" else tiny_critic_free
    module = build(tokenizer_dir, gpt2_config(), max_rollouts=2, generation={"max_new_tokens": 8, "top_k": 30,
                   "temperature": 0.8, **({"num_samples": 4} if kind == "grpo" else {})})  # fmt: skip
    records = compare_with_the_forward(module)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert len(records) == 2
    for record in records:
        assert record["actor_forwards"] == 0, "the actor's scoring forward was skipped"
        (old, ref, values, entropy), (f_old, f_ref, f_values, f_entropy) = record["out"], record["forward"]
        mask = record["mask"]
        torch.testing.assert_close(old[mask], f_old[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[mask], f_entropy[mask], atol=1e-5, rtol=0)
        assert (old[~mask] == 0).all() and (entropy[~mask] == 0).all()
        assert torch.equal(ref, f_ref)
        assert (values is None) == (kind == "grpo") and (values is None or torch.equal(values, f_values))


@pytest.mark.parametrize(
    "overrides, fit",
    [
        (dict(share_critic_backbone=True), {}),
        (dict(engine=PerturbedEngine(scale=0.0)), {}),
        ({}, dict(precision="bf16-mixed")),
        (dict(scoring={"old_logprobs": "forward"}), {}),
    ],
    ids=["value_head_on_the_actor", "engine_with_its_own_policy", "bf16_mixed", "forward"],
)
def test_the_forward_runs_where_the_sampler_cannot_stand_in(tokenizer_dir, tmp_path, overrides, fit):
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=1, **overrides)
    records = compare_with_the_forward(module)
    trainer(tmp_path, **fit).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    assert records and all(r["actor_forwards"] > 0 for r in records)
    for record in records:  # the same forward both times
        assert torch.equal(record["out"][0], record["forward"][0])


@pytest.mark.parametrize(
    "overrides, fit, reason",
    [
        (dict(share_critic_backbone=True), {}, "the value head reads the actor's hidden states"),
        (dict(engine=PerturbedEngine(scale=0.0)), {}, "does not sample from the trainer's policy module"),
        ({}, dict(precision="bf16-mixed"), "precision 'bf16-mixed'"),
        (dict(update={"is_correction": {"mode": "token_truncate"}}), {}, "update.is_correction weights"),
    ],
    ids=["value_head_on_the_actor", "engine_with_its_own_policy", "bf16_mixed", "corrected"],
)
def test_sampler_refuses_naming_why(tokenizer_dir, tmp_path, overrides, fit, reason):
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=1, scoring={"old_logprobs": "sampler"}, **overrides)
    with pytest.raises(ValueError, match=r"PPOModule: scoring.old_logprobs='sampler' cannot be used here: .*" + reason):
        trainer(tmp_path, **fit).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))


def test_a_critic_free_on_policy_update_records_no_entropy(tokenizer_dir):
    # its old log-probs and entropy come from the update's own forward: the sampler records nothing extra
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), kl={"coef": 0.0}, update={"epochs": 1, "num_minibatches": 1})
    assert module.on_policy_update and module.rollout_generation() is module.generation
    off_policy = tiny_critic_free(tokenizer_dir, gpt2_config())
    assert off_policy.rollout_generation().record_entropy and not off_policy.generation.record_entropy


def test_the_setting_checks_itself():
    assert ScoringSettings(old_logprobs="forward").old_logprobs == "forward"
    with pytest.raises(ValueError, match="scoring.old_logprobs"):
        ScoringSettings(old_logprobs="engine")
