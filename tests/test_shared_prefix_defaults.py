"""``scoring.shared_prefix``: the default never turns a valid configuration into an error, and ``on`` with an
attention implementation it cannot use is refused when the module is built."""

from __future__ import annotations

import pytest
from conftest import llama_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer


def long_prompt_loader(tokenizer_dir: str, n: int):
    """Prompts much longer than the responses, so ``auto`` packs each prompt's K responses."""
    import torch

    from lit_rlhf.models import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    ids = tok("the food was very good and the staff is friendly but the room was dirty and slow")["input_ids"]
    rows = [{"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long)}] * n
    return torch.utils.data.DataLoader(rows, batch_size=n)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_too_few_groups_for_the_minibatches_fall_back_to_rows(tokenizer_dir, tmp_path, mode):
    # 2 prompts x K = 4 and 4 minibatches: whole groups cannot be split 4 ways, rows can
    module = tiny_critic_free(tokenizer_dir, llama_config(), max_rollouts=2, scoring={"shared_prefix": mode},
                              generation={"max_new_tokens": 2, "num_samples": 4},
                              update={"epochs": 1, "num_minibatches": 4})  # fmt: skip
    trainer(tmp_path).fit(module, long_prompt_loader(tokenizer_dir, 2))
    assert module.rollouts_done == 2


def test_on_with_an_unsupported_attention_is_refused_at_construction(tokenizer_dir):
    config = {**llama_config(), "attn_implementation": "flex_attention"}
    with pytest.raises(ValueError, match=r"CriticFreeModule: scoring.shared_prefix='on' cannot run the actor with"):
        tiny_critic_free(tokenizer_dir, config, scoring={"shared_prefix": "on"})
    tiny_critic_free(tokenizer_dir, config, scoring={"shared_prefix": "auto"})  # auto: packs only where it can


def test_prompt_loader_still_runs_with_the_default(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, llama_config(), max_rollouts=1)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))


@pytest.mark.parametrize("kind", ["dpo", "rm"])
def test_single_model_modules_refuse_on_with_an_unsupported_attention_at_construction(tokenizer_dir, kind):
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import DPOModule, RewardModelModule

    spec = ModelSpec(config={**llama_config(), "attn_implementation": "flex_attention"}, tokenizer=tokenizer_dir)
    cls = DPOModule if kind == "dpo" else RewardModelModule
    with pytest.raises(ValueError, match=rf"{cls.__name__}: shared_prefix='on' cannot run the model with"):
        cls(spec, shared_prefix="on")
