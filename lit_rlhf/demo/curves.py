"""Gold reward of the policy during a fit, against training seconds and KL: the demo's time to target.

:class:`GoldCurve` is a callback of any fit whose module trains a causal LM policy (PPO's ``actor``, or
another attribute): before the first training step, every ``every_n_steps`` steps (one step = one
rollout for the online algorithms) and after the last one, it samples a fixed subset of the held-out
evaluation prompts with the current policy (same prompts, same sampling seed at every point) and records
the gold reward, the grammatical rate and the KL to the reference against the seconds of training since
the fit started, evaluation time excluded. :func:`time_to_target` reads the first point whose gold lift
reaches the target within the KL budget.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

# The demo's targets: a gold lift of 2 SFT standard deviations within a KL budget of 4 nats per response.
TARGET_LIFT = 2.0
KL_BUDGET = 4.0


def gold_lift(summary: dict, base: dict) -> float | None:
    """``summary``'s gold mean above ``base``'s in standard deviations of ``base``'s gold (None when ``base``'s
    gold has no spread, e.g. the miniature SFT policy that writes no grammatical review)."""
    return (summary["gold_mean"] - base["gold_mean"]) / base["gold_std"] if base["gold_std"] else None


def lift(points: list[dict]) -> list[float | None]:
    """Gold lift of each point in standard deviations of the first point's gold (the initial policy's).

    All points are measured on the same prompts with the same sampling seed, so the difference to the
    first point is paired. None everywhere when the first point's gold has no spread.
    """
    return [gold_lift(p, points[0]) for p in points]


def target_point(
    points: list[dict], target_lift: float = TARGET_LIFT, kl_budget: float = KL_BUDGET
) -> dict | None:
    """The first point with a gold lift >= ``target_lift`` and a KL <= ``kl_budget``, or None.

    None too when the initial policy's gold has no spread (no lift is defined).
    """
    for point, point_lift in zip(points, lift(points)):
        if point_lift is not None and point_lift >= target_lift and point["kl_ref"] <= kl_budget:
            return point
    return None


def time_to_target(
    points: list[dict], target_lift: float = TARGET_LIFT, kl_budget: float = KL_BUDGET
) -> float | None:
    """Training seconds of the first point that reaches the target (:func:`target_point`), or None."""
    point = target_point(points, target_lift, kl_budget)
    return None if point is None else point["seconds"]


class GoldCurve(Callback):
    """Record the policy's gold reward on held-out prompts at regular intervals of a fit.

    Each point (written to ``output`` as soon as it is measured, so a failed fit keeps its curve) holds
    ``step`` (training steps done), ``seconds`` (wall seconds since the fit started minus the time spent
    in this callback), ``eval_seconds``, ``gold_mean``, ``gold_std``, ``kl_ref`` (mean over responses
    of the summed k1 log-ratio to the reference, as the demo's evaluation), ``grammatical_rate`` and
    ``n_prompts``; the same values go to the trainer's logger as ``heldout/*``. Sampling uses its own
    seeded random stream: the fit's random state, hence its result, does not depend on this callback.

    Args:
        prompts_path: jsonl file with a ``prompt`` field (the demo's ``prompts_eval.jsonl``).
        reference: exported folder of the reference policy (the SFT export), also the tokenizer.
        output: json file of the curve.
        every_n_steps: training steps between two points.
        num_prompts: points are measured on the first this many prompts of the file.
        policy_attribute: attribute of the LightningModule holding the trained causal LM.
        max_new_tokens: response length limit of the evaluation's sampling.
        temperature: sampling temperature (the demo's rollout temperature, also used for the KL).
        batch_size: prompts per generation batch.
        seed: sampling seed, the same at every point.
    """

    def __init__(
        self,
        prompts_path: str,
        reference: str,
        output: str,
        every_n_steps: int = 5,
        num_prompts: int = 256,
        policy_attribute: str = "actor",
        max_new_tokens: int = 24,
        temperature: float = 0.8,
        batch_size: int = 256,
        seed: int = 0,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"GoldCurve: every_n_steps must be >= 1, got {every_n_steps}")
        if num_prompts < 1:
            raise ValueError(f"GoldCurve: num_prompts must be >= 1, got {num_prompts}")
        from lit_rlhf.rollout import GenerationSettings

        self.prompts_path, self.reference_dir, self.output = prompts_path, reference, Path(output)
        self.every_n_steps, self.num_prompts, self.policy_attribute = every_n_steps, num_prompts, policy_attribute
        self.generation = GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature)
        self.batch_size, self.seed = batch_size, seed
        self.points: list[dict] = []

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from transformers import AutoModelForCausalLM

        from lit_rlhf.demo.evaluate import read_jsonl
        from lit_rlhf.models import load_tokenizer

        if not hasattr(pl_module, self.policy_attribute):
            raise AttributeError(
                f"GoldCurve: {type(pl_module).__name__} has no attribute {self.policy_attribute!r}"
                " (set policy_attribute to the attribute holding the trained policy)"
            )
        prompts = [row["prompt"] for row in read_jsonl(self.prompts_path)]
        if len(prompts) < self.num_prompts:
            raise ValueError(
                f"GoldCurve: {self.prompts_path} has {len(prompts)} prompts, num_prompts={self.num_prompts}"
            )
        self.prompts = prompts[: self.num_prompts]
        self.tokenizer = load_tokenizer(self.reference_dir, padding_side="left")
        self.reference = AutoModelForCausalLM.from_pretrained(self.reference_dir).eval()
        self.points, self.steps, self.eval_seconds = [], 0, 0.0
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.start = time.perf_counter()
        self._measure(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self.steps += 1
        if self.steps % self.every_n_steps == 0:
            self._measure(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.points and self.points[-1]["step"] != self.steps:
            self._measure(trainer, pl_module)
        self.reference = None

    def _measure(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lit_rlhf.demo.evaluate import sample_responses

        eval_start = time.perf_counter()
        policy = getattr(pl_module, self.policy_attribute)
        was_training = policy.training
        policy.eval()
        rows = sample_responses(
            policy, self.reference, self.tokenizer, self.prompts, self.generation,
            batch_size=self.batch_size, seed=self.seed,
        )  # fmt: skip
        policy.train(was_training)
        gold = [r["gold"] for r in rows]
        point = {
            "step": self.steps,
            "seconds": eval_start - self.start - self.eval_seconds,
            "gold_mean": statistics.fmean(gold),
            "gold_std": statistics.pstdev(gold),
            "kl_ref": statistics.fmean(r["kl_ref"] for r in rows),
            "grammatical_rate": statistics.fmean(float(r["grammatical"]) for r in rows),
            "n_prompts": len(rows),
        }
        point["eval_seconds"] = time.perf_counter() - eval_start
        self.eval_seconds += point["eval_seconds"]
        self.points.append(point)
        self.output.write_text(json.dumps({"points": self.points}, indent=1) + "\n")
        if trainer.logger is not None:
            keys = ("gold_mean", "kl_ref", "grammatical_rate", "seconds")
            trainer.logger.log_metrics({f"heldout/{k}": point[k] for k in keys}, step=self.steps)


def overoptimization_shape(curves: dict[str, list[float]]) -> dict:
    """The over-optimisation picture of Gao et al. (2022, arXiv:2210.10760) read from windowed reward curves.

    Args:
        curves: ``{"kl": [...], "proxy": [...], "gold": [...]}`` per window in training order (as
            ``report.reward_curves`` returns them), at least one window.

    Returns:
        ``proxy_rise`` (last proxy minus first), ``proxy_largest_drop`` (the largest fall of the proxy
        between two consecutive windows, 0 when it never falls), ``gold_peak`` and ``gold_peak_kl`` (the
        window of the highest gold and its KL), ``gold_final``, ``gold_drop_from_peak`` (peak minus final gold,
        >= 0) and ``peaks_and_falls``: the proxy ends higher than it started while the gold peaks at a
        window before the last and ends below that peak. Rewards relative to the first window.
    """
    proxy = [v - curves["proxy"][0] for v in curves["proxy"]]
    gold = [v - curves["gold"][0] for v in curves["gold"]]
    peak = max(range(len(gold)), key=gold.__getitem__)
    drops = [before - after for before, after in zip(proxy, proxy[1:])]
    return {
        "proxy_rise": proxy[-1],
        "proxy_largest_drop": max([0.0, *drops]),
        "gold_peak": gold[peak],
        "gold_peak_kl": curves["kl"][peak],
        "gold_final": gold[-1],
        "gold_drop_from_peak": gold[peak] - gold[-1],
        "peaks_and_falls": proxy[-1] > 0 and peak < len(gold) - 1 and gold[-1] < gold[peak],
    }
