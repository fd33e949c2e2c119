"""Tiny PPO and GRPO fits with the vLLM engine (``engine: vllm``) against the real vLLM: they raise the rule
reward as the Hugging Face engine's do, on policy (importance ratios ~1, log-prob gaps small after every
sync), a seeded run repeats, and a LoRA actor is synced. Runs in ``.venv-vllm`` (``make test-vllm``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make test-vllm)")
pytestmark = pytest.mark.vllm

from conftest import gpt2_config  # noqa: E402
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer  # noqa: E402
from test_online_contract import read_metrics  # noqa: E402
from test_vllm_engine import vllm_llama  # noqa: E402

ENGINE = {"class_path": "vllm", "init_args": {"kv_cache_gib": 1}}
# the share of "e" characters: a dense rule reward this Llama (the smallest vLLM's CPU kernels take) learns
# within a few rollouts with either engine (Hugging Face: 0.08 -> 0.19 over 12 rollouts, vLLM 0.07 -> 0.23)
REWARD = "ppo_rewards:e_rate"
TIMINGS = ("rollout/engine_generate_s", "rollout/engine_sync_s")


def score_rise(rows, n=4):
    return sum(r["rollout/score"] for r in rows[:n]) / n, sum(r["rollout/score"] for r in rows[-n:]) / n


def assert_on_policy(rows, limit=1e-4):
    """The engine sampled from the trainer's current weights at every rollout: the trainer's and the
    engine's log-probs of every sampled token agree to float rounding (these fits move the policy by
    17-20 nats of KL, so a missed sync shows)."""
    for row in rows:
        assert row["rollout/logprob_diff_max"] < limit, row["rollout/logprob_diff_max"]
        assert abs(row["rollout/is_ratio_mean"] - 1) < limit, row["rollout/is_ratio_mean"]
        assert row["rollout/engine_sync_s"] > 0 and row["rollout/engine_generate_s"] > 0


def test_grpo_with_the_vllm_engine_raises_the_rule_reward_and_repeats(tokenizer_dir, tmp_path):
    def fit(root, **overrides):
        torch.manual_seed(0)
        module = tiny_critic_free(tokenizer_dir, vllm_llama(322), engine=ENGINE, reward_fn=REWARD,
                                  max_rollouts=12, **overrides)
        trainer(root).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
        return read_metrics(root)

    rows = fit(tmp_path / "a")
    first, last = score_rise(rows)
    assert last > first + 0.06, (first, last)
    assert_on_policy(rows)
    again = fit(tmp_path / "b")
    assert len(again) == len(rows)
    for a, b in zip(rows, again):  # a seeded run repeats (the engine's timings aside)
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}


def test_ppo_with_the_vllm_engine_raises_the_rule_reward(tokenizer_dir, tmp_path):
    # test_ppo's rule-reward fit (16 prompts a rollout, the count of "the"), on a GPT-2 of head dim 32; its
    # sparse reward is first found at rollout 18 with this engine's draws (rollout 7 with Hugging Face's)
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, {**gpt2_config(), "n_embd": 64}, engine=ENGINE, max_rollouts=24)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    rows = read_metrics(tmp_path)
    first, last = score_rise(rows)
    assert last > first + 1.0, (first, last)
    assert_on_policy(rows)


def test_a_lora_actor_is_synced_after_every_update(tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    actor = {"config": vllm_llama(322), "tokenizer": tokenizer_dir, "seed": 0,
             "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"]}}  # fmt: skip
    module = tiny_critic_free(tokenizer_dir, vllm_llama(322), actor=actor, engine=ENGINE, reward_fn=REWARD, max_rollouts=8,
                              actor_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-2))  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    rows = read_metrics(tmp_path)
    assert_on_policy(rows)
    assert rows[-1]["rollout/kl_ref"] > 0.01, "the adapters moved the policy (so the syncs carried something)"


def test_without_the_syncs_the_on_policy_check_fails(tokenizer_dir, tmp_path, monkeypatch):
    # the same fit with the engine never synced after the first load: it samples from the initial
    # weights, and the check above sees it (so it can fail)
    from lit_rlhf.engines.vllm import VLLMEngine

    sync = VLLMEngine.sync_weights
    monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self, model: None if self.timings.get("sync_s") else sync(self, model))
    torch.manual_seed(0)
    module = tiny_critic_free(tokenizer_dir, vllm_llama(322), engine=ENGINE, reward_fn=REWARD, max_rollouts=6)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    rows = read_metrics(tmp_path)
    with pytest.raises(AssertionError):
        assert_on_policy(rows)
    assert rows[-1]["rollout/logprob_diff_mean"] > 0.1
