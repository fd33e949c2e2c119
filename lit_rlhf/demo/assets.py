"""Build the demo assets: tokenizer, SFT data, PPO prompts and Bradley-Terry preference pairs.

``python -m lit_rlhf.demo.assets --out DIR [--small]`` writes, deterministically for a seed::

    tokenizer/                  byte-level BPE trained on the SFT reviews (save_pretrained folder)
    sft_train.jsonl, sft_val.jsonl          {"prompt", "completion"}  (completion without the EOS)
    prompts_train.jsonl, prompts_eval.jsonl {"prompt"}
    prefs_train.jsonl, prefs_val.jsonl      {"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected"}
    manifest.json                           the arguments and statistics of the world and the data (written
                                            last, an old one deleted first: its presence means a finished build)

Held-out prompts: a prompt belongs to the held-out part of the prompt space when the CRC32 of its text is
divisible by :data:`HELDOUT_MODULUS`. Training files (``*_train``) only use the other prompts, validation
and evaluation files only held-out ones, so no evaluation prompt is ever trained on, whatever the sizes.

Preference labels follow Bradley-Terry on the gold reward, the model whose likelihood the pairwise RM loss
-logsigmoid(r_chosen - r_rejected) maximises (Christiano et al. 2017; Ouyang et al. 2022, eq. 1):
for completions a, b of one prompt, a is chosen with probability sigmoid((g_a - g_b) / bt_temperature),
so near-ties are coin flips and large gaps are almost always labelled right, like human raters.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from lit_rlhf.demo import world
from lit_rlhf.models.tokenizer import train_bpe_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HELDOUT_MODULUS = 10  # about 1 prompt in 10 (~3.6k of the 35,840 prompts) is held out

# Reviews the tokenizer is trained on: the language has under 100 words, so 20k reviews see each of them
# thousands of times and more text only slows the training down.
TOKENIZER_TEXTS = 20_000

SMALL = dict(n_sft=256, n_prompts=64, n_pref_prompts=48, completions_per_prompt=3, n_eval_prompts=32)


def is_heldout(prompt: str) -> bool:
    """Whether ``prompt`` is in the held-out part of the prompt space (validation and evaluation only)."""
    return zlib.crc32(prompt.encode()) % HELDOUT_MODULUS == 0


def _prompt_sampler(rng: random.Random, heldout: bool) -> Callable[[], str]:
    def sample() -> str:
        while True:  # rejection sampling keeps the prompt distribution within each part
            prompt = world.sample_prompt(rng)
            if is_heldout(prompt) == heldout:
                return prompt

    return sample


def bradley_terry_prefers_first(rng: random.Random, gold_a: float, gold_b: float, temperature: float) -> bool:
    """Draw a noisy label: True with probability sigmoid((gold_a - gold_b) / temperature)."""
    x = (gold_a - gold_b) / temperature
    p_first = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))  # no overflow
    return rng.random() < p_first


def gold_accuracy(chosen_scores, rejected_scores, gold_chosen, gold_rejected) -> float:
    """Fraction of pairs with different gold rewards that the scores order like the gold does.

    All arguments are sequences or tensors of shape (N,); pairs with ``gold_chosen == gold_rejected`` have
    no gold ordering and are left out; a tie in the scores counts as wrong.
    """
    chosen, rejected, g_chosen, g_rejected = (
        torch.as_tensor(x, dtype=torch.float64).flatten()
        for x in (chosen_scores, rejected_scores, gold_chosen, gold_rejected)
    )
    if not len(chosen) == len(rejected) == len(g_chosen) == len(g_rejected):
        raise ValueError("chosen_scores, rejected_scores, gold_chosen and gold_rejected differ in length")
    gold_gap = g_chosen - g_rejected
    ordered = gold_gap != 0
    if not ordered.any():
        raise ValueError("no pair has different gold rewards: the gold accuracy is undefined")
    agree = (chosen - rejected) * gold_gap > 0
    return agree[ordered].double().mean().item()


def _sft_rows(rng: random.Random, n: int, heldout: bool) -> list[dict]:
    sample_prompt = _prompt_sampler(rng, heldout)
    rows = []
    for _ in range(n):
        prompt = sample_prompt()
        rows.append({"prompt": prompt, "completion": world.sample_response(rng, prompt)})
    return rows


def _train_prompts(rng: random.Random, n: int) -> list[dict]:
    sample_prompt = _prompt_sampler(rng, heldout=False)
    return [{"prompt": sample_prompt()} for _ in range(n)]


def _eval_prompts(rng: random.Random, n: int) -> list[dict]:
    sample_prompt, prompts = _prompt_sampler(rng, heldout=True), {}
    while len(prompts) < n:  # distinct prompts, in the order drawn
        prompts.setdefault(sample_prompt(), None)
    return [{"prompt": p} for p in prompts]


def _pref_rows(
    rng: random.Random, n_prompts: int, k: int, heldout: bool, bt_temperature: float
) -> list[dict]:
    """All k*(k-1)/2 pairs of k distinct completions for each of ``n_prompts`` prompts, BT-labelled."""
    sample_prompt, rows = _prompt_sampler(rng, heldout), []
    for _ in range(n_prompts):
        prompt, completions = sample_prompt(), {}
        while len(completions) < k:
            completions.setdefault(world.sample_response(rng, prompt), None)
        scored = [(c, world.gold_reward(prompt + c)) for c in completions]
        for (a, g_a), (b, g_b) in itertools.combinations(scored, 2):
            if not bradley_terry_prefers_first(rng, g_a, g_b, bt_temperature):
                (a, g_a), (b, g_b) = (b, g_b), (a, g_a)
            rows.append(
                {"prompt": prompt, "chosen": a, "rejected": b, "gold_chosen": g_a, "gold_rejected": g_b}
            )
    return rows


def _write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    with path.open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def _stats(values: Sequence[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
    }


def build_assets(
    out_dir: str | Path,
    *,
    n_sft: int = 80_000,
    n_prompts: int = 16_384,
    n_pref_prompts: int = 4_000,
    completions_per_prompt: int = 4,
    n_eval_prompts: int = 1_024,
    val_fraction: float = 0.05,
    seed: int = 0,
    vocab_size: int = 640,
    bt_temperature: float = 1.0,
) -> dict[str, Path]:
    """Write the demo assets into ``out_dir`` (see the module docstring) and return their paths.

    Args:
        n_sft: SFT training rows; ``sft_val`` gets ``ceil(n_sft * val_fraction)`` held-out rows.
        n_prompts: PPO training prompts (drawn i.i.d., repeats possible).
        n_pref_prompts: preference prompts; each gives ``C(completions_per_prompt, 2)`` pairs
            (``prefs_val`` uses ``ceil(n_pref_prompts * val_fraction)`` held-out prompts).
        completions_per_prompt: distinct grammar completions drawn per preference prompt (>= 2).
        n_eval_prompts: distinct held-out evaluation prompts.
        vocab_size: BPE vocabulary size; 640 makes every word of the language a single token.
        bt_temperature: Bradley-Terry temperature of the preference labels (lower is less noisy).
    """
    if completions_per_prompt < 2:
        raise ValueError(f"completions_per_prompt must be >= 2 to form pairs, got {completions_per_prompt}")
    if bt_temperature <= 0:
        raise ValueError(f"bt_temperature must be > 0, got {bt_temperature}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The manifest is written last and says the folder is complete: an old one goes first, so a build that
    # does not finish leaves no manifest for the pipeline to reuse the half-written folder by.
    (out / "manifest.json").unlink(missing_ok=True)
    args = dict(
        n_sft=n_sft,
        n_prompts=n_prompts,
        n_pref_prompts=n_pref_prompts,
        completions_per_prompt=completions_per_prompt,
        n_eval_prompts=n_eval_prompts,
        val_fraction=val_fraction,
        seed=seed,
        vocab_size=vocab_size,
        bt_temperature=bt_temperature,
    )
    data, paths = _write_data(
        out, seed=seed, n_sft=n_sft, n_prompts=n_prompts, n_pref_prompts=n_pref_prompts,
        k=completions_per_prompt, n_eval_prompts=n_eval_prompts, val_fraction=val_fraction,
        bt_temperature=bt_temperature,
    )  # fmt: skip

    texts = [row["prompt"] + row["completion"] for row in data["sft_train"]]
    tokenizer = train_bpe_tokenizer(texts[:TOKENIZER_TEXTS], vocab_size=vocab_size)
    paths["tokenizer"] = out / "tokenizer"
    tokenizer.save_pretrained(paths["tokenizer"])

    paths["manifest"] = out / "manifest.json"
    paths["manifest"].write_text(json.dumps(_manifest(args, tokenizer, texts, data), indent=2) + "\n")
    return paths


def _write_data(
    out: Path,
    *,
    seed: int,
    n_sft: int,
    n_prompts: int,
    n_pref_prompts: int,
    k: int,
    n_eval_prompts: int,
    val_fraction: float,
    bt_temperature: float,
) -> tuple[dict[str, list[dict]], dict[str, Path]]:
    """Draw and write the ``*.jsonl`` files (arguments as in :func:`build_assets`, ``k`` its
    ``completions_per_prompt``). Returns the rows and the path of each file, keyed by file name."""

    def stream(name: str) -> random.Random:
        # One generator per file: a file does not change when another file's size changes.
        return random.Random(f"{seed}/{name}")

    n_sft_val = math.ceil(n_sft * val_fraction)
    n_pref_val = math.ceil(n_pref_prompts * val_fraction)
    sft_train = _sft_rows(stream("sft_train"), n_sft, heldout=False)
    builders = {
        "sft_train": lambda: sft_train,
        "sft_val": lambda: _sft_rows(stream("sft_val"), n_sft_val, heldout=True),
        "prompts_train": lambda: _train_prompts(stream("prompts_train"), n_prompts),
        "prompts_eval": lambda: _eval_prompts(stream("prompts_eval"), n_eval_prompts),
        "prefs_train": lambda: _pref_rows(stream("prefs_train"), n_pref_prompts, k, False, bt_temperature),
        "prefs_val": lambda: _pref_rows(stream("prefs_val"), n_pref_val, k, True, bt_temperature),
    }
    data, paths = {}, {}
    for name, build in tqdm(builders.items(), desc="demo assets", unit="file"):
        data[name] = build()
        paths[name] = _write_jsonl(out / f"{name}.jsonl", data[name])
    return data, paths


def _manifest(
    args: dict, tokenizer: PreTrainedTokenizerBase, texts: list[str], data: dict[str, list[dict]]
) -> dict:
    """The manifest: :func:`build_assets`'s ``args``, the statistics of the world, of the trained
    ``tokenizer``, of the SFT ``texts`` (prompt + completion) and of the rows of each file (``data``)."""
    ordered = [r for r in data["prefs_train"] if r["gold_chosen"] != r["gold_rejected"]]
    return {
        "args": args,
        "language_size": world.count_sentences(),
        "n_distinct_prompts": world.count_sentences(0),
        "n_words": len(world.vocabulary()),
        "tokenizer_vocab_size": len(tokenizer),
        "max_response_tokens": world.max_response_tokens(tokenizer),
        "longest_response": world.longest_response(tokenizer),
        "sft_gold": _stats([world.gold_reward(t) for t in texts]),
        "rows": {name: len(rows) for name, rows in data.items()},
        # The accuracy of the noisy labels themselves against the gold ordering: what a rater achieves.
        "prefs_train_label_gold_agreement": sum(r["gold_chosen"] > r["gold_rejected"] for r in ordered)
        / max(len(ordered), 1),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bt-temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    sizes = SMALL if args.small else {}
    paths = build_assets(args.out, seed=args.seed, bt_temperature=args.bt_temperature, **sizes)
    manifest = json.loads(paths["manifest"].read_text())
    gold = manifest["sft_gold"]
    print(
        f"demo assets in {args.out}: {manifest['rows']}; language {manifest['language_size']:.3e} reviews, "
        f"{manifest['n_words']} words; SFT gold {gold['mean']:+.2f} +- {gold['std']:.2f}; "
        f"max_response_tokens {manifest['max_response_tokens']}"
    )
    return paths


if __name__ == "__main__":
    main()
