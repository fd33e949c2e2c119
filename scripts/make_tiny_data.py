"""Make the small local data and tokenizer that the tiny configs in configs/ train on.

    python scripts/make_tiny_data.py --out data/tiny

Writes ``tokenizer/`` (byte-level BPE trained here), ``sft.jsonl`` (prompt/completion),
``prefs.jsonl`` (prompt/chosen/rejected: the chosen review is positive, the rejected one negative, a
separable toy preference) and ``prompts.jsonl``, each with a held-out ``*_test.jsonl`` (a quarter as many
rows, drawn from another seed) for ``lit-rlhf test``, and ``prompts_val.jsonl`` (an eighth as many held-out
prompts) for the evaluation rollouts of the online configs. Deterministic for a seed; takes seconds.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SUBJECTS = ["the food", "the service", "the movie", "the room", "the staff", "the plot", "the music", "the view"]
POSITIVE = ["good", "great", "lovely", "excellent", "fine", "superb", "nice", "tasty"]
NEGATIVE = ["bad", "awful", "terrible", "poor", "dull", "rude", "bland", "weak"]
INTENSIFIERS = ["", "very ", "really ", "quite "]


def review(rng: random.Random, words: list[str]) -> str:
    clauses = [f"{rng.choice(SUBJECTS)} was {rng.choice(INTENSIFIERS)}{rng.choice(words)}"]
    if rng.random() < 0.5:
        clauses.append(f"{rng.choice(SUBJECTS)} was {rng.choice(INTENSIFIERS)}{rng.choice(words)}")
    return " and ".join(clauses) + "."


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/tiny", help="output folder")
    parser.add_argument("--rows", type=int, default=512, help="rows per file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [f"review {i % 50}:" for i in range(args.rows)]
    sft = [{"prompt": p, "completion": " " + review(rng, rng.choice([POSITIVE, NEGATIVE]))} for p in prompts]
    prefs = [
        {"prompt": p, "chosen": " " + review(rng, POSITIVE), "rejected": " " + review(rng, NEGATIVE)} for p in prompts
    ]
    corpus = [r["prompt"] + r["completion"] for r in sft] + [r["prompt"] + r["chosen"] + r["rejected"] for r in prefs]
    train_bpe_tokenizer(corpus, vocab_size=400).save_pretrained(out / "tokenizer")
    write_jsonl(out / "sft.jsonl", sft)
    write_jsonl(out / "prefs.jsonl", prefs)
    write_jsonl(out / "prompts.jsonl", [{"prompt": p} for p in prompts])
    write_test_files(out, max(1, args.rows // 4), random.Random(args.seed + 1))
    # validation prompts numbered past the test ones (the prompt is all the online modules read)
    write_jsonl(out / "prompts_val.jsonl", [{"prompt": f"review {100 + i % 50}:"} for i in range(max(1, args.rows // 8))])
    print(
        f"wrote {out}/tokenizer, sft.jsonl, prefs.jsonl, prompts.jsonl ({args.rows} rows each), *_test.jsonl"
        " and prompts_val.jsonl"
    )


def write_test_files(out: Path, rows: int, rng: random.Random) -> None:
    """Held-out rows of the same toy tasks (prompts numbered past the training ones)."""
    prompts = [f"review {50 + i % 50}:" for i in range(rows)]
    write_jsonl(out / "sft_test.jsonl", [{"prompt": p, "completion": " " + review(rng, rng.choice([POSITIVE, NEGATIVE]))} for p in prompts])
    write_jsonl(out / "prefs_test.jsonl", [{"prompt": p, "chosen": " " + review(rng, POSITIVE), "rejected": " " + review(rng, NEGATIVE)} for p in prompts])
    write_jsonl(out / "prompts_test.jsonl", [{"prompt": p} for p in prompts])


if __name__ == "__main__":
    main()
