"""Generation of :class:`~lit_rlhf.modules.online.OnlineRLModule`: the prompts of a batch, K copies each,
sent through the rollout engine (``lit_rlhf.engines``), and the rows the trainer scores.

Shapes: G prompts, K samples per prompt, B = G*K rollout rows, P prompt length (left-padded), T response
length (right-padded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple

import torch
from lightning.pytorch import LightningModule

from lit_rlhf.data.contract import check_batch, left_pad_prompts
from lit_rlhf.engines import Responses, RolloutEngine, check_responses
from lit_rlhf.environments import Episodes, open_episodes, run_episodes
from lit_rlhf.models import check_positions, generation_stop_ids
from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.distributed import generation_context
from lit_rlhf.modules.online_eval import seeded_fork
from lit_rlhf.rollout import GenerationSettings


class Sample(NamedTuple):
    """A generated rollout before scoring: (G*K, P) prompts, the engine's responses, the (B, P+T) rows, and
    the prompt rows' other columns for the reward functions (one value per rollout row; None: no columns)."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: Responses
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor  # (B, T) bool, the tokens learned from
    columns: dict[str, list] | None = None
    episodes: Episodes | None = None  # a multi-turn rollout's episodes (``environment``), else None

    @property
    def env_scores(self) -> torch.Tensor | None:
        """(B,) the environment's episode rewards (None: no environment)."""
        return None if self.episodes is None else self.episodes.rewards


@internal_base
class OnlineGeneration(LightningModule):
    """Mixin of OnlineRLModule (it relies on the base's ``engine``, ``generation``, ``environment``, ``env_cls``, ``actor``,
    ``tokenizer``)."""

    @property
    def num_samples(self) -> int:
        """K, the responses sampled per prompt."""
        return self.generation.num_samples

    def expand_prompts(
        self, batch: dict[str, torch.Tensor], num_samples: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, P) prompts -> (G*K, P), checked, LEFT-padded, each prompt's K copies contiguous.

        The batch must have the ``prompt`` layout (``lit_rlhf.data.contract``); right-padded rows are
        left-padded here, so generation continues every prompt from its last real token (K defaults to
        ``generation.num_samples``).
        """
        check_batch(batch, "prompt", type(self).__name__)
        ids, mask = left_pad_prompts(batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id)
        k = self.num_samples if num_samples is None else num_samples
        if k == 1:
            return ids, mask
        return ids.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)

    def expand_columns(self, batch: dict, num_samples: int | None = None) -> dict[str, list] | None:
        """The batch's prompt-row ``columns`` (``lit_rlhf.data.PromptDataModule``: one list of G values per
        column) with each value repeated K times, as the rows of :meth:`expand_prompts`; None without them."""
        columns = batch.get("columns")
        if not columns:
            return None
        k = self.num_samples if num_samples is None else num_samples
        return {name: [value for value in values for _ in range(k)] for name, values in columns.items()}

    def rollout_engine(self) -> RolloutEngine:
        """The engine, set up with the actor (again when the actor object changed, e.g. wrapped by FSDP)."""
        if self._engine_model is not self.actor:
            self.engine.setup(self.actor, self.tokenizer, world_size=self.trainer.world_size)
            set_engine_model(self, self.actor)
        return self.engine

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        settings: GenerationSettings | None = None,
        greedy: bool = False,
    ) -> Responses:
        """One response per (B, P) prompt row from the engine, sampled with ``settings`` (default
        ``generation``) or greedy; the rows are ``expand_prompts``'s, in groups of ``settings.num_samples``."""
        settings = with_model_stops(settings or self.generation, self.actor, self.tokenizer)
        if prompt_mask.numel():
            T = settings.max_new_tokens
            what = f"the longest prompt (or episode context) and generation.max_new_tokens={T}"
            check_positions(self.actor, prompt_mask.sum(dim=1).max() + T, type(self).__name__, what)
        engine = self.rollout_engine()
        with self.trainer.profiler.profile("rollout/generate"):
            if not engine.uses_policy:
                return check_responses(engine.generate(prompts, prompt_mask, settings, greedy=greedy), prompts, settings)
            was_training = self.actor.training
            self.actor.eval()
            with generation_context(self, self.actor):
                out = engine.generate(prompts, prompt_mask, settings, greedy=greedy)
            self.actor.train(was_training)
        return check_responses(out, prompts, settings)

    def sample(self, batch: dict[str, torch.Tensor]) -> Sample:
        """Step 1 of every rollout: K responses per prompt of ``batch`` (each prompt's K rows contiguous),
        joined to their prompts as the (B, P+T) rows the trainer scores, with the batch's ``columns``."""
        with self.rank_sampling_rng():
            return self.rollout_sample(batch, self.rollout_generation())

    @contextmanager
    def rank_sampling_rng(self) -> Iterator[None]:
        """Each data-parallel rank's own random stream for a rollout's sampling (and its environments' draws).

        ``seed_everything`` seeds every rank alike, so ranks sampling from the global RNG drew the same
        variates: correlated samples across ranks (identical ones for identical prompts). With several ranks
        the draws come from a fork seeded by (rng_seed, rank, rollout), which also resumes exactly on every
        rank; the global streams are left as they were. One process samples from the global RNG as before.
        """
        if self.trainer.world_size == 1:
            yield
            return
        with seeded_fork((self.rng_seed, self.global_rank, self.rollouts_done, -1), self.device):  # -1: not an eval key
            yield

    def rollout_sample(
        self, batch: dict[str, torch.Tensor], settings: GenerationSettings, greedy: bool = False
    ) -> Sample:
        """The ``Sample`` of ``batch`` under ``settings`` (K = its ``num_samples``): one engine response per
        row, or with an ``environment`` one multi-turn episode per row (``lit_rlhf.environments``: turns
        generated batched across episodes, observations appended as tokens, the loss mask on the model's
        tokens only)."""
        prompts, prompt_mask = self.expand_prompts(batch, settings.num_samples)
        columns = self.expand_columns(batch, settings.num_samples)
        episodes = None
        if self.environment.enabled:
            rows = self.episode_rows(prompts, prompt_mask, columns)
            envs, prompts, prompt_mask = open_episodes(
                self.env_cls, self.environment, rows, self.tokenizer, prompts, prompt_mask, settings.num_samples
            )
            episodes = run_episodes(
                self.generate, self.tokenizer, envs, prompts, prompt_mask, settings, self.environment, greedy,
                any_running=self.any_rank_running if self.trainer.world_size > 1 else None,
            )
            responses = episodes.responses
        else:
            responses = self.generate(prompts, prompt_mask, settings, greedy)
        input_ids = torch.cat([prompts, responses.ids], dim=1)
        attention_mask = torch.cat([prompt_mask, responses.mask.long()], dim=1)
        loss_mask = responses.mask if responses.loss_mask is None else responses.loss_mask & responses.mask
        return Sample(prompts, prompt_mask, responses, input_ids, attention_mask, loss_mask, columns, episodes)

    def any_rank_running(self, running: bool) -> bool:
        """Whether any data-parallel rank still has an episode running (one all-reduce)."""
        flag = torch.tensor(float(running), device=self.device)
        return bool(self.trainer.strategy.reduce(flag, reduce_op="sum") > 0)

    def episode_rows(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, columns: dict[str, list] | None) -> list[dict]:
        """Per rollout row, what its environment's ``reset`` gets: the row's columns and ``prompt`` (its text)."""
        texts = self.tokenizer.batch_decode(
            [p[m.bool()] for p, m in zip(prompts, prompt_mask)], skip_special_tokens=True
        )
        return [
            {**{name: values[i] for name, values in (columns or {}).items()}, "prompt": text}
            for i, text in enumerate(texts)
        ]

    @property
    def max_response_length(self) -> int:
        """The longest response a rollout can hold: ``generation.max_new_tokens``, or an episode's token
        budget with an ``environment`` (the constant of ``seq_mean_token_sum_norm``)."""
        if self.environment.enabled:
            return self.environment.token_budget(self.generation.max_new_tokens)
        return self.generation.max_new_tokens


def set_engine_model(module: torch.nn.Module, model: torch.nn.Module | None) -> None:
    """Note ``model`` as the one ``module``'s engine was set up with: a plain attribute, not a submodule
    (``nn.Module.__setattr__`` would register it), so the actor's weights do not enter the state dict and
    every checkpoint a second time under ``_engine_model.*`` (a LoRA actor's frozen base weights included)."""
    object.__setattr__(module, "_engine_model", model)


def with_model_stops(settings: GenerationSettings, model: torch.nn.Module, tokenizer) -> GenerationSettings:
    """``settings`` with the model's own further stop tokens added to ``stop_token_ids``: those of its
    generation config besides the tokenizer's EOS (an instruct model's end of turn, e.g. Gemma's
    ``<end_of_turn>``), so every engine ends a response where the model's ``generate`` would (the pad token,
    never sampled, left out)."""
    known = {tokenizer.eos_token_id, tokenizer.pad_token_id, *settings.stop_token_ids}
    extra = [i for i in generation_stop_ids(model) if i not in known]
    return replace(settings, stop_token_ids=[*settings.stop_token_ids, *extra]) if extra else settings
