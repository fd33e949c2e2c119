"""Build the tool world's assets: tokenizer, SFT data, GRPO prompts and evaluation prompts.

``python -m lit_rlhf.demo.tool_assets --out DIR [--small]`` writes, deterministically for a seed::

    tokenizer/                          byte-level BPE with one token per digit (save_pretrained folder)
    sft_train.jsonl, sft_val.jsonl      {"prompt", "completion"}  (completion without the EOS)
    prompts_train.jsonl, prompts_eval.jsonl   {"prompt", "answer", "kind"}  (answer: the gold integer)
    manifest.json                       the arguments and statistics of the data

SFT rows of a sum answer it directly (``" answer : N ."``). Of the products:

- a ``tool_fraction`` are solved with a calculator call, the whole transcript being the completion
  (:func:`lit_rlhf.demo.tool_world.tool_response`): the SFT policy learns to call the tool sometimes;
- a ``copy_fraction`` are continuations: the prompt holds the problem, a call and the calculator's
  observation, the completion is the answer (``" answer : 1776 ."``). They teach to copy an observation into
  the answer without teaching to call (the loss is on the completion only): the SFT policy calls on
  ``tool_fraction / (1 - copy_fraction)`` of the products, yet copies well when it does. With tool
  transcripts alone copying is learnt late and at a step that varies a lot with the seed (measured: between
  400 and over 800 steps), as the direct answers after the same ``" answer :"`` outnumber the copies;
- the others are answered directly (the gold answer, which the model cannot compute: it guesses).

Three disjoint parts of the problem space: a problem's key is its operand pair for a product (unordered,
``"a*b"`` with a <= b, so neither order of it is in another part) and its prompt text for a sum (the 81 sums
themselves are in every part: they are the facts learnt by heart); CRC32(key) % :data:`PARTS_MODULUS` is 0
for the held-out part (``sft_val``, ``prompts_eval``), 1 for the GRPO part (``prompts_train``) and anything
else for the SFT part (``sft_train``). No product is trained on with its answer by SFT and then met again in
GRPO or in the evaluation: what SFT memorised of products cannot raise a reward later.
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

PARTS_MODULUS = 10
PARTS = ("eval", "rl", "sft")
SMALL = dict(n_sft=512, n_prompts=64, n_eval_prompts=32)


def part(problem: dict[str, Any]) -> str:
    """The part of the problem space a problem belongs to, one of :data:`PARTS` (see the module docstring)."""
    a, b = sorted((problem["a"], problem["b"]))
    key = f"{a}*{b}" if problem["kind"] == "product" else problem["prompt"]
    return PARTS[min(zlib.crc32(key.encode()) % PARTS_MODULUS, 2)]


def sample_problems(
    rng: random.Random, n: int, where: str, distinct: bool = False, sum_fraction: float | None = None
) -> list[dict[str, Any]]:
    """``n`` problems of the part ``where`` (rejection sampling keeps the world's distribution within it), a
    sum with probability ``sum_fraction`` (None: the world's :data:`~lit_rlhf.demo.tool_world.EASY_FRACTION`)."""
    problems: dict[str, dict] = {}
    drawn: list[dict] = []
    while len(problems if distinct else drawn) < n:
        kind = None if sum_fraction is None else "sum" if rng.random() < sum_fraction else "product"
        problem = world.sample_problem(rng, kind)
        if part(problem) == where:
            problems.setdefault(problem["prompt"], problem)
            drawn.append(problem)
    return list(problems.values()) if distinct else drawn


def sft_rows(
    rng: random.Random, n: int, where: str, tool_fraction: float, copy_fraction: float, sum_fraction: float
) -> list[dict[str, str]]:
    """``n`` SFT rows of the part ``where``: direct answers, tool transcripts and continuations (module docstring)."""
    rows = []
    for problem in sample_problems(rng, n, where, sum_fraction=sum_fraction):
        prompt, answer = problem["prompt"], world.direct_response(problem["answer"])
        draw = rng.random() if problem["kind"] == "product" else 1.0
        if draw < tool_fraction:
            rows.append({"prompt": prompt, "completion": world.tool_response(problem)})
        elif draw < tool_fraction + copy_fraction:
            transcript = world.tool_response(problem)
            rows.append({"prompt": prompt + transcript[: -len(answer)], "completion": answer})
        else:
            rows.append({"prompt": prompt, "completion": answer})
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
    tool_fraction: float = 0.15,
    copy_fraction: float = 0.35,
    sft_sum_fraction: float = 0.35,
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
        copy_fraction: the fraction of SFT products given as continuations after a call and its observation.
        sft_sum_fraction: the fraction of sums among the SFT rows, above the world's (the GRPO and evaluation
            prompts'): a small GRPO update moves what the model knows of sums unless they are learnt firmly.
        vocab_size: BPE vocabulary size; 400 makes every word of the world a single token.
    """
    if not (0.0 <= tool_fraction and 0.0 <= copy_fraction and tool_fraction + copy_fraction < 1.0):
        raise ValueError(
            f"tool_fraction and copy_fraction must be >= 0 with a sum below 1, got {tool_fraction} and {copy_fraction}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # written last: no manifest until the build is whole
    args = dict(n_sft=n_sft, n_prompts=n_prompts, n_eval_prompts=n_eval_prompts, tool_fraction=tool_fraction,
                copy_fraction=copy_fraction, sft_sum_fraction=sft_sum_fraction, val_fraction=val_fraction, seed=seed,
                vocab_size=vocab_size)  # fmt: skip
    fractions = (tool_fraction, copy_fraction, sft_sum_fraction)

    def stream(name: str) -> random.Random:  # one generator per file: sizes of one do not change another
        return random.Random(f"tool/{seed}/{name}")

    data = {
        "sft_train": sft_rows(stream("sft_train"), n_sft, "sft", *fractions),
        "sft_val": sft_rows(stream("sft_val"), math.ceil(n_sft * val_fraction), "eval", *fractions),
        "prompts_train": prompt_rows(sample_problems(stream("prompts_train"), n_prompts, "rl")),
        "prompts_eval": prompt_rows(sample_problems(stream("prompts_eval"), n_eval_prompts, "eval", distinct=True)),
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
        "sft_copy_rows": sum(world.CALL_OPEN in r["prompt"] for r in data["sft_train"]),
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
