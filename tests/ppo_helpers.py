"""Shared builders for the online-RL tests: a tiny prompt loader, a tiny PPOModule and CriticFreeModule."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer

from lit_rlhf.models import ModelSpec, load_tokenizer
from lit_rlhf.modules import CriticFreeModule, PPOModule
from lit_rlhf.rollout import GenerationSettings

PROMPTS = [
    "the food was",
    "i loved the",
    "the staff is",
    "we hated",
    "the movie",
    "a room",
    "it was",
    "the plot",
]


def prompt_loader(tokenizer_dir: str, n: int = 16, batch_size: int = 8) -> torch.utils.data.DataLoader:
    """Left-padded prompt batches (input_ids, attention_mask), in a fixed order."""
    tok = load_tokenizer(tokenizer_dir)
    enc = [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(n)]
    width = max(map(len, enc))
    rows = [
        {
            "input_ids": torch.tensor([tok.pad_token_id] * (width - len(e)) + e),
            "attention_mask": torch.tensor([0] * (width - len(e)) + [1] * len(e)),
        }
        for e in enc
    ]
    return torch.utils.data.DataLoader(rows, batch_size=batch_size)


# the settings groups whose keys an override merges into the helpers' defaults (``generation``, a group the
# old flat layout had too, is replaced whole, as before)
MERGED_GROUPS = ("update", "kl", "scoring", "samples", "evaluation", "advantage")


def merge_groups(defaults: dict, overrides: dict) -> dict:
    """``defaults`` updated with ``overrides``; a dict given for a settings group is merged into the default
    dict of that group (``update={"epochs": 1}`` keeps the helper's ``num_minibatches``)."""
    out = dict(defaults)
    for key, value in overrides.items():
        if key in MERGED_GROUPS and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def adamw(lr: float):
    return lambda params: torch.optim.AdamW(params, lr=lr)


def tiny_ppo(tokenizer_dir: str, config: dict, cls: type[PPOModule] = PPOModule, **overrides) -> PPOModule:
    kwargs = dict(
        actor=ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0),
        reward_fn="ppo_rewards:the_count",
        generation=GenerationSettings(max_new_tokens=8),
        update={"epochs": 4, "num_minibatches": 2},
        scoring={"forward_batch_size": 4},
        samples={"every": 0},
        monitor_reward_fn="ppo_rewards:the_count",
        actor_optimizer=adamw(1e-2),
        critic_optimizer=adamw(1e-2),
        rng_seed=0,  # not the global seed another test may have left behind (rng_seed=None follows it)
    )
    return cls(**merge_groups(kwargs, overrides))


def tiny_critic_free(tokenizer_dir: str, config: dict, **overrides) -> CriticFreeModule:
    """GRPO with K = 4 samples per prompt on the 'the' count (override advantage={'estimator': ...} etc.)."""
    kwargs = dict(
        actor={"config": config, "tokenizer": tokenizer_dir, "seed": 0},
        reward_fn="ppo_rewards:the_count",
        generation={"max_new_tokens": 8, "num_samples": 4},
        update={"epochs": 4, "num_minibatches": 2},
        scoring={"forward_batch_size": 8},
        samples={"every": 0},
        actor_optimizer=adamw(1e-2),
        rng_seed=0,
    )
    return CriticFreeModule(**merge_groups(kwargs, overrides))


def trainer(tmp_path, **kwargs) -> Trainer:
    from lightning.pytorch.loggers import CSVLogger

    defaults = dict(
        logger=CSVLogger(tmp_path, name="ppo"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        max_epochs=1000,
        deterministic=True,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)
