"""Build the tool world's assets: tokenizer, SFT data, GRPO prompts and evaluation prompts.

``python -m lit_rlhf.demo.tool_assets --out DIR [--small]`` writes, deterministically for a seed::

    tokenizer/                          byte-level BPE with one token per digit (save_pretrained folder)
    sft_train.jsonl, sft_val.jsonl      {"prompt", "completion"}  (completion without the EOS)
    prompts_train.jsonl, prompts_eval.jsonl   {"prompt", "answer", "kind"}  (answer: the gold integer)
    manifest.json                       the arguments and statistics of the data

SFT completions are direct answers (``" answer : N ."``), except for a ``tool_fraction`` of the products,
which are solved with a calculator call (:func:`lit_rlhf.demo.tool_world.tool_response`): the SFT policy
sometimes calls the tool on hard problems and has seen how to copy its value into the answer.

Held-out problems: a product whose operand pair ``(a, b)`` has a CRC32 divisible by :data:`HELDOUT_MODULUS`
(so no evaluation product was ever trained on with its answer), a sum whose prompt text has (the 81 sums
themselves are all trained on: they are the facts learnt by heart). Training files use the other
problems, validation and evaluation files only held-out ones.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_rlhf.demo import tool_world as world
from lit_rlhf.models.tokenizer import train_bpe_tokenizer

HELDOUT_MODULUS = 10
SMALL = dict(n_sft=512, n_prompts=64, n_eval_prompts=32)


def is_heldout(problem: dict[str, Any]) -> bool:
    """Whether a problem is in the held-out part (validation and evaluation only); see the module docstring."""
    key = f"{problem['a']}*{problem['b']}" if problem["kind"] == "product" else problem["prompt"]
    return zlib.crc32(key.encode()) % HELDOUT_MODULUS == 0


def sample_problems(rng: random.Random, n: int, heldout: bool, distinct: bool = False) -> list[dict[str, Any]]:
    """``n`` problems of one part (rejection sampling keeps the world's distribution within it)."""
    problems: dict[str, dict] = {}
    drawn: list[dict] = []
    while len(problems if distinct else drawn) < n:
        problem = world.sample_problem(rng)
        if is_heldout(problem) == heldout:
            problems.setdefault(problem["prompt"], problem)
            drawn.append(problem)
    return list(problems.values()) if distinct else drawn


def sft_rows(rng: random.Random, n: int, heldout: bool, tool_fraction: float) -> list[dict[str, str]]:
    rows = []
    for problem in sample_problems(rng, n, heldout):
        use_tool = problem["kind"] == "product" and rng.random() < tool_fraction
        completion = world.tool_response(problem) if use_tool else world.direct_response(problem["answer"])
        rows.append({"prompt": problem["prompt"], "completion": completion})
    return rows


def prompt_rows(problems: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"prompt": p["prompt"], "answer": p["answer"], "kind": p["kind"]} for p in problems]


def _write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    with path.open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def build_tool_assets(
    out_dir: str | Path,
    *,
    n_sft: int = 30_000,
    n_prompts: int = 8_192,
    n_eval_prompts: int = 512,
    tool_fraction: float = 0.2,
    val_fraction: float = 0.05,
    seed: int = 0,
    vocab_size: int = 400,
) -> dict[str, Path]:
    """Write the tool world's assets into ``out_dir`` (see the module docstring) and return their paths.

    Args:
        n_sft: SFT training rows; ``sft_val`` gets ``ceil(n_sft * val_fraction)`` held-out rows.
        n_prompts: GRPO training prompts (drawn i.i.d., repeats possible).
        n_eval_prompts: distinct held-out evaluation prompts.
        tool_fraction: the fraction of SFT products solved with a calculator call.
        vocab_size: BPE vocabulary size; 400 makes every word of the world a single token.
    """
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = dict(n_sft=n_sft, n_prompts=n_prompts, n_eval_prompts=n_eval_prompts, tool_fraction=tool_fraction,
                val_fraction=val_fraction, seed=seed, vocab_size=vocab_size)  # fmt: skip

    def stream(name: str) -> random.Random:  # one generator per file: sizes of one do not change another
        return random.Random(f"tool/{seed}/{name}")

    data = {
        "sft_train": sft_rows(stream("sft_train"), n_sft, False, tool_fraction),
        "sft_val": sft_rows(stream("sft_val"), math.ceil(n_sft * val_fraction), True, tool_fraction),
        "prompts_train": prompt_rows(sample_problems(stream("prompts_train"), n_prompts, False)),
        "prompts_eval": prompt_rows(sample_problems(stream("prompts_eval"), n_eval_prompts, True, distinct=True)),
    }
    paths = {name: _write_jsonl(out / f"{name}.jsonl", rows) for name, rows in data.items()}
    texts = [row["prompt"] + row["completion"] for row in data["sft_train"]]
    tokenizer = train_bpe_tokenizer(texts[:20_000], vocab_size=vocab_size, split_digits=True)
    paths["tokenizer"] = out / "tokenizer"
    tokenizer.save_pretrained(paths["tokenizer"])
    lengths = [len(tokenizer(t).input_ids) for t in texts[:2_000]]
    manifest = {
        "args": args,
        "rows": {name: len(rows) for name, rows in data.items()},
        "tokenizer_vocab_size": len(tokenizer),
        "easy_fraction": world.EASY_FRACTION,
        "sft_tool_rows": sum(world.CALL_OPEN in r["completion"] for r in data["sft_train"]),
        "eval_kinds": {k: sum(r["kind"] == k for r in data["prompts_eval"]) for k in ("sum", "product")},
        "max_sft_tokens": max(lengths),
    }
    paths["manifest"] = out / "manifest.json"
    paths["manifest"].write_text(json.dumps(manifest, indent=2) + "\n")
    return paths


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = build_tool_assets(args.out, seed=args.seed, **(SMALL if args.small else {}))
    manifest = json.loads(paths["manifest"].read_text())
    print(f"tool world assets in {args.out}: {manifest['rows']}; {manifest['sft_tool_rows']} SFT tool transcripts")
    return paths


if __name__ == "__main__":
    main()
