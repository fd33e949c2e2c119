"""Do members trained to agree on the pairs and disagree off them keep PPO off the demo world's exploit?

``python -m lit_rlhf.demo.disagreement_study --out runs/demo --coefs 0,1 --draws 0,1 --threads 2`` reads a
finished demo folder and, per draw d and disagreement weight alpha, trains a three-member ensemble jointly with
the weak RM's recipe (``configs/demo/rm_weak.yaml``: its first 2,400 pairs, 150 steps of 32, AdamW, warm-up
cosine schedule, each member's gradient clipped to 1.0), each member on its own Poisson bootstrap resample, with
``functional.disagreement_loss`` added (weight alpha): the members' spread on the pairs' texts is penalised,
and their spread below ``--target`` on unlabelled texts is too (Pagliardini et al. 2023, "Agree to Disagree",
ICLR 2023, arXiv:2202.04414: diversity by disagreement where there are no labels). The unlabelled texts are
the SFT policy's samples of the training prompts at ``--temperature`` (above the rollouts' 0.8): the region a
policy drifts to first, which no pair covers. The study never shows the members the exploit.

Each ensemble is scored as in :mod:`lit_rlhf.demo.prior_study` (gold accuracy on the held-out pairs; good,
exploit and sampled texts; P(good > exploit) under mean - k std), and with ``--ppo-seeds`` the over-optimisation
PPO runs against it (mean - 1 std), evaluated as the pipeline evaluates them. Written to
``OUT/disagreement_study.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch

from lit_rlhf import functional as F
from lit_rlhf.demo import evaluate, world
from lit_rlhf.demo.aggregation_study import table
from lit_rlhf.demo.overoptimization import source_entry
from lit_rlhf.demo.prior_study import (
    STUDY,
    Member,
    evaluate_ensemble,
    evaluate_run,
    exploit_reviews,
    export_ensemble,
    good_reviews,
    line,
    ppo_runs,
)
from lit_rlhf.demo.stages import StageRunner, load_config, name_run
from lit_rlhf.demo.unlabelled import (
    FORCED_SHARE,
    MAX_NEW_TOKENS,
    MIN_NEW_TOKENS,
    N_TEXTS,
    TEMPERATURE,
    unlabelled_texts,
    write_texts,
)
from lit_rlhf.models import ModelSpec, build_score_model, load_tokenizer
from lit_rlhf.modules import WarmupCosineLR

MEMBERS = 3
MAX_LENGTH = 64  # unlabelled texts cut to their last 64 tokens (rm_weak_disagreement_ensemble.yaml's max_length)


def train_ensemble(out: Path, tokenizer, pairs: list[dict], unlabelled: list[str], draw: int, alpha: float,
                   target: float, steps: int) -> list[Member]:  # fmt: skip
    """Three members (seeds 3d..3d+2) trained jointly: each its bootstrap Bradley-Terry loss, plus alpha times
    ``functional.disagreement_loss`` of their scores of the step's pair texts and of 32 unlabelled texts."""
    recipe = load_config("rm_weak", out, small=False)
    init, batch_size = recipe["model"]["init_args"], recipe["data"]["init_args"]["batch_size"]
    eos, seeds = tokenizer.eos_token, [3 * draw + k for k in range(MEMBERS)]
    members = [
        build_score_model(ModelSpec(name_or_path=str(out / "sft"), seed=s), tokenizer).train() for s in seeds
    ]
    params = [p for m in members for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, **init["optimizer"]["init_args"])
    scheduler = WarmupCosineLR(optimizer, total_steps=steps, **init["scheduler"]["init_args"])
    generator = torch.Generator().manual_seed(draw)
    order = torch.randperm(len(pairs), generator=generator).tolist()
    u_order = torch.randperm(len(unlabelled), generator=generator).tolist()
    u_ids = [ids[-MAX_LENGTH:] for ids in tokenizer(unlabelled)["input_ids"]]  # cut as UnlabelledTexts cuts them
    for step in range(steps):
        rows = [order[(step * batch_size + i) % len(order)] for i in range(batch_size)]
        u_rows = [u_order[(step * batch_size + i) % len(u_order)] for i in range(batch_size)]
        texts = [pairs[r]["prompt"] + pairs[r][side] + eos for side in ("chosen", "rejected") for r in rows]
        enc = tokenizer.pad({"input_ids": tokenizer(texts)["input_ids"] + [u_ids[r] for r in u_rows]},
                            return_tensors="pt")  # fmt: skip
        scores = torch.stack([Member(m, None, 0.0)(enc["input_ids"], enc["attention_mask"]) for m in members])
        labelled, free = scores[:, : 2 * batch_size], scores[:, 2 * batch_size :]  # (K, 2B), (K, B)
        chosen, rejected = labelled.chunk(2, dim=1)  # (K, B), (K, B)
        weights = F.poisson_bootstrap_weights(torch.tensor(rows), seeds)  # (K, B)
        loss = sum(
            F.pairwise_reward_loss(chosen[k], rejected[k], weights=weights[k])[0] for k in range(MEMBERS)
        )
        if alpha:
            loss = loss + alpha * F.disagreement_loss(labelled, free, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for m in members:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return [Member(m.eval(), None, 0.0) for m in members]


def module_runs(out: Path, texts: Path, draw: int, alpha: float, target: float, seeds: list[int], threads: int,
                small: bool = False) -> dict:  # fmt: skip
    """The product's path: ``rm_weak_ensemble.yaml`` (``RewardEnsembleModule``, member seeds 3d..3d+2, bootstrap)
    with ``disagreement: {texts, coef: alpha, target}`` fitted with ``lit-rlhf``, then the over-optimisation PPO
    of ``ppo_overoptimize_ensemble.yaml`` against its export (mean - 1 std) per seed, evaluated as the pipeline
    evaluates; returns :func:`lit_rlhf.demo.overoptimization.source_entry` of the final policies."""
    runner, study = StageRunner(out / STUDY), out / STUDY
    name = f"module_disagree{alpha:g}_t{target:g}_draw{draw}"
    rm = name_run(load_config("rm_weak_ensemble", out, small), name, 3 * draw, (), study)
    init = rm["model"]["init_args"]
    init["seeds"] = [3 * draw + k for k in range(MEMBERS)]
    if alpha:
        init["disagreement"] = {"texts": str(texts.resolve()), "coef": alpha, "target": target, "max_length": MAX_LENGTH}
    rm["trainer"]["logger"]["init_args"]["save_dir"] = str(study / "tb")
    runner.fit(name, rm, salt=f"threads={threads}")
    rows = []
    for seed in seeds:
        config = load_config("ppo_overoptimize_ensemble", out, small)
        config["model"]["init_args"]["reward_model"]["ensemble"] = str((study / name).resolve())
        run = f"{name}_t{threads}_seed{seed}"
        config = name_run(config, run, seed, ("rng_seed",), study)
        config["trainer"]["logger"]["init_args"]["save_dir"] = str(study / "tb")
        runner.fit(run, config, (name,), salt=f"threads={threads}")
        rows.append({"seed": seed, "run": run, **evaluate_run(out, config, small)})
    return source_entry(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="a finished demo folder")
    parser.add_argument("--coefs", default="0,1", help="comma-separated disagreement weights alpha (0: none)")
    parser.add_argument("--draws", default="0,1", help="comma-separated draws d (member seeds 3d..3d+2)")
    parser.add_argument("--target", type=float, default=1.0, help="the spread asked for on unlabelled texts")
    parser.add_argument(
        "--temperature", type=float, default=TEMPERATURE, help="sampling temperature of unlabelled texts"
    )
    parser.add_argument("--unlabelled", type=int, default=N_TEXTS, help="unlabelled texts")
    parser.add_argument(
        "--forced-share", type=float, default=FORCED_SHARE, help="share of unlabelled texts made long"
    )
    parser.add_argument(
        "--min-new-tokens", type=int, default=MIN_NEW_TOKENS, help="their length floor in tokens"
    )
    parser.add_argument("--steps", type=int, default=150, help="optimiser steps (rm_weak.yaml: 150)")
    parser.add_argument("--texts", type=int, default=300, help="texts per set (good, exploit, sampled)")
    parser.add_argument("--pairs", type=int, default=2400, help="training pairs (rm_weak.yaml: 2,400)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--ppo-seeds", default="", help="comma-separated seeds of the over-optimisation PPO "
                        "run against each ensemble (default: none); needs --threads")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="the folder is a `--small` pipeline run")
    parser.add_argument("--module", action="store_true", help="train each ensemble with RewardEnsembleModule("
                        "disagreement=...) through lit-rlhf (rm_weak_ensemble.yaml) instead of the study's loop")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        coefs = [float(c) for c in args.coefs.split(",")]
        draws = [int(d) for d in args.draws.split(",")]
        ppo_seeds = [int(s) for s in args.ppo_seeds.split(",")] if args.ppo_seeds else []
    except ValueError:
        parser.error(f"--coefs {args.coefs!r}, --draws {args.draws!r}, --ppo-seeds: comma-separated numbers")
    if not all(map(math.isfinite, [*coefs, args.target, args.temperature, args.forced_share])):
        parser.error("--coefs, --target, --temperature and --forced-share must be finite numbers")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if min(coefs + draws) < 0 or args.target <= 0 or args.temperature <= 0 or not 0 <= args.forced_share <= 1:
        parser.error(
            "--coefs and --draws must be >= 0, --target and --temperature > 0, --forced-share in [0, 1]"
        )
    if min(args.unlabelled, args.steps, args.texts, args.pairs, args.min_new_tokens) < 1:
        parser.error("--unlabelled, --steps, --texts, --pairs and --min-new-tokens must be >= 1")
    if args.min_new_tokens > MAX_NEW_TOKENS:
        parser.error(
            f"--min-new-tokens {args.min_new_tokens}: at most the samples' {MAX_NEW_TOKENS} new tokens"
        )
    if not (args.out / "sft").is_dir() or not (args.out / "report.json").is_file():
        parser.error(f"--out {args.out}: no sft/ or report.json: run the demo pipeline first")
    prompts_path = args.out / "assets" / "prompts_train.jsonl"
    n_prompts = len(evaluate.read_jsonl(prompts_path)) if prompts_path.is_file() else 0
    if args.unlabelled > n_prompts:
        parser.error(f"--unlabelled {args.unlabelled}: at most the {n_prompts} training prompts of {prompts_path}"
                     " (one text per prompt)")  # fmt: skip
    if (ppo_seeds or args.module) and not args.threads:
        parser.error("--ppo-seeds and --module need --threads (the runs depend on it)")
    if args.module and not ppo_seeds:
        parser.error("--module needs --ppo-seeds (what it measures is the PPO runs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(str(args.out / "sft"))
    pairs = evaluate.read_jsonl(args.out / "assets" / "prefs_train.jsonl")[: args.pairs]
    val = evaluate.read_jsonl(args.out / "assets" / "prefs_val.jsonl")
    unlabelled, stats = unlabelled_texts(
        args.out, args.unlabelled, args.temperature, args.forced_share, args.min_new_tokens
    )
    print(f"unlabelled texts: {stats}", flush=True)
    rng = random.Random(0)
    sets = {"good": good_reviews(rng, args.texts), "exploit": exploit_reviews(rng, args.texts),
            "sampled": [world.sample_review(rng) for _ in range(args.texts)]}  # fmt: skip
    texts_path = write_texts(unlabelled, args.out / STUDY / "unlabelled.jsonl")
    results = []
    for draw in draws:
        if args.module:
            for alpha in coefs:
                entry = module_runs(
                    args.out, texts_path, draw, alpha, args.target, ppo_seeds, args.threads, args.small
                )
                results.append(
                    {"draw": draw, "alpha": alpha, "target": args.target, "module": True, "ppo": entry}
                )
                print(table({f"module, alpha {alpha:g}, draw {draw}": entry}, args.threads), flush=True)
            continue
        for alpha in coefs:
            members = train_ensemble(
                args.out, tokenizer, pairs, unlabelled, draw, alpha, args.target, args.steps
            )
            results.append({"draw": draw, "alpha": alpha, "target": args.target, "unlabelled": stats,
                            **evaluate_ensemble(members, tokenizer, sets, val)})  # fmt: skip
            print(line(draw, alpha, results[-1]), flush=True)
            if ppo_seeds:
                name = f"disagree{alpha:g}_t{args.target:g}_f{args.forced_share:g}_draw{draw}"
                export_ensemble(members, tokenizer, args.out / STUDY / name)
                results[-1]["ppo"] = ppo_runs(
                    args.out, args.out / STUDY / name, name, ppo_seeds, args.threads, args.small
                )
                print(table({f"alpha {alpha:g}, draw {draw}": results[-1]["ppo"]}, args.threads), flush=True)
    (args.out / "disagreement_study.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
