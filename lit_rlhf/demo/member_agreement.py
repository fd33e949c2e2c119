"""Where the ensemble members agree: their mean, spread and mean - spread on the texts of each final policy.

``python -m lit_rlhf.demo.member_agreement --out runs/demo [--seed 0] [--prompts 256]`` reads a finished
``pipeline --ensemble`` folder, samples the first ``--prompts`` held-out prompts with the SFT policy and the
final policy of each over-optimisation run of training seed ``--seed`` (as the evaluation samples them:
``evaluate.sample_policy``, its temperature, length and sampling seed), and scores each text (prompt +
response + EOS, as the members score rollouts) with the members of both ensembles. Per policy and family it
prints the averages over the texts of the members' mean m_b, their spread s_b (``functional.ensemble_std``) and
``mean - spread`` (the ensembles' aggregate, ``functional.aggregate_ensemble(..., "mean_minus_std")``), beside
the texts' gold reward and grammatical rate, and writes them to ``OUT/member_agreement_seed<s>.json``.

The question it answers: does the pessimistic aggregate rank the policy that found the weak RM's exploit
below the one that did not? Uncertainty-weighted optimisation (Coste et al. 2024, arXiv:2310.02743, sec. 3)
assumes the members disagree most where they are wrong; where the error is a blind spot of the data they
all learnt from, they can agree on it more than on good text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lit_rlhf.demo import evaluate
from lit_rlhf.demo.aggregation_study import member_folders
from lit_rlhf.demo.ensemble_runs import SOURCES, run_name
from lit_rlhf.ensembles import member_scores
from lit_rlhf.functional import aggregate_ensemble, ensemble_std

FAMILIES = ("finetune", "pretrain")  # aggregation_study.member_folders: one SFT backbone, or three


def agreement(scores: torch.Tensor) -> dict[str, float]:
    """Averages over the N texts of the members' mean, spread and mean - spread of (K, N) ``scores``."""
    return {
        "mean": aggregate_ensemble(scores, "mean").mean().item(),
        "spread": ensemble_std(scores).mean().item(),
        "mean_minus_spread": aggregate_ensemble(scores, "mean_minus_std", 1.0).mean().item(),
    }


def policies(out: Path, seed: int) -> dict[str, Path]:
    """Policy label -> exported folder: the SFT policy and each source's over-optimisation run of ``seed``."""
    found = {"sft": out / "sft"}
    for source in SOURCES:
        folder = out / run_name(source, seed) / "actor"
        if folder.is_dir():
            found[source] = folder
    return found


def study(out: Path, seed: int, n_prompts: int, batch_size: int = 256) -> dict[str, dict]:
    """{policy: {gold, grammatical, n_texts, <family>: :func:`agreement`}} (see the module docstring)."""
    from lit_rlhf.models import load_tokenizer
    from lit_rlhf.rollout import GenerationSettings

    prompts = [r["prompt"] for r in evaluate.read_jsonl(out / "assets" / "prompts_eval.jsonl")][:n_prompts]
    generation = GenerationSettings(
        max_new_tokens=evaluate.EVAL_MAX_NEW_TOKENS, temperature=evaluate.EVAL_TEMPERATURE
    )
    eos = load_tokenizer(str(out / "rm_weak")).eos_token
    result, texts = {}, []
    for label, folder in policies(out, seed).items():
        rows = evaluate.sample_policy(
            folder, prompts, generation, reference_dir=out / "sft", reward_model_dir=out / "rm_weak",
            batch_size=batch_size,
        )  # fmt: skip
        texts += [r["prompt"] + r["response"] + eos for r in rows]
        result[label] = {
            "gold": sum(r["gold"] for r in rows) / len(rows),
            "grammatical": sum(r["grammatical"] for r in rows) / len(rows),
            "n_texts": len(rows),
        }
    for family in FAMILIES:  # each member loaded once, for every policy's texts
        scores = member_scores(member_folders(out, family), texts)  # (K, policies x N)
        for entry, part in zip(result.values(), scores.split([e["n_texts"] for e in result.values()], dim=1)):
            entry[family] = agreement(part)
    return result


def table(result: dict[str, dict]) -> str:
    """The markdown table of :func:`study`'s result."""
    head = " | ".join(f"{f}: mean / spread / mean - spread" for f in FAMILIES)
    lines = [f"| policy | gold | grammatical | {head} |", "|---|---|---|" + "---|" * len(FAMILIES)]
    for label, e in result.items():
        cells = [
            f"{e[f]['mean']:+.2f} / {e[f]['spread']:.2f} / {e[f]['mean_minus_spread']:+.2f}" for f in FAMILIES
        ]
        lines.append(f"| {label} | {e['gold']:+.2f} | {e['grammatical']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="a finished `pipeline --ensemble` folder"
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed of the over-optimisation runs")
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts sampled per policy")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.prompts < 2:
        parser.error(f"--prompts must be >= 2, got {args.prompts}")
    for family in FAMILIES:
        folders = member_folders(args.out, family)
        missing = [f for f in folders if not Path(f).is_dir()]
        if len(folders) < 2 or missing:
            parser.error(
                f"--out {args.out}: the {family} ensemble's members are missing: run the pipeline with --ensemble"
            )
    if args.threads:
        torch.set_num_threads(args.threads)
    result = study(args.out, args.seed, args.prompts)
    print(table(result))
    (args.out / f"member_agreement_seed{args.seed}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
