"""Generation and the replay buffer: sampling distribution = scoring distribution, masks, shuffling."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config
from ppo_helpers import prompt_loader

from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, policy_forward
from lit_rlhf.replay import ReplayBuffer
from lit_rlhf.rollout import (
    GenerationSettings,
    Rollout,
    generate_responses,
    generation_kwargs,
    response_mask_from_tokens,
)


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_distribution_equals_scoring_distribution(tokenizer_dir, config, temperature):
    # old_logprobs must be the log-probs of the distribution the tokens were sampled from: recompute
    # them with the scoring forward and compare with generate's own logits, on left-padded prompts.
    tok = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tok).eval()
    batch = next(iter(prompt_loader(tokenizer_dir, n=8, batch_size=8)))
    assert (batch["attention_mask"] == 0).any(), "the prompts must include left padding"
    settings = GenerationSettings(max_new_tokens=6, temperature=temperature)
    kwargs = generation_kwargs(
        batch["input_ids"], batch["attention_mask"], settings, [tok.eos_token_id], tok.pad_token_id
    )
    out = model.generate(**kwargs, output_logits=True, return_dict_in_generate=True)
    P = batch["input_ids"].shape[1]
    responses = out.sequences[:, P:]
    sampled_lp = torch.stack([torch.log_softmax(step.float() / temperature, -1) for step in out.logits], 1)
    sampled_lp = sampled_lp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    mask, _ = response_mask_from_tokens(responses, [tok.eos_token_id], tok.pad_token_id)
    attention = torch.cat([batch["attention_mask"], mask.long()], 1)
    with torch.no_grad():
        scored_lp, _, _ = policy_forward(model, out.sequences, attention, responses.shape[1], temperature)
    torch.testing.assert_close(scored_lp[mask], sampled_lp[mask], atol=1e-5, rtol=0)


def test_response_mask_ends_at_first_stop_and_excludes_padding():
    eos, stop, pad = 1, 2, 0
    responses = torch.tensor(
        [
            [5, 6, 1, 7, 0],  # EOS at 2: real up to and including it
            [5, 2, 1, 0, 0],  # a configured stop id at 1
            [5, 6, 7, 8, 9],  # no stop: truncated, all real
            [1, 0, 0, 0, 0],  # immediate EOS: one real token
        ]
    )
    mask, has_stop = response_mask_from_tokens(responses, [eos, stop], pad)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert has_stop.tolist() == [True, True, False, True]


def test_generate_responses_masks_after_eos_and_flags_truncation(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=0), tok).eval()
    # make EOS very likely so some rows stop early and others may not
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 0
        model.transformer.wte.weight[tok.eos_token_id] += 0
    batch = next(iter(prompt_loader(tokenizer_dir, n=8, batch_size=8)))
    torch.manual_seed(0)
    responses, mask, truncated, *_ = generate_responses(
        model, batch["input_ids"], batch["attention_mask"], GenerationSettings(max_new_tokens=5),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    assert responses.shape[1] <= 5
    assert not (responses[mask] == tok.pad_token_id).any(), "pad is never sampled"
    lengths = mask.sum(1)
    for row, n in zip(responses, lengths):
        assert (row[n:] == tok.pad_token_id).all()
        if n < 5:
            assert row[n - 1] == tok.eos_token_id
    assert truncated.tolist() == [(n == 5 and row[4] != tok.eos_token_id).item() for row, n in zip(responses, lengths)]


def _rollout(n: int) -> Rollout:
    t = torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    ids = torch.arange(n).unsqueeze(1).repeat(1, 5)
    ones = torch.ones(n, 3, dtype=torch.bool)
    return Rollout(ids, torch.ones_like(ids), ones, t, t, t, t, t, t, t[:, 0])


def test_replay_buffer_minibatches_cover_rows_once_and_resume_identically():
    buffer = ReplayBuffer(num_minibatches=3, seed=7)
    buffer.put(_rollout(10))
    epoch = [mb.input_ids[:, 0].tolist() for mb in buffer.minibatches()]
    assert sorted(sum(epoch, [])) == list(range(10))
    assert [len(e) for e in epoch] == [4, 3, 3]
    # every field is sliced by the same rows
    for mb in buffer.minibatches():
        assert mb.old_logprobs[:, 0].tolist() == mb.input_ids[:, 0].float().tolist()
    state = buffer.state_dict()
    after = [mb.input_ids[:, 0].tolist() for mb in buffer.minibatches()]
    resumed = ReplayBuffer(num_minibatches=3, seed=123)
    resumed.load_state_dict(state)
    resumed.put(_rollout(10))
    assert [mb.input_ids[:, 0].tolist() for mb in resumed.minibatches()] == after


def test_replay_buffer_rejects_too_few_rows():
    with pytest.raises(ValueError, match="num_minibatches"):
        ReplayBuffer(num_minibatches=4).put(_rollout(3))
