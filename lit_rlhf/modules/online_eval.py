"""Evaluation rollouts of the online modules: ``validate`` and ``test``, and validation during ``fit``.

A validation (test) step is an evaluation rollout on a batch of held-out prompts (the DataModule's
validation or test loader): generate with ``evaluation.generation`` over ``generation`` (sampled, or greedy
with ``evaluation.greedy``), score with the reward source (adjusted as in training) and the monitor, measure the KL to the reference,
and log means over the whole split as ``val/*`` (``test/*``) with a ``val/samples`` (``test/samples``)
table; a ``reward_fn`` list adds each function's raw score, ``val/reward/<name>`` (the mean of its finite
scores) and ``val/reward_nonfinite/<name>`` (their count). Nothing is updated.

When it runs during ``fit`` follows Lightning's own settings, one training batch being one rollout:
``check_val_every_n_epoch: null`` with ``val_check_interval: N`` evaluates every N rollouts (counted
across epochs); the defaults evaluate at the end of every pass over the prompts; a run stopped by
``max_rollouts`` evaluates once more at its end.

Evaluation leaves the training RNG stream as it was, so a run with evaluations samples the same
rollouts as one without, and resumes exactly: the global RNG is snapshot after each rollout and put back
after the validation loop (whose DataLoader iterator draws from it), generation runs on a forked RNG
seeded by (``rng_seed``, rank, batch index), and a checkpoint written during validation stores the
training stream held aside.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.batching import scatter_rows
from lit_rlhf.models import policy_forward
from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.metrics import row_weight
from lit_rlhf.modules.online_scoring import ensemble_spread
from lit_rlhf.modules.samples import log_text_table, logger_step

EVAL_METRICS = ("score", "monitor_score", "kl_ref", "response_length", "eos_rate", "entropy")


def rng_state() -> dict[str, Any]:
    """The global RNG states: torch's (CPU, and every CUDA device when there is one), and Python's and
    NumPy's, from which environments and reward functions may draw."""
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": random.getstate(),
        "numpy_rng": _plain_numpy_state(np.random.get_state()),  # plain values: a checkpoint loads weights-only
    }


def _plain_numpy_state(state: tuple) -> list:
    name, keys, position, has_gauss, cached = state
    return [name, keys.tolist(), int(position), int(has_gauss), float(cached)]


@contextmanager
def seeded_fork(key: tuple[int, ...], device: torch.device) -> Iterator[None]:
    """Torch's (CPU and ``device``'s CUDA), Python's and NumPy's global RNGs forked and seeded by ``key`` (ints,
    hashed alike in every process) for the block, then put back: draws inside are repeatable from ``key``,
    and the streams outside (training's, another rank's) are left as they were."""
    devices = [device.index or 0] if device.type == "cuda" else []
    held = random.getstate(), np.random.get_state()  # an environment's draws leave the outer streams alone
    try:
        with torch.random.fork_rng(devices=devices):
            seed = hash(key) & (2**63 - 1)
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            yield
    finally:
        random.setstate(held[0])
        np.random.set_state(held[1])


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back :func:`rng_state`'s states (Python's and NumPy's where the state has them: checkpoints of
    earlier versions hold torch's only)."""
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    if state.get("python_rng") is not None:
        random.setstate(state["python_rng"])
    if state.get("numpy_rng") is not None:
        name, keys, position, has_gauss, cached = state["numpy_rng"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


@internal_base
class OnlineEvaluation(LightningModule):
    """Mixin of OnlineRLModule (it relies on the base's ``expand_prompts``, ``expand_columns``, ``generate``,
    ``rewards``, ``monitor``, ``adjust_scores``, ``reference_logprobs``, ``micro_batches``,
    ``eval_generation``, ``evaluation``, ``rng_seed``, ``tokenizer``)."""

    _rng_after_rollout: dict[str, Any] | None = None
    _eval_samples: list[tuple[str, str, str]] = []

    # -- the training RNG stream around evaluations ---------------------------------------------------
    def training_rng_state(self) -> dict[str, Any]:
        """The RNG state training continues from: held aside during a validation inside ``fit``."""
        trainer = self._trainer
        if trainer is not None and trainer.validating and self._rng_after_rollout is not None:
            return self._rng_after_rollout
        return rng_state()

    @override
    def on_train_start(self) -> None:
        self._rng_after_rollout = None
        super().on_train_start()  # the other bases' hooks (e.g. the run-length schedules) run too

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._rng_after_rollout = rng_state()  # before a validation loop may draw from the global RNG
        super().on_train_batch_end(outputs, batch, batch_idx)

    @override
    def on_validation_end(self) -> None:
        if self.trainer.state.fn == "fit" and self._rng_after_rollout is not None:
            set_rng_state(self._rng_after_rollout)
            self._rng_after_rollout = None

    @contextmanager
    def evaluation_rng(self, batch_idx: int, dataloader_idx: int) -> Iterator[None]:
        """A forked global RNG seeded by (rng_seed, rank, loader, batch): evaluation draws are repeatable
        and the caller's RNG state is restored on exit."""
        with seeded_fork((self.rng_seed, self.global_rank, dataloader_idx, batch_idx), self.device):
            yield

    @torch.no_grad()
    def policy_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, P+T) sequences -> actor log-probs, reference log-probs and actor entropy, each (B, T), at
        ``temperature``, in the micro-batches of ``micro_batches`` (evaluation: no critic values)."""
        parts: tuple[list[torch.Tensor], ...] = ([], [], [])
        batches = self.micro_batches(attention_mask, T)
        for rows, columns, t in batches:
            ids, mask = input_ids[rows][:, columns], attention_mask[rows][:, columns]
            logprobs, entropy, _ = policy_forward(self.actor, ids, mask, t, temperature)
            for part, value in zip(parts, (logprobs, self.reference_logprobs(ids, mask, t, temperature), entropy)):
                part.append(value)
        rows = [b[0] for b in batches]
        return tuple(scatter_rows(part, rows, input_ids.shape[0], T) for part in parts)

    # -- Lightning's evaluation hooks -----------------------------------------------------------------
    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluation_step("val", batch, batch_idx, dataloader_idx)

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluation_step("test", batch, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        self.log_evaluation_samples("val")

    @override
    def on_test_epoch_end(self) -> None:
        self.log_evaluation_samples("test")

    @torch.no_grad()
    def evaluation_step(self, stage: str, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int) -> None:
        """One evaluation rollout on a batch of held-out prompts; logs ``{stage}/<metric>`` split means."""
        settings, greedy = self.eval_generation, self.evaluation.greedy
        # 1. Generate on a forked, seeded RNG (sampled, or greedy with evaluation.greedy), K = the
        #    evaluation's num_samples responses (or episodes, with an environment) per prompt.
        with self.evaluation_rng(batch_idx, dataloader_idx):
            sample = self.rollout_sample(batch, settings, greedy)
        prompts, input_ids, attention_mask, columns = sample.prompts, sample.input_ids, sample.attention_mask, sample.columns
        responses, response_mask, truncated = sample.responses.ids, sample.responses.mask, sample.responses.truncated
        loss_mask, T = sample.loss_mask, responses.shape[1]  # the policy's tokens
        batches = self.micro_batches(attention_mask, T)
        # 2. Score as in training (screened by scoring.on_nonfinite: non-finite scores stop the evaluation, or
        #    are left out of the means, a batch of none finite too), the monitor on the side, and the KL to
        #    the reference.
        raw, terms, scored = self.rewards.score_terms(input_ids, attention_mask, T, batches, columns)  # (B,), (B,)s
        if sample.env_scores is not None:
            raw = raw + sample.env_scores  # (B,)
        where = f"{stage} after rollout {self.rollouts_done}"
        keep = self.screen(raw, self.rewards, input_ids, attention_mask, T, counted=False, where=where, evaluation=True)
        scores = self.adjust_scores(raw, truncated)  # (B,)
        logprobs, ref_logprobs, entropy = self.policy_logprobs(input_ids, attention_mask, T, settings.temperature)
        kl = F.kl_penalty(logprobs, ref_logprobs, self.kl.estimator)  # (B, T)
        metrics = {
            "score": kept_mean(scores, keep),
            "kl_ref": F.masked_row_sum(kl, loss_mask).mean(),
            "response_length": response_mask.sum(1).float().mean(),
            "eos_rate": 1.0 - truncated.float().mean(),
            "entropy": F.masked_mean(entropy, loss_mask),
        }
        if sample.episodes is not None:
            metrics.update(sample.episodes.metrics())
        sizes = {"score": int(keep.sum())}
        for name, values in terms.items():  # a reward_fn list's functions, an ensemble's members
            finite, rows = torch.isfinite(values), scored.get(name, torch.ones_like(values, dtype=torch.bool))  # (B,)
            metrics[f"reward/{name}"], sizes[f"reward/{name}"] = kept_mean(values, finite), int(finite.sum())
            self.log(f"{stage}/reward_nonfinite/{name}", (~finite & rows).sum().float(), reduce_fx="sum",
                     sync_dist=True, on_step=False, on_epoch=True, batch_size=row_weight(responses.shape[0]))  # fmt: skip
        spread, count = ensemble_spread(terms, self.rewards.common_scale) if self.rewards.members is not None else (None, 0)
        if count:  # an ensemble: its members' spread over the responses they all scored finitely
            metrics["ensemble_std"], sizes["ensemble_std"] = spread, int(count)
        if self.monitor is not None:
            monitor = self.monitor.score(input_ids, attention_mask, T, batches, columns)  # (B,)
            monitor_keep = self.screen(
                monitor, self.monitor, input_ids, attention_mask, T, counted=False, where=where, evaluation=True
            )  # (B,)
            metrics["monitor_score"] = kept_mean(monitor, monitor_keep)
            sizes["monitor_score"] = int(monitor_keep.sum())
        # 3. Means over the split (weighted by rows, reduced across ranks); the first batch's samples.
        for name, value in metrics.items():
            self.log(
                f"{stage}/{name}", value.float(), prog_bar=name in ("score", "kl_ref"),
                batch_size=row_weight(sizes.get(name, responses.shape[0])), sync_dist=True, on_step=False, on_epoch=True,
            )  # fmt: skip
        if batch_idx == 0 and dataloader_idx == 0:
            self._eval_samples = self.sample_rows(prompts, responses, response_mask, scores)

    def sample_rows(self, prompts, responses, response_mask, scores) -> list[tuple[str, str, str]]:
        """The first ``num_log_samples`` (prompt, response, score) rows of a rollout, as text."""
        n = self.samples.rows
        texts = self.tokenizer.batch_decode(prompts[:n], skip_special_tokens=True)
        answers = self.rewards.decode_responses(responses[:n], response_mask[:n])
        return [(p, r, f"{s:.3f}") for p, r, s in zip(texts, answers, scores[:n].tolist())]

    def log_evaluation_samples(self, stage: str) -> None:
        """The ``{stage}/samples`` table, at the rollout index during ``fit`` (the step of that rollout's
        scalars and of this validation's), else at the step Lightning logs the scalars."""
        rows, self._eval_samples = self._eval_samples, []
        if not rows or self.trainer.sanity_checking:
            return
        fitting = self.trainer.state.fn == "fit"
        step = max(self.rollouts_done - 1, 0) if fitting else logger_step(self.trainer)
        log_text_table(self, f"{stage}/samples", ["prompt", "response", "score"], rows, step=step)


def kept_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The mean of the (B,) ``values`` where ``keep`` (0 when none is), NaN in dropped rows left out."""
    if bool(keep.all()):
        return values.mean()
    return torch.where(keep, values, 0.0).sum() / keep.sum().clamp(min=1)
