"""The shared-prompt layout (models/shared_prefix.py): a hand-built example of the packed row, and
log-probs, entropy, scores and gradients equal to the padded layout on tiny GPT-2 and Llama models
(float32, prompts of different lengths left-padded, EOS-stopped responses right-padded); GRPO, DPO and
RM with the layout forced on against forced off."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from test_ppo import read_metrics

from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    build_score_model,
    disable_dropout,
    load_tokenizer,
    pack_shared_prefix,
    packed_policy_forward,
    packed_response_logprobs,
    packed_sequence_scores,
    pair_layout,
    policy_forward,
    response_logprobs,
    sequence_scores,
    shared_prefix_layout,
)
from lit_rlhf.replay import ReplayBuffer
from lit_rlhf.rollout import Rollout

PAD = 0


def test_layout_by_hand():
    # Two rows share prompt [5, 6] (left-padded by one), responses [7, 8] and [9]; a third row has
    # prompt [4] and response [3]. Packed: [5 6 7 8 9] and [4 3 pad pad pad].
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [0, 0, 4, 3, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 1, 0]])
    P = 3
    prompt_mask, response_mask = attention.clone(), attention.clone()
    prompt_mask[:, P:], response_mask[:, :P] = 0, 0
    layout = pack_shared_prefix(ids, prompt_mask, response_mask, PAD, response_width=2)
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    expected = torch.tensor(
        [
            [  # group 0: prompt 0-1, row 0's response 2-3, row 1's response 4
                [1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [1, 1, 1, 1, 0],
                [1, 1, 0, 0, 1],  # row 1's token sees the prompt and itself, not row 0's response
            ],
            [  # group 1: prompt 0, response 1, padding attends to itself only
                [1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 0, 1, 0],
                [0, 0, 0, 0, 1],
            ],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(layout.attention_mask[:, 0], expected)
    # token t is predicted at the position before it (the prompt's last for t = 0); flat index g*5 + col
    assert layout.predict_index.tolist() == [[1, 2], [1, 1], [5, 5]]
    assert layout.labels.tolist() == [[7, 8], [9, 0], [3, 0]]
    assert layout.response_mask.tolist() == [[True, True], [True, False], [True, False]]
    assert layout.last_index.tolist() == [3, 4, 6]
    assert layout.logits_to_keep == 5  # from the shortest prompt's last token (column 0) on
    additive = pack_shared_prefix(ids, prompt_mask, response_mask, PAD, torch.float32).attention_mask
    assert torch.equal(additive == 0, layout.attention_mask)
    assert additive.min() == torch.finfo(torch.float32).min


def _rollout_rows(vocab: int, seed: int = 0):
    """3 prompts (lengths 9, 4, 6; left-padded) x K = 3 responses of lengths 1-6 ending in EOS (=2)."""
    g = torch.Generator().manual_seed(seed)
    p_len, r_len, P, T = [9, 4, 6], [6, 2, 4, 1, 5, 3, 6, 6, 2], 9, 6
    ids = torch.full((9, P + T), PAD)
    mask = torch.zeros(9, P + T, dtype=torch.long)
    for g_, p in enumerate(p_len):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for k in range(3):
            b = 3 * g_ + k
            ids[b, P - p : P], mask[b, P - p : P] = prompt, 1
            response = torch.randint(3, vocab, (r_len[b],), generator=g)
            response[-1] = 2
            ids[b, P : P + r_len[b]], mask[b, P : P + r_len[b]] = response, 1
    return ids, mask, P, T


def _split(mask: torch.Tensor, P: int):
    prompt_mask, response_mask = mask.clone(), mask.clone()
    prompt_mask[:, P:], response_mask[:, :P] = 0, 0
    return prompt_mask, response_mask


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def spec(request, tokenizer_dir):
    config = gpt2_config() if request.param == "gpt2" else llama_config()
    return ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_policy_logprobs_entropy_and_gradients_equal_padded(spec, tokenizer_dir, attn):
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(spec, tokenizer)
    disable_dropout(model)
    model.config._attn_implementation = attn
    ids, mask, P, T = _rollout_rows(model.config.vocab_size)
    layout = shared_prefix_layout(model, "on", ids, *_split(mask, P), PAD, 0, response_width=T)
    assert layout.input_ids.shape[0] == 3  # one row per prompt
    rmask = mask[:, P:].bool()
    outputs = []
    for packed in (False, True):
        model.zero_grad()
        if packed:
            logprobs, entropy = packed_policy_forward(model, layout, temperature=0.7)
        else:
            logprobs, entropy, _ = policy_forward(model, ids, mask, T, 0.7)
        ((logprobs * rmask).sum() + 0.1 * (entropy * rmask).sum()).backward()
        outputs.append((logprobs[rmask], entropy[rmask], _grads(model)))
    (lp0, ent0, g0), (lp1, ent1, g1) = outputs
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-6, atol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _pair_batch(vocab: int):
    """PreferenceCollator's layout: 3 pairs, prompts of 2-7 tokens, responses of 1-5, right-padded."""
    from lit_rlhf.data.collators import PreferenceCollator

    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    rows = [
        {"prompt_input_ids": toks(p), "chosen_input_ids": toks(c) + [2], "rejected_input_ids": toks(r) + [2]}
        for p, c, r in [(7, 4, 1), (2, 0, 3), (5, 2, 2)]
    ]
    return PreferenceCollator(PAD)(rows)


def test_pair_logprobs_scores_and_gradients_equal_padded(spec, tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    for build in (build_causal_lm, build_score_model):
        model = build(spec, tokenizer)
        disable_dropout(model)
        batch = _pair_batch(model.config.vocab_size)
        ids, mask, rmask = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        layout = pair_layout(model, "on", ids, mask, rmask, PAD)
        assert layout.input_ids.shape[0] == 3  # [prompt | chosen | rejected] per pair
        outputs = []
        for packed in (False, True):
            model.zero_grad()
            if build is build_causal_lm:
                out, n = packed_response_logprobs(model, layout) if packed else response_logprobs(model, ids, mask, rmask)
                assert n.tolist() == rmask.sum(1).tolist()
            else:
                out = packed_sequence_scores(model, layout) if packed else sequence_scores(model, ids, mask)
            (out * torch.arange(1.0, 7.0)).sum().backward()
            outputs.append((out.detach(), _grads(model)))
        torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-6, atol=1e-5)
        for a, b in zip(outputs[1][1], outputs[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_and_off_and_unsupported(spec, tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(spec, tokenizer)
    ids, mask, P, T = _rollout_rows(model.config.vocab_size)
    prompt_mask, response_mask = _split(mask, P)
    assert shared_prefix_layout(model, "off", ids, prompt_mask, response_mask, PAD, 9 * (T + 1)) is None
    # prompts (57 tokens) longer than the responses (35): K = 3 rows computed as one pays
    assert shared_prefix_layout(model, "auto", ids, prompt_mask, response_mask, PAD, 9 * (T + 1)) is not None
    # responses longer than the prompts: the measured break-even says no
    assert shared_prefix_layout(model, "auto", ids, response_mask, prompt_mask, PAD, 9 * (T + 1)) is None
    model.config._attn_implementation = "flash_attention_2"
    assert shared_prefix_layout(model, "auto", ids, prompt_mask, response_mask, PAD, 9 * (T + 1)) is None
    with pytest.raises(ValueError, match="shared_prefix='on' cannot run with attention implementation"):
        shared_prefix_layout(model, "on", ids, prompt_mask, response_mask, PAD, 9 * (T + 1))


def test_replay_buffer_shuffles_whole_groups_and_resumes():
    B, K = 12, 3
    rollout = Rollout(
        torch.arange(B)[:, None].repeat(1, 4), torch.ones(B, 4), torch.ones(B, 2), torch.zeros(B, 2),
        torch.zeros(B, 2), None, None, torch.zeros(B, 2), None, torch.zeros(B),
    )  # fmt: skip
    buffer = ReplayBuffer(num_minibatches=2, seed=5)
    buffer.put(rollout, group_size=K)
    state = buffer.state_dict()
    rows = [mb.input_ids[:, 0].tolist() for mb in buffer.minibatches()]
    assert sorted(sum(rows, [])) == list(range(B))
    for part in rows:  # whole groups, each in order
        assert len(part) == 6 and all(part[i + 1] == part[i] + 1 for i in range(0, 6, 3) for _ in [0])
        assert all(part[i] % K == 0 and part[i : i + K] == list(range(part[i], part[i] + K)) for i in (0, 3))
    resumed = ReplayBuffer(num_minibatches=2, seed=99)
    resumed.load_state_dict(state)
    resumed.put(rollout, group_size=K)
    assert [mb.input_ids[:, 0].tolist() for mb in resumed.minibatches()] == rows
    with pytest.raises(ValueError, match="group_size=5 must be >= 1 and divide"):
        buffer.put(rollout, group_size=5)
    with pytest.raises(ValueError, match="3 groups of 4 rows cannot be split"):
        ReplayBuffer(num_minibatches=4).put(rollout, group_size=4)


def test_module_arguments_are_validated(tokenizer_dir):
    from lit_rlhf.modules import DPOModule, RewardModelModule

    spec = {"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0}
    with pytest.raises(ValueError, match="CriticFreeModule: scoring.shared_prefix must be one of"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), scoring={"shared_prefix": "always"})
    with pytest.raises(ValueError, match="PPOModule: scoring.shared_prefix='on' needs forwards with a shared-prompt"):
        tiny_ppo(tokenizer_dir, gpt2_config(), scoring={"shared_prefix": "on"})
    with pytest.raises(ValueError, match="DPOModule: shared_prefix must be one of"):
        DPOModule(spec, shared_prefix="yes")
    with pytest.raises(ValueError, match="RewardModelModule: shared_prefix must be one of"):
        RewardModelModule(spec, shared_prefix=True)


def test_grpo_fit_with_the_layout_on_trains_like_off(tokenizer_dir, tmp_path):
    # One minibatch per epoch: group and row shuffling then give the same minibatch (the whole rollout),
    # so the two runs differ only by float rounding (and sampling on top of slightly different weights).
    metrics = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        module = tiny_critic_free(
            tokenizer_dir, llama_config(), scoring={"shared_prefix": mode}, max_rollouts=3,
            update={"num_minibatches": 1, "epochs": 2, "ent_coef": 0.01}, kl={"loss_coef": 0.01},
        )  # fmt: skip
        trainer(tmp_path / mode).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
        metrics[mode] = read_metrics(tmp_path / mode)
    first_off, first_on = metrics["off"][0], metrics["on"][0]
    for key in ("rollout/score", "rollout/kl_ref", "rollout/entropy", "policy/policy_loss", "policy/kl_loss"):
        assert first_on[key] == pytest.approx(first_off[key], rel=1e-4, abs=1e-6), key
    assert len(metrics["on"]) == len(metrics["off"]) == 3


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_sliding_window_attention_keeps_the_padded_layout(tokenizer_dir, model_type):
    # the block mask holds no window: packed, a response would see prompt tokens its padded row does not
    from lit_rlhf.models.shared_prefix import sliding_window

    config = {**llama_config(), "model_type": model_type, "sliding_window": 4}
    if model_type == "qwen2":
        config |= {"use_sliding_window": True, "max_window_layers": 0}
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tokenizer)
    assert sliding_window(model) == 4
    ids, mask, P, T = _rollout_rows(model.config.vocab_size)
    prompt_mask, response_mask = _split(mask, P)
    assert shared_prefix_layout(model, "auto", ids, prompt_mask, response_mask, PAD, 9 * (T + 1)) is None
    with pytest.raises(ValueError, match=r"shared_prefix='on' cannot run with sliding-window attention \(window 4"):
        shared_prefix_layout(model, "on", ids, prompt_mask, response_mask, PAD, 9 * (T + 1))
    full = build_causal_lm(ModelSpec(config={**config, "sliding_window": None}, tokenizer=tokenizer_dir, seed=0), tokenizer)
    assert sliding_window(full) is None  # no window: packs as Llama does
    assert shared_prefix_layout(full, "auto", ids, prompt_mask, response_mask, PAD, 9 * (T + 1)) is not None
