"""Building blocks of :class:`~lit_rlhf.modules.ppo.PPOModule` that are not the algorithm itself:
the forwards that read per-response-token quantities, the reward sources, and metric bookkeeping."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torchmetrics import MaxMetric, MeanMetric

from lit_rlhf.functional import entropy_from_logits, logprobs_from_logits, masked_moments, whiten_from_moments
from lit_rlhf.models import causal_lm_logits_and_hidden, sequence_scores, token_values

RewardFn = Callable[[list[str], list[str]], list[float]]


def import_reward_fn(path: str) -> RewardFn:
    """Import ``package.module:function``, a callable (prompts, responses) -> list of float scores."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_fn must look like 'package.module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward_fn {path!r} could not be imported: {err}") from err
    if not callable(fn):
        raise ValueError(f"reward_fn {path!r} is not callable")
    return fn


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0: PPO's ratio must be exactly 1 before the first update, and
    the rollout and update forwards must describe the same policy (standard practice, e.g. TRL)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        if config is not None and hasattr(config, name):
            setattr(config, name, 0.0)


def policy_forward(
    actor: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    value_head: torch.nn.Module | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy of the response tokens, and shared-backbone values, from one forward.

    Args:
        actor: causal LM. input_ids, attention_mask: (B, P+T). response_length: T.
        temperature: the sampling temperature (logits are divided by it, as during generation).
        value_head: the critic's head when it shares the actor's backbone, else None.
        entropy_grad: build the entropy's autograd graph (only needed when it is in the loss).

    Returns:
        logprobs (B, T) float32, entropy (B, T) float32, values (B, T) float32 or None.
    """
    # Position P-1+t predicts response token t: only the last T+1 positions need the LM head.
    logits, hidden = causal_lm_logits_and_hidden(
        actor, input_ids, attention_mask, logits_to_keep=response_length + 1
    )
    logits = logits[:, -response_length - 1 : -1]
    labels = input_ids[:, -response_length:]
    logprobs = logprobs_from_logits(logits, labels, temperature=temperature)
    # With ent_coef = 0 the entropy is only logged: without a graph its float32 softmax is neither kept
    # nor recomputed in backward.
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)
    values = None
    if value_head is not None:
        values = value_head(hidden[:, -response_length - 1 : -1])
    return logprobs, entropy, values


def critic_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """(B, P+T) sequences -> (B, T) float32 values V(s_t), s_t = prompt + response[:t]."""
    return token_values(critic, input_ids, attention_mask)[:, -response_length - 1 : -1]


def reward_model_scores(
    reward_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """(B, P+T) sequences -> (B,) float32 scores at the last real token (the EOS when present)."""
    return sequence_scores(reward_model, input_ids, attention_mask)


def chunked(n: int, size: int) -> Iterable[slice]:
    """Row slices of at most ``size`` covering ``range(n)`` (bounds the memory of no-grad forwards)."""
    return (slice(start, min(start + size, n)) for start in range(0, n, size))


class MetricGroup(torch.nn.Module):
    """Named running means (and maxima for ``*_max``) as torchmetrics, so values reduce across ranks."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self.metrics = torch.nn.ModuleDict(
            {n.replace("/", "__"): MaxMetric() if n.endswith("_max") else MeanMetric() for n in names}
        )

    def update(self, values: dict[str, torch.Tensor | float], weight: float = 1.0) -> None:
        for name, value in values.items():
            metric = self.metrics[name.replace("/", "__")]
            value = torch.as_tensor(value, dtype=torch.float32).detach()
            if isinstance(metric, MeanMetric):
                metric.update(value, weight)
            else:
                metric.update(value)

    def compute_and_reset(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, metric in self.metrics.items():
            if metric.update_called:
                out[key.replace("__", "/")] = metric.compute()
            metric.reset()
        return out


ROLLOUT_METRICS = (
    "score", "reward", "kl_ref", "response_length", "eos_rate", "entropy",
    "explained_variance", "advantages_mean", "advantages_std", "returns_mean", "values_mean", "monitor_score",
)  # fmt: skip
PPO_METRICS = (
    "policy_loss", "value_loss", "entropy", "approx_kl", "policy_kl", "clipfrac", "value_clipfrac",
    "ratio_mean", "ratio_max", "skipped_minibatches",
)  # fmt: skip


def accumulate_stats(
    total: dict[str, torch.Tensor], part: dict[str, torch.Tensor], weight: torch.Tensor
) -> None:
    """Fold a micro-batch's loss stats into the minibatch's: token-weighted means, and the max of maxima."""
    for key, value in part.items():
        if key.endswith("_max"):
            total[key] = torch.maximum(total[key], value) if key in total else value
        else:
            total[key] = total.get(key, 0.0) + value * weight


class RewardSource(torch.nn.Module):
    """Sequence scores from a reward model (scalar head at the last real token) or a Python function.

    A reward model that shares the actor's tokenizer scores the token ids directly; one with another
    vocabulary gets the decoded text re-tokenised with its own tokenizer.

    Args:
        reward_model: spec of a reward model (e.g. an exported RewardModelModule folder), or None.
        reward_fn: ``package.module:function`` (prompts, responses) -> scores, or None.
        tokenizer: the actor's tokenizer.
    """

    def __init__(self, reward_model: Any, reward_fn: str | None, tokenizer: Any) -> None:
        super().__init__()
        from lit_rlhf.models import build_score_model, frozen_copy, load_tokenizer

        self.tokenizer = tokenizer
        self.fn = import_reward_fn(reward_fn) if reward_fn is not None else None
        self.model = None
        self.model_tokenizer = None
        if reward_model is not None:
            model_tokenizer = load_tokenizer(reward_model.tokenizer or reward_model.name_or_path)
            self.model = frozen_copy(build_score_model(reward_model, model_tokenizer))
            if model_tokenizer.get_vocab() != tokenizer.get_vocab():
                self.model_tokenizer = model_tokenizer

    def decode_responses(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        return [
            self.tokenizer.decode(row[mask], skip_special_tokens=True)
            for row, mask in zip(responses, response_mask)
        ]

    @torch.no_grad()
    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, chunk_size: int
    ) -> torch.Tensor:
        """(B, P+T) prompt+response sequences -> (B,) float32 scores."""
        if self.fn is not None or self.model_tokenizer is not None:
            prompts = self.tokenizer.batch_decode(input_ids[:, :-response_length], skip_special_tokens=True)
            responses = self.decode_responses(
                input_ids[:, -response_length:], attention_mask[:, -response_length:].bool()
            )
        if self.fn is not None:
            scores = self.fn(prompts, responses)
            if len(scores) != len(prompts):
                raise ValueError(f"reward_fn returned {len(scores)} scores for {len(prompts)} responses")
            return torch.tensor([float(s) for s in scores], dtype=torch.float32, device=input_ids.device)
        if self.model_tokenizer is not None:
            texts = [p + r + self.model_tokenizer.eos_token for p, r in zip(prompts, responses)]
            enc = self.model_tokenizer(texts, return_tensors="pt", padding=True).to(input_ids.device)
            input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        return torch.cat(
            [
                reward_model_scores(self.model, input_ids[rows], attention_mask[rows])
                for rows in chunked(input_ids.shape[0], chunk_size)
            ]
        )


def masked_row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,) sum over each row's real tokens."""
    return torch.where(mask, x, 0.0).sum(dim=1)


def whiten_across_ranks(
    strategy: Any, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """``masked_whiten`` of this rank's rows with the mean and variance of every data-parallel rank's rows.

    One all-reduce of three numbers (count, sum, sum of squares), so a run on N ranks whitens like one
    process holding the N rollouts; ``strategy.reduce`` is the identity on a single device.
    """
    moments = strategy.reduce(masked_moments(x, mask), reduce_op="sum")
    return whiten_from_moments(x, mask, moments, shift_mean)


def validate_ppo_args(hp: Any) -> None:
    """Check PPOModule's arguments early, with messages naming the argument."""
    if (hp.reward_model is None) == (hp.reward_fn is None):
        raise ValueError(
            "PPOModule: give exactly one of reward_model (a ModelSpec) or reward_fn ('module:function')"
        )
    if hp.share_critic_backbone and hp.critic is not None:
        raise ValueError(
            "PPOModule: share_critic_backbone=True uses a value head on the actor; do not also set critic"
        )
    positive = (
        "ppo_epochs",
        "num_minibatches",
        "forward_batch_size",
        "clip_coef",
        "init_beta",
        "beta_target",
    )
    for name in positive:
        if getattr(hp, name) <= 0:
            raise ValueError(f"PPOModule: {name} must be > 0, got {getattr(hp, name)}")
    for name in ("clip_coef_value", "vf_coef", "ent_coef", "kl_coef"):
        if getattr(hp, name) < 0:
            raise ValueError(f"PPOModule: {name} must be >= 0, got {getattr(hp, name)}")
    for name in ("gamma", "gae_lambda"):
        if not 0.0 <= getattr(hp, name) <= 1.0:
            raise ValueError(f"PPOModule: {name} must be in [0, 1], got {getattr(hp, name)}")
    if hp.max_rollouts is not None and hp.max_rollouts < 1:
        raise ValueError(f"PPOModule: max_rollouts must be >= 1 or None, got {hp.max_rollouts}")
