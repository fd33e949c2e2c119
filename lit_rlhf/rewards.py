"""Where sequence scores come from: a reward model, a reward-model ensemble, a ``module:function`` rule, or
weighted rule functions.

Used by every online-RL module, for the optimised reward and for the monitor reward that is only logged.
``reward_fn`` is one ``package.module:function`` or a list of :class:`RewardTerm` (``{fn, weight, name,
kwargs}``): the score is then the weighted sum of the functions' scores
(:func:`lit_rlhf.functional.weighted_reward_sum`) and each function's raw score is returned by name, for the
modules to log. Each function may take either calling form of :mod:`lit_rlhf.reward_fns`. A reward-model
ensemble (:mod:`lit_rlhf.ensembles`) scores with every member and aggregates; each member's raw score is
returned by name (``member_<k>``) the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lit_rlhf import functional as F
from lit_rlhf.batching import MicroBatch, scatter_rows
from lit_rlhf.ensembles import RewardEnsemble, check_member_tokenizers
from lit_rlhf.models import (
    ModelSpec,
    build_score_model,
    chunked,
    frozen_copy,
    load_tokenizer,
    reward_model_scores,
    sequence_scores_and_features,
)
from lit_rlhf.models.folders import adapter_config
from lit_rlhf.posterior import PosteriorReward, read_posterior
from lit_rlhf.reward_fns import (
    RewardFn,
    call_reward_fn,
    import_reward_fn,
    none_rows,
    reward_call,
    reward_scores,
)
from lit_rlhf.settings import Settings

__all__ = ["RewardFn", "RewardSource", "RewardTerm", "import_reward_fn", "reward_terms"]

METRIC_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass
class RewardTerm(Settings):
    """One function of a ``reward_fn`` list; the sequence score is the weighted sum of the list's functions.

    Attributes:
        fn: ``package.module:function``, in either calling form of :mod:`lit_rlhf.reward_fns`.
        weight: its weight in the sum (a finite number of any sign; 0 = only logged).
        name: the name its raw score is logged under (``rollout/reward/<name>``, ``val/reward/<name>``);
            None = the function's name (after the colon).
        kwargs: fixed keyword arguments of every call (e.g. ``{max_length: 64, cache_length: 16}``).
    """

    group: ClassVar[str] = "reward_fn"

    fn: str
    weight: float = 1.0
    name: str | None = None
    kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        ok = isinstance(self.fn, str) and bool(self.fn.partition(":")[0]) and bool(self.fn.partition(":")[2])
        self.require("fn", ok, "'package.module:function'")
        ok = isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool)
        self.require("weight", ok, "a number")
        self.weight = float(self.weight)
        self.require_finite("weight")
        if self.name is None:
            self.name = self.fn.partition(":")[2]
        ok = isinstance(self.name, str) and METRIC_NAME.fullmatch(self.name) is not None
        self.require("name", ok, "letters, digits, '_', '.' or '-' (it becomes a metric name)")
        kwargs = self.kwargs
        ok = kwargs is None or (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs))
        self.require("kwargs", ok, "a mapping of keyword arguments or None")


def reward_terms(value: Any, argument: str = "reward_fn") -> list[RewardTerm]:
    """The checked terms of a ``reward_fn`` list (RewardTerms, dicts of their fields, or ``module:function``
    strings of weight 1); errors name the entry."""
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(
            f"{argument}: expected 'package.module:function' or a non-empty list of {{fn, weight}} entries, "
            f"got {value!r:.200}"
        )
    terms = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):  # a function of weight 1
            entry = {"fn": entry}
        if isinstance(entry, Mapping) and "fn" not in entry:
            raise TypeError(
                f"{argument}[{i}]: missing `fn` ('package.module:function'), got {dict(entry)!r:.200}"
            )
        try:
            terms.append(RewardTerm.coerce(entry, f"{argument}[{i}]"))
        except (TypeError, ValueError) as err:
            message = str(err).replace(f"{RewardTerm.group}.", f"{argument}[{i}].", 1)
            message = message if message.startswith(argument) else f"{argument}[{i}]: {message}"
            raise type(err)(message) from err
    names = [t.name for t in terms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"{argument}: the names {repeated} are used more than once; give each entry its own `name`"
        )
    return terms


class RewardSource(torch.nn.Module):
    """Sequence scores from a reward model (scalar head at the last real token), an ensemble of them, or
    Python functions.

    A reward model that shares the actor's tokenizer scores the token ids directly; one with another
    vocabulary gets the decoded text re-tokenised with its own tokenizer (special tokens, such as the actor's
    chat markers, left out; its EOS appended where the response ended with a stop token, not to a response
    cut at ``max_new_tokens``). Functions get the decoded prompts
    and responses, the responses' token ids and the prompt rows' other columns (``columns``). An ensemble's
    members (``members``, frozen; one tokenizer for all) each score every response; the score is their
    aggregate (``functional.aggregate_ensemble``). Under FSDP an ensemble's members are not sharded (each
    rank holds them whole); a single reward model is (``rewards.model``).

    Args:
        reward_model: spec of a reward model (e.g. an exported RewardModelModule folder), a
            :class:`~lit_rlhf.ensembles.RewardEnsemble`, or None.
        reward_fn: ``package.module:function``, a list of :class:`RewardTerm` (or dicts of their fields, or
            ``module:function`` strings of weight 1) whose weighted sum is the score, or None.
        tokenizer: the actor's tokenizer.
        argument: the config argument that named the scorer (``reward_fn``, ``monitor_reward_fn``), for
            error messages.
    """

    def __init__(
        self, reward_model: Any, reward_fn: str | Sequence[RewardTerm | dict | str] | None, tokenizer: Any,
        argument: str = "reward_fn",
    ) -> None:  # fmt: skip
        super().__init__()
        self.tokenizer = tokenizer
        self.fn, self.terms = None, []
        model_name = getattr(reward_model, "name_or_path", None) or "(from config)"
        self.description = f"reward_model {model_name}" if reward_model is not None else "the environment's rewards"
        if isinstance(reward_fn, str):
            self.fn = import_reward_fn(reward_fn, argument)
            self.description = f"{argument} {reward_fn}"
            self.call = reward_call(self.fn, self.description)
        elif reward_fn is not None:
            self.terms = reward_terms(reward_fn, argument)
            self.term_fns = [import_reward_fn(t.fn, f"{argument}[{i}]") for i, t in enumerate(self.terms)]
            self.term_names = [f"{argument}[{i}] {t.name} ({t.fn})" for i, t in enumerate(self.terms)]
            self.calls = [
                reward_call(fn, name, term.kwargs)
                for fn, name, term in zip(self.term_fns, self.term_names, self.terms)
            ]
            self.weights = torch.tensor([t.weight for t in self.terms], dtype=torch.float32)
            self.description = f"{argument} [{', '.join(f'{t.name} x {t.weight:g}' for t in self.terms)}]"
        # ``reward_fn`` as plain values, as the hyper-parameters store it
        self.config_value = [t.as_dict() for t in self.terms] if self.terms else reward_fn
        self.model, self.members, self.ensemble, self.posterior = None, None, None, None
        self.model_tokenizer = None
        # the spec a PPO critic starts from: the reward model's, or an ensemble's first member's
        self.model_spec: ModelSpec | None = None
        if isinstance(reward_model, RewardEnsemble):
            model_tokenizer = self.build_ensemble(reward_model)
        elif isinstance(reward_model, PosteriorReward):
            model_tokenizer = self.build_posterior(reward_model)
        elif reward_model is not None:
            check_trained_head(reward_model, argument_of(reward_model, "reward_model"))
            model_tokenizer = load_tokenizer(
                reward_model.tokenizer or reward_model.name_or_path, trust_remote_code=reward_model.trust_remote_code
            )
            self.model = frozen_copy(build_score_model(reward_model, model_tokenizer))
            self.model_spec = reward_model
        if reward_model is not None and model_tokenizer.get_vocab() != tokenizer.get_vocab():
            self.model_tokenizer = model_tokenizer

    def build_ensemble(self, ensemble: RewardEnsemble) -> Any:
        """Build the ensemble's frozen members (``members``); returns their (one) tokenizer."""
        self.ensemble = ensemble.resolve()
        members = self.ensemble.members
        for k, member in enumerate(members):
            check_trained_head(member, f"reward_model ensemble member {k}")
        tokenizers = [load_tokenizer(m.tokenizer_name_or_path, trust_remote_code=m.trust_remote_code) for m in members]
        check_member_tokenizers(tokenizers, members)
        self.members = torch.nn.ModuleList(
            frozen_copy(build_score_model(m, tok)) for m, tok in zip(members, tokenizers)
        )
        self.model_spec = members[0]
        coef = "" if self.ensemble.aggregation in ("mean", "min") else f", coef {self.ensemble.coef:g}"
        scale = ", standardised members" if self.ensemble.stats is not None else ""
        self.description = (
            f"reward_model ensemble of {len(members)} ({self.ensemble.aggregation}{coef}{scale}) {self.ensemble.source}"
        )
        return tokenizers[0]

    def build_posterior(self, settings: PosteriorReward) -> Any:
        """Build the posterior's frozen reward model (``model``) and read its covariance; returns its tokenizer."""
        self.posterior = read_posterior(settings.posterior)
        self.posterior_coef = settings.coef
        spec = self.posterior.reward_model
        check_trained_head(spec, f"reward_model.posterior {settings.posterior}'s reward model")
        model_tokenizer = load_tokenizer(spec.name_or_path)
        self.model = frozen_copy(build_score_model(spec, model_tokenizer))
        self.posterior.check_model(self.model)
        self.model_spec = spec
        self.description = f"reward_model {spec.name_or_path} less {settings.coef:g} x its last-layer spread"
        return model_tokenizer

    def common_scale(self, scores: torch.Tensor) -> torch.Tensor:
        """(K, B) member scores -> the same on one scale (``functional.standardize_members``) where the ensemble
        has reference statistics and normalises; else unchanged."""
        if self.ensemble is None or self.ensemble.stats is None:
            return scores
        means, stds = torch.tensor(self.ensemble.stats, dtype=torch.float32).T  # (K,), (K,)
        return F.standardize_members(scores, means, stds)  # (K, B)

    @property
    def part_names(self) -> list[str]:
        """The names of the raw scores :meth:`score_terms` returns beside the score: each function of a
        ``reward_fn`` list, each member of an ensemble (``member_<k>``), or a posterior's raw ``score`` and its
        ``uncertainty`` (the spread it takes ``coef`` of); empty otherwise."""
        if self.posterior is not None:
            return ["score", "uncertainty"]
        if self.members is not None:
            return [f"member_{k}" for k in range(len(self.members))]
        return [term.name for term in self.terms]

    def decode_responses(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        return [
            self.tokenizer.decode(row[mask], skip_special_tokens=True)
            for row, mask in zip(responses, response_mask)
        ]

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        chunk_size: int | Sequence[MicroBatch],
        columns: Mapping[str, list] | None = None,
    ) -> torch.Tensor:
        """(B, P+T) prompt+response sequences -> (B,) float32 scores (see :meth:`score_terms`)."""
        return self.score_terms(input_ids, attention_mask, response_length, chunk_size, columns)[0]

    @torch.no_grad()
    def score_terms(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        chunk_size: int | Sequence[MicroBatch],
        columns: Mapping[str, list] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(B, P+T) prompt+response sequences -> (B,) float32 scores; each part's (B,) raw scores by name
        (:attr:`part_names`: each function of a ``reward_fn`` list, each member of an ensemble; else empty);
        and each part's (B,) bool mask of the rows it scored: False where a TRL-form function of a
        ``reward_fn`` list returned None (it does not score that row, e.g. another task's: its raw score is
        NaN there, and the total is the weighted sum of the functions that scored the row, NaN where none
        did, ``functional.weighted_reward_sum``); every row elsewhere.

        ``chunk_size``: rows per reward-model forward, or the (rows, columns, t) micro-batches of
        ``lit_rlhf.batching.rollout_micro_batches`` (length-bucketed and trimmed). ``columns``: the prompt
        rows' other columns for the functions, each a list of B values (a prompt's K rows repeated).
        """
        if self.members is not None:
            scores = self.model_scores(input_ids, attention_mask, response_length, chunk_size)  # (K, B)
            total = F.aggregate_ensemble(self.common_scale(scores), self.ensemble.aggregation, self.ensemble.coef)
            parts = dict(zip(self.part_names, scores))  # the members' raw scores
            return total, parts, {name: torch.ones_like(raw, dtype=torch.bool) for name, raw in parts.items()}
        if self.posterior is not None:
            raw, spread = self.model_scores(input_ids, attention_mask, response_length, chunk_size)  # (B,), (B,)
            total = raw - self.posterior_coef * spread  # (B,)
            parts = {"score": raw, "uncertainty": spread}
            return total, parts, {name: torch.ones_like(part, dtype=torch.bool) for name, part in parts.items()}
        if self.fn is None and not self.terms and self.model is None:  # an environment's rewards only
            return torch.zeros(input_ids.shape[0], device=input_ids.device), {}, {}
        if self.fn is None and not self.terms:
            return self.model_scores(input_ids, attention_mask, response_length, chunk_size)[0], {}, {}
        n, device = input_ids.shape[0], input_ids.device
        for key, values in (columns or {}).items():
            if len(values) != n:
                raise ValueError(
                    f"{self.description}: column {key!r} has {len(values)} values for {n} responses"
                )
        response_mask = attention_mask[:, -response_length:].bool()  # (B, T)
        texts = (
            self.tokenizer.batch_decode(input_ids[:, :-response_length], skip_special_tokens=True),
            self.decode_responses(input_ids[:, -response_length:], response_mask),
            [row[mask].tolist() for row, mask in zip(input_ids[:, -response_length:], response_mask)],
        )
        if self.fn is not None:  # a lone function's None is NaN: nothing scored the row
            out = call_reward_fn(self.fn, self.call, self.description, *texts, columns)
            return reward_scores(self.description, out, n, device, none_as_nan=self.call.form == "trl"), {}, {}
        parts, scored = {}, {}
        for term, fn, call, name in zip(self.terms, self.term_fns, self.calls, self.term_names):
            out = call_reward_fn(fn, call, name, *texts, columns, term.kwargs)
            parts[term.name] = reward_scores(name, out, n, device, none_as_nan=call.form == "trl")  # (B,)
            absent = none_rows(out) if call.form == "trl" else [False] * n
            scored[term.name] = ~torch.tensor(absent, dtype=torch.bool, device=device)  # (B,)
        total = F.weighted_reward_sum(
            torch.stack(list(parts.values())), self.weights.to(device), torch.stack(list(scored.values()))
        )  # (B,)
        return total, parts, scored

    def model_scores(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        chunk_size: int | Sequence[MicroBatch],
    ) -> torch.Tensor:
        """(M, B) float32 scores of the M reward models (one, or an ensemble's members; a posterior's reward model
        and its spread, :meth:`batch_scores`), in micro-batches (see :meth:`score_terms`)."""
        if self.model_tokenizer is not None:
            response_ids, response_mask = input_ids[:, -response_length:], attention_mask[:, -response_length:].bool()
            prompts = self.tokenizer.batch_decode(input_ids[:, :-response_length], skip_special_tokens=True)
            responses = self.decode_responses(response_ids, response_mask)
            # the reward model's EOS only where the response ended (its last token a stop token, e.g. EOS): a
            # response cut at max_new_tokens is scored unfinished, as the actor's own tokens would be
            ended = _ends_with_special(response_ids, response_mask, self.tokenizer.all_special_ids)
            eos = self.model_tokenizer.eos_token
            texts = [p + r + (eos if end else "") for p, r, end in zip(prompts, responses, ended)]
            enc = self.model_tokenizer(texts, return_tensors="pt", padding=True).to(input_ids.device)
            input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        n = input_ids.shape[0]
        if isinstance(chunk_size, int):
            batches = [(rows, slice(None)) for rows in chunked(n, chunk_size)]
        else:  # re-tokenised rows have their own columns
            retokenised = self.model_tokenizer is not None
            batches = [(rows, slice(None) if retokenised else columns) for rows, columns, _ in chunk_size]
        parts = [self.batch_scores(input_ids[rows][:, columns], attention_mask[rows][:, columns]) for rows, columns in batches]
        return scatter_rows(parts, [rows for rows, _ in batches], n).T  # (M, B)

    def batch_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(b, L) sequences -> (b, M): each reward model's score; for a posterior, the score and its spread
        (:meth:`~lit_rlhf.posterior.Posterior.spread`) from one forward."""
        if self.posterior is not None:
            scores, features = sequence_scores_and_features(self.model, input_ids, attention_mask)  # (b,), (b, H)
            return torch.stack([scores, self.posterior.spread(features)], dim=1)  # (b, 2)
        models = [self.model] if self.members is None else list(self.members)
        return torch.stack([reward_model_scores(m, input_ids, attention_mask) for m in models], dim=1)  # (b, M)


def _ends_with_special(ids: torch.Tensor, mask: torch.Tensor, special: list[int]) -> list[bool]:
    """For (B, T) right-padded responses: whether each one's last real token is a special token (a stop
    token such as EOS)."""
    last = (mask.long().sum(dim=1) - 1).clamp(min=0)  # (B,)
    tokens = ids.gather(1, last[:, None]).squeeze(1)  # (B,)
    is_special = torch.isin(tokens, torch.tensor(special, dtype=ids.dtype, device=ids.device))
    return (is_special & mask.any(dim=1)).tolist()


def argument_of(spec: ModelSpec, name: str) -> str:
    return f"{name} {spec.name_or_path!r}" if spec.name_or_path else name


def check_trained_head(spec: ModelSpec, where: str) -> None:
    """Refuse a frozen reward model loaded from a folder or hub id whose model is no sequence classifier (e.g.
    an SFT export): its score head would be new and random, so every reward would be noise. (A critic may
    start so; an inline ``config`` is random by choice.)"""
    if spec.name_or_path is None:
        return
    from transformers import AutoConfig

    adapter = adapter_config(spec.name_or_path)
    if adapter is not None:  # a peft adapter: a reward model's is a sequence classifier's (its head saved with it)
        task = adapter.get("task_type")
        if task not in (None, "SEQ_CLS"):
            raise ValueError(
                f"{where} is a peft adapter of task {task}, not a reward model's (SEQ_CLS): its score head would be"
                " new and random (every reward noise). Give a reward model's adapter or checkpoint"
            )
        return
    try:
        config = AutoConfig.from_pretrained(spec.name_or_path, trust_remote_code=spec.trust_remote_code)
    except Exception:  # unreadable here: loading the model names the problem
        return
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith(("ForSequenceClassification", "RewardModel")) for a in architectures):
        raise ValueError(
            f"{where} is a {', '.join(architectures)}, not a reward model: its score head would be new and random "
            "(every reward noise). Train one (RewardModelModule, configs/rm_tiny.yaml) or give an "
            "AutoModelForSequenceClassification checkpoint"
        )
