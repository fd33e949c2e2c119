"""Evaluation of the demo's exported models against the gold reward of :mod:`lit_rlhf.demo.world`.

Policies are evaluated on held-out prompts (``prompts_eval.jsonl``): one sampled response per prompt
under the PPO sampling settings, then per response its gold reward, grammaticality, proxy score (the
reward model at the last real token, as in PPO) and its sequence KL to the reference policy
(sum over response tokens of log pi - log pi_ref on the sampled tokens: the k1 estimate PPO logs as
``rollout/kl_ref``). The reward model is evaluated on held-out preference pairs against the gold ordering
(:func:`lit_rlhf.demo.assets.gold_accuracy`), not against the noisy Bradley-Terry labels it was trained on.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from typing_extensions import override

from lit_rlhf.data import PreferenceCollator
from lit_rlhf.demo import world
from lit_rlhf.demo.assets import gold_accuracy
from lit_rlhf.engines import HFEngine, RolloutEngine
from lit_rlhf.functional import masked_row_sum
from lit_rlhf.models import chunked, load_tokenizer, policy_forward, sequence_scores
from lit_rlhf.rollout import GenerationSettings

# How every policy is sampled in the evaluation (and in the gold curves): the rollout settings of the
# online configs, which must match it so that their KL figures measure the same distributions.
EVAL_TEMPERATURE = 0.8
EVAL_MAX_NEW_TOKENS = 24


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f]


def _encode_pairs(tokenizer, rows: Sequence[dict]) -> list[dict]:
    """Token ids of prompt, chosen + EOS and rejected + EOS, as the PreferenceDataModule builds them."""
    eos = [tokenizer.eos_token_id]
    prompts = tokenizer([r["prompt"] for r in rows]).input_ids
    chosen = tokenizer([r["chosen"] for r in rows], add_special_tokens=False).input_ids
    rejected = tokenizer([r["rejected"] for r in rows], add_special_tokens=False).input_ids
    return [
        {"prompt_input_ids": p, "chosen_input_ids": c + eos, "rejected_input_ids": r + eos}
        for p, c, r in zip(prompts, chosen, rejected)
    ]


@torch.no_grad()
def pair_scores(model: torch.nn.Module, tokenizer, rows: Sequence[dict], batch_size: int = 256):
    """Reward-model scores of the chosen and rejected responses of preference rows: two (N,) tensors."""
    collate = PreferenceCollator(tokenizer.pad_token_id)
    encoded = _encode_pairs(tokenizer, rows)
    chosen, rejected = [], []
    for rows_slice in chunked(len(encoded), batch_size):
        batch = collate(encoded[rows_slice])
        scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"]).chunk(2)
        chosen.append(scores[0])
        rejected.append(scores[1])
    return torch.cat(chosen), torch.cat(rejected)


def evaluate_reward_model(rm_dir: str | Path, pairs_path: str | Path) -> dict:
    """Accuracy of an exported reward model on preference pairs: against gold and against the labels."""
    tokenizer = load_tokenizer(str(rm_dir))
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1).eval()
    rows = read_jsonl(pairs_path)
    chosen, rejected = pair_scores(model, tokenizer, rows)
    gold_c = [r["gold_chosen"] for r in rows]
    gold_r = [r["gold_rejected"] for r in rows]
    return {
        "gold_accuracy": gold_accuracy(chosen, rejected, gold_c, gold_r),
        "label_accuracy": (chosen > rejected).double().mean().item(),
        "n_pairs": len(rows),
        "n_gold_ordered_pairs": sum(c != r for c, r in zip(gold_c, gold_r)),
    }


class GoldAccuracy(Callback):
    """Log ``val/gold_accuracy`` of a :class:`~lit_rlhf.modules.RewardModelModule` after each validation.

    The chosen and rejected scores that the module's ``validation_step`` returns (``outputs`` of
    ``on_validation_batch_end``, in batch order whatever layout scored them) are compared with the gold
    rewards of the same rows of ``pairs_path``, which must be the DataModule's ``val_path`` (its
    validation loader keeps the file order).

    Args:
        pairs_path: jsonl file of the validation pairs with ``gold_chosen`` and ``gold_rejected``.
    """

    def __init__(self, pairs_path: str) -> None:
        rows = read_jsonl(pairs_path)
        self.gold = torch.tensor([[r["gold_chosen"], r["gold_rejected"]] for r in rows], dtype=torch.float64)
        self.scores: list[torch.Tensor] = []

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.scores = []

    @override
    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not isinstance(outputs, dict) or "chosen" not in outputs:
            raise TypeError(
                f"GoldAccuracy: {type(pl_module).__name__}.validation_step must return the pair scores "
                "({'chosen': (B,), 'rejected': (B,)}), as RewardModelModule does"
            )
        pair = torch.stack([outputs["chosen"], outputs["rejected"]], dim=1)  # (B, 2)
        self.scores.append(pair.double().cpu())

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self.scores:
            return
        scores = torch.cat(self.scores)
        gold = self.gold[: len(scores)]  # limit_val_batches: the rows seen, in file order
        accuracy = gold_accuracy(scores[:, 0], scores[:, 1], gold[:, 0], gold[:, 1])
        pl_module.log("val/gold_accuracy", accuracy, prog_bar=True)


def sample_policy(
    policy_dir: str | Path,
    prompts: Sequence[str],
    generation: GenerationSettings,
    *,
    reference_dir: str | Path,
    reward_model_dir: str | Path,
    batch_size: int = 256,
    seed: int = 0,
) -> list[dict]:
    """One sampled response per prompt of an exported policy (see :func:`sample_responses`)."""
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, num_labels=1).eval()
    return sample_responses(
        AutoModelForCausalLM.from_pretrained(policy_dir).eval(),
        AutoModelForCausalLM.from_pretrained(reference_dir).eval(),
        load_tokenizer(str(policy_dir), padding_side="left"),
        prompts,
        generation,
        reward_model=reward_model,
        batch_size=batch_size,
        seed=seed,
        desc=f"sampling {Path(policy_dir).name}",
    )


@torch.no_grad()
def sample_responses(
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    generation: GenerationSettings,
    *,
    reward_model: torch.nn.Module | None = None,
    batch_size: int = 256,
    seed: int = 0,
    desc: str | None = None,
    engine: RolloutEngine | None = None,
) -> list[dict]:
    """One sampled response per prompt with its gold, grammaticality, proxy score, KL and length.

    Sampling uses its own seeded random stream (the global one is left as it was), so the same policy
    gives the same responses at every call. Models are used as they are (call ``.eval()`` first); the
    proxy score is None without a reward model. ``tokenizer`` pads on the left. The responses come from
    ``engine`` (default: ``HFEngine``, Hugging Face ``generate`` on ``policy``), set up with ``policy``.
    """
    engine = HFEngine() if engine is None else engine
    engine.setup(policy, tokenizer)
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = list(chunked(len(prompts), batch_size))
        for part in tqdm(parts, desc=desc, unit="batch", disable=desc is None):
            texts = list(prompts[part])
            enc = tokenizer(texts, padding=True, return_tensors="pt")
            responses, response_mask, truncated, *_ = engine.generate(enc.input_ids, enc.attention_mask, generation)
            input_ids = torch.cat([enc.input_ids, responses], dim=1)
            attention_mask = torch.cat([enc.attention_mask, response_mask.long()], dim=1)
            T = responses.shape[1]
            logprobs, _, _ = policy_forward(policy, input_ids, attention_mask, T, generation.temperature)
            ref_logprobs, _, _ = policy_forward(reference, input_ids, attention_mask, T, generation.temperature)
            kl = masked_row_sum(logprobs - ref_logprobs, response_mask)  # k1 summed over the response
            proxy = None if reward_model is None else sequence_scores(reward_model, input_ids, attention_mask)
            for i, prompt in enumerate(texts):
                response = tokenizer.decode(responses[i][response_mask[i]], skip_special_tokens=True)
                rows.append(
                    {
                        "prompt": prompt,
                        "response": response,
                        "gold": world.gold_reward(prompt + response),
                        "grammatical": world.is_grammatical(prompt + response),
                        "proxy": None if proxy is None else proxy[i].item(),
                        "kl_ref": kl[i].item(),
                        "length": int(response_mask[i].sum()),
                        "truncated": bool(truncated[i]),
                    }
                )
    return rows


def summarize(rows: Sequence[dict]) -> dict:
    """Means (and standard deviations of gold, proxy and KL) over the sampled responses of one policy.

    The proxy entries are left out when the rows have no proxy score (sampled without a reward model).
    """
    gold = [r["gold"] for r in rows]
    proxy = [r["proxy"] for r in rows if r["proxy"] is not None]
    return {
        "n_prompts": len(rows),
        "gold_mean": statistics.fmean(gold),
        "gold_std": statistics.pstdev(gold),
        **({"proxy_mean": statistics.fmean(proxy), "proxy_std": statistics.pstdev(proxy)} if proxy else {}),
        "kl_ref": statistics.fmean(r["kl_ref"] for r in rows),
        "kl_ref_std": statistics.pstdev(r["kl_ref"] for r in rows),
        "grammatical_rate": statistics.fmean(float(r["grammatical"]) for r in rows),
        "response_length": statistics.fmean(r["length"] for r in rows),
        "truncated_rate": statistics.fmean(float(r["truncated"]) for r in rows),
    }
