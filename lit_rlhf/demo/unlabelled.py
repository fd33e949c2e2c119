"""The unlabelled texts of the demo's disagreement ensemble (``rm_weak_disagreement_ensemble.yaml``): samples of
the SFT policy that no preference pair covers, for ``RewardEnsembleModule(disagreement=...)``.

``unlabelled_texts`` samples the SFT policy on the training prompts at a raised temperature, and keeps the last
share of them from ending early; ``write_texts`` writes them as the ``{"text": ...}`` lines the module reads.
Nothing here is labelled: the gold reward is only counted for the report (how many are grammatical, how many
have more opinions than the grammar allows).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lit_rlhf.demo import evaluate, world
from lit_rlhf.models import load_tokenizer

N_TEXTS = 2048  # SFT samples, of the first training prompts
TEMPERATURE = 1.5  # above the rollouts' 0.8: the region a drifting policy reaches first
FORCED_SHARE = 0.5  # the share of them kept from ending early ...
MIN_NEW_TOKENS = 18  # ... for this many tokens: longer than any pair's response
MAX_NEW_TOKENS = 32


def unlabelled_texts(
    out: Path,
    n: int = N_TEXTS,
    temperature: float = TEMPERATURE,
    forced_share: float = FORCED_SHARE,
    min_new_tokens: int = MIN_NEW_TOKENS,
) -> tuple[list[str], dict]:
    """``n`` SFT samples of the training prompts at ``temperature`` (prompt + response, + EOS where it stopped),
    the last ``forced_share`` of them with the end of text barred for ``min_new_tokens`` tokens (texts longer
    than any pair's: length is the first direction a reward model is exploited in, Singhal et al. 2023,
    arXiv:2310.03716); and their grammatical share and share with more opinions than the grammar allows
    (reported only, never used)."""
    tokenizer = load_tokenizer(str(out / "sft"), padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(out / "sft").eval()
    path = out / "assets" / "prompts_train.jsonl"
    prompts = [r["prompt"] for r in evaluate.read_jsonl(path)][:n]
    if len(prompts) < n:  # one text per prompt: fewer prompts would also cut the forced share short
        raise ValueError(f"{path}: {len(prompts)} training prompts, fewer than the {n} unlabelled texts asked for")
    forced_from = n - round(forced_share * n)
    segments = ((0, forced_from, {}), (forced_from, len(prompts), {"min_new_tokens": min_new_tokens}))
    texts, full = [], []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        for begin, end, forced in segments:
            for start in range(begin, end, 256):
                part = prompts[start : min(start + 256, end)]
                enc = tokenizer(part, return_tensors="pt", padding=True)
                ids = policy.generate(
                    **enc,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=MAX_NEW_TOKENS,
                    pad_token_id=tokenizer.pad_token_id,
                    **forced,
                )
                for prompt, row in zip(part, ids[:, enc.input_ids.shape[1] :].tolist()):
                    text = prompt + tokenizer.decode(row, skip_special_tokens=True)
                    full.append(text)
                    texts.append(text + (tokenizer.eos_token if tokenizer.eos_token_id in row else ""))
    over = sum(r.count(" and ") + r.count(" but ") > world.MAX_OPINIONS for r in full)
    stats = {"n": len(texts), "grammatical": sum(map(world.is_grammatical, full)) / len(texts),
             "more_than_max_conjunctions": over / len(texts), "temperature": temperature,
             "forced_share": forced_share, "min_new_tokens": min_new_tokens}  # fmt: skip
    return texts, stats


def write_texts(texts: list[str], path: Path) -> Path:
    """The unlabelled texts as ``{"text": ...}`` lines (what ``RewardEnsembleModule(disagreement=...)`` reads),
    written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    partial.replace(path)
    return path
