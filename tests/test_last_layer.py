"""The last decoder layer at the scored positions only (models/last_layer.py): reward-model scores, policy
log-probs and entropy on the LM head route, and every parameter's gradient equal to the whole layer's (float32,
Llama / Mistral / Qwen2 / Qwen3 with grouped-query attention, GPT-2, left and right padding, the shared-prompt
layout, LoRA, eager attention), the layer really replaced, the fallbacks, and the helpers by hand."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import gpt2_config, llama_config

from lit_rlhf.data.collators import PreferenceCollator
from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    build_score_model,
    critic_values,
    disable_dropout,
    load_tokenizer,
    packed_policy_forward,
    packed_sequence_scores,
    pair_layout,
    policy_forward,
    scored_last_layer,
    sequence_scores,
    set_scored_last_layer,
    shared_prefix_layout,
)
from lit_rlhf.models.last_layer import last_decoder_layer, scored_rows_mask
from lit_rlhf.models.shared_prefix import positions_by_row

PAD = 0


def family_config(model_type: str, **extra) -> dict:
    config = {**llama_config(), "model_type": model_type, **extra}
    if model_type == "qwen3":
        config["head_dim"] = 8
    return config


FAMILIES = {
    "llama": family_config("llama"),
    "mistral": family_config("mistral", sliding_window=None),
    "qwen2": family_config("qwen2"),
    "qwen3": family_config("qwen3"),
    "llama-eager": family_config("llama", attn_implementation="eager"),
    "gpt2": gpt2_config(),
    "gpt2-eager": {**gpt2_config(), "attn_implementation": "eager", "scale_attn_by_inverse_layer_idx": True},
}


def score_model(tokenizer_dir: str, config: dict, **spec) -> torch.nn.Module:
    model = build_score_model(
        ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0, **spec), load_tokenizer(tokenizer_dir)
    )
    disable_dropout(model)
    return model


def padded_rows(vocab: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of 3-9 real tokens, left- or right-padded to 9."""
    g = torch.Generator().manual_seed(0)
    lengths, width = [9, 3, 6, 1], 9
    ids = torch.full((4, width), PAD)
    mask = torch.zeros(4, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[row, cols] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, cols] = 1
    return ids, mask


def spy(original, layer: torch.nn.Module, calls: list[bool]):
    """``original`` (a layer class's forward) recording in ``calls`` whether each call ran ``layer`` whole;
    it keeps ``original``'s signature, which the GPT-2 block's scored forward reads."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        calls.append(self is layer)
        return original(self, *args, **kwargs)

    return forward


def scores_and_grads(model: torch.nn.Module, score) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = score()
    (out.flatten() * torch.arange(1.0, out.numel() + 1)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)  # float32 sums in other orders


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("left", [True, False])
def test_scores_and_gradients_equal_the_whole_layer(tokenizer_dir, family, left):
    model = score_model(tokenizer_dir, FAMILIES[family])
    ids, mask = padded_rows(model.config.vocab_size, left)
    layer = last_decoder_layer(model)
    assert layer is not None
    set_scored_last_layer(model, False)
    whole = scores_and_grads(model, lambda: sequence_scores(model, ids, mask))
    set_scored_last_layer(model, True)
    calls = []
    original = type(layer).forward
    type(layer).forward = spy(original, layer, calls)
    try:
        scored = scores_and_grads(model, lambda: sequence_scores(model, ids, mask))
    finally:
        type(layer).forward = original
    assert calls == [False] * (
        model.config.num_hidden_layers - 1
    )  # not the last layer: it ran its scored forward
    assert "forward" not in vars(layer)  # and the layer is itself again
    assert_same(scored, whole)


def pair_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    rows = [
        {"prompt_input_ids": toks(p), "chosen_input_ids": toks(c) + [2], "rejected_input_ids": toks(r) + [2]}
        for p, c, r in [(7, 4, 1), (2, 0, 3), (5, 2, 2), (4, 0, 0)]  # the last pair: two empty responses
    ]
    return PreferenceCollator(PAD)(rows)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_the_shared_prompt_layout_scores_two_positions_per_row(tokenizer_dir, family):
    model = score_model(tokenizer_dir, FAMILIES[family])
    batch = pair_batch(model.config.vocab_size)
    ids, mask, rmask = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    layout = pair_layout(model, "on", ids, mask, rmask, PAD, lm_head=False)
    set_scored_last_layer(model, False)
    padded = scores_and_grads(model, lambda: sequence_scores(model, ids, mask))
    packed_whole = scores_and_grads(model, lambda: packed_sequence_scores(model, layout))
    set_scored_last_layer(model, True)
    packed = scores_and_grads(model, lambda: packed_sequence_scores(model, layout))
    assert_same(packed, packed_whole)
    assert_same(packed, padded)


LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # GPT-2's Conv1D projections: peft's fan_in_fan_out layers
}


@pytest.mark.parametrize("family", sorted(LORA_TARGETS))
def test_lora_reward_model(tokenizer_dir, family):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS[family]}
    model = score_model(tokenizer_dir, FAMILIES[family], lora=lora)
    assert last_decoder_layer(model) is not None
    for name, p in model.named_parameters():  # peft starts lora_B at 0: random adapters change the scores
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    ids, mask = padded_rows(model.config.vocab_size, left=True)
    set_scored_last_layer(model, False)
    whole = scores_and_grads(model, lambda: sequence_scores(model, ids, mask))
    set_scored_last_layer(model, True)
    assert_same(scores_and_grads(model, lambda: sequence_scores(model, ids, mask)), whole)


def test_fallbacks_run_the_whole_layer(tokenizer_dir):
    neox = {**llama_config(), "model_type": "gpt_neox", "num_hidden_layers": 2, "intermediate_size": 64}
    assert last_decoder_layer(score_model(tokenizer_dir, neox)) is None  # not a supported layer
    upcast = {**gpt2_config(), "attn_implementation": "eager", "reorder_and_upcast_attn": True}
    assert last_decoder_layer(score_model(tokenizer_dir, upcast)) is None  # another rounding of the scores
    off = score_model(tokenizer_dir, FAMILIES["llama"], scored_last_layer=False)  # the ModelSpec switch
    assert last_decoder_layer(off) is None
    flash = score_model(tokenizer_dir, FAMILIES["llama"])
    flash.config._attn_implementation = "flash_attention_2"
    assert last_decoder_layer(flash) is None
    with scored_last_layer(flash, torch.zeros(1, 1, dtype=torch.long)) as replaced:
        assert not replaced
    # attention dropout while training: the whole layer (dropout is random per position)
    model = score_model(tokenizer_dir, family_config("llama", attention_dropout=0.1))
    for module in model.modules():  # score_model's disable_dropout zeroed it
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    model.train()
    ids, mask = padded_rows(model.config.vocab_size, left=True)
    layer = last_decoder_layer(model)
    with scored_last_layer(model, torch.zeros(4, 1, dtype=torch.long)) as replaced:
        assert replaced
        calls = []
        original = type(layer).forward
        type(layer).forward = spy(original, layer, calls)
        try:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        finally:
            type(layer).forward = original
    assert calls == [False] * (model.config.num_hidden_layers - 1) + [True]
    # GPT-2 with its default dropout, training: the whole block; evaluating: the scored block
    model = score_model(tokenizer_dir, gpt2_config())
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    layer = last_decoder_layer(model)
    for training, expected in [(True, [False, True]), (False, [False])]:
        model.train(training)
        calls = []
        original = type(layer).forward
        type(layer).forward = spy(original, layer, calls)
        try:
            with torch.no_grad(), scored_last_layer(model, torch.zeros(4, 1, dtype=torch.long)):
                model(input_ids=ids, attention_mask=mask, use_cache=False)
        finally:
            type(layer).forward = original
        assert calls == expected
    # a patch of the block's forward that hides its signature: the block runs whole (its mask is not known)
    model.eval()
    ids, mask = padded_rows(model.config.vocab_size, left=True)
    set_scored_last_layer(model, False)
    whole = scores_and_grads(model, lambda: sequence_scores(model, ids, mask))
    set_scored_last_layer(model, True)
    calls = []
    original = type(layer).forward
    type(layer).forward = lambda self, *a, **k: calls.append(self is layer) or original(self, *a, **k)
    try:
        patched = scores_and_grads(model, lambda: sequence_scores(model, ids, mask))
    finally:
        type(layer).forward = original
    assert calls == [False, True]
    assert_same(patched, whole)
    with pytest.raises(ValueError, match="ModelSpec.scored_last_layer: expected true or false, got 'yes'"):
        ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, scored_last_layer="yes")


def test_positions_by_row_by_hand():
    # width 5, 3 rows: row 0 scores 1 and 4, row 1 nothing, row 2 scores 3 (listed twice: two empty responses)
    positions, valid = positions_by_row(torch.tensor([4, 1, 13, 13]), rows=3, width=5)
    assert positions.tolist() == [[1, 4], [0, 0], [3, 0]]
    assert valid.tolist() == [[True, True], [False, False], [True, False]]


def test_scored_rows_mask_by_hand():
    positions = torch.tensor([[2, 0], [1, 3]])
    causal = scored_rows_mask(None, positions, 4)
    assert causal.shape == (2, 1, 2, 4)
    assert causal[0, 0].tolist() == [[True, True, True, False], [True, False, False, False]]
    assert causal[1, 0].tolist() == [[True, True, False, False], [True, True, True, True]]
    full = torch.arange(2 * 16.0).view(2, 1, 4, 4)
    taken = scored_rows_mask(full, positions, 4)
    assert taken[0, 0].tolist() == [full[0, 0, 2].tolist(), full[0, 0, 0].tolist()]
    assert taken[1, 0].tolist() == [full[1, 0, 1].tolist(), full[1, 0, 3].tolist()]
    broadcast = scored_rows_mask(full[:1], positions, 4)  # a (1, 1, L, L) mask serves every row
    assert broadcast[1, 0].tolist() == [full[0, 0, 1].tolist(), full[0, 0, 3].tolist()]


def rollout_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """3 prompts (lengths 9, 4, 6; left-padded to 9) x K = 3 responses of 1-6 tokens (right-padded to 6)."""
    g = torch.Generator().manual_seed(0)
    p_len, r_len, P, T = [9, 4, 6], [6, 2, 4, 1, 5, 3, 6, 6, 2], 9, 6
    ids, mask = torch.full((9, P + T), PAD), torch.zeros(9, P + T, dtype=torch.long)
    for group, p in enumerate(p_len):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for k in range(3):
            b = 3 * group + k
            ids[b, P - p : P], mask[b, P - p : P] = prompt, 1
            ids[b, P : P + r_len[b]] = torch.randint(3, vocab, (r_len[b],), generator=g)
            mask[b, P : P + r_len[b]] = 1
    return ids, mask, P, T


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("packed", [False, True])
def test_policy_log_probs_and_gradients_equal_the_whole_layer(tokenizer_dir, family, packed):
    # the LM head route keeps the last positions only (logits_to_keep): the last layer runs there only
    spec = ModelSpec(config=FAMILIES[family], tokenizer=tokenizer_dir, seed=0, logits_chunking="on")
    model = build_causal_lm(spec, load_tokenizer(tokenizer_dir))
    disable_dropout(model)
    ids, mask, P, T = rollout_rows(model.config.vocab_size)
    prompt_mask, response_mask = mask.clone(), mask.clone()
    prompt_mask[:, P:], response_mask[:, :P] = 0, 0
    layout = shared_prefix_layout(model, "on", ids, prompt_mask, response_mask, PAD, ids.numel())

    def forward():
        if packed:
            logprobs, entropy = packed_policy_forward(model, layout, 0.8)
        else:
            logprobs, entropy, _ = policy_forward(model, ids, mask, T, 0.8)
        return torch.cat([logprobs, entropy])

    set_scored_last_layer(model, False)
    whole = scores_and_grads(model, forward)
    set_scored_last_layer(model, True)
    layer, calls = last_decoder_layer(model), []
    original = type(layer).forward
    type(layer).forward = spy(original, layer, calls)
    try:
        scored = scores_and_grads(model, forward)
    finally:
        type(layer).forward = original
    assert True not in calls  # the last layer ran at the kept positions only
    assert_same(scored, whole)


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama-eager", "gpt2-eager"])
def test_critic_values_and_gradients_equal_the_whole_layer(tokenizer_dir, family):
    # PPO's critic reads its values at the T positions before each response token only
    model = score_model(tokenizer_dir, FAMILIES[family])
    ids, mask, _, T = rollout_rows(model.config.vocab_size)
    set_scored_last_layer(model, False)
    whole = scores_and_grads(model, lambda: critic_values(model, ids, mask, T))
    set_scored_last_layer(model, True)
    layer, calls = last_decoder_layer(model), []
    original = type(layer).forward
    type(layer).forward = spy(original, layer, calls)
    try:
        scored = scores_and_grads(model, lambda: critic_values(model, ids, mask, T))
    finally:
        type(layer).forward = original
    assert True not in calls  # the last layer ran at the read positions only
    assert scored[0].shape == (ids.shape[0], T)
    assert_same(scored, whole)
    assert critic_values(model, ids, mask, 0).shape == (ids.shape[0], 0)
