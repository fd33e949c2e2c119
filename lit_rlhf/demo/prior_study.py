"""Do randomized prior functions make the weak reward models disagree on the demo world's exploit?

``python -m lit_rlhf.demo.prior_study --out runs/demo --betas 0,2,5 --draws 0,1,2,3 --threads 1`` reads a
finished demo folder (its SFT backbone and pairs) and, per draw d and prior scale beta, trains a three-member
ensemble with the weak RM's recipe (``configs/demo/rm_weak.yaml``: its first 2,400 pairs, 150 steps of 32,
AdamW and warm-up cosine schedule, gradient clipping 1.0), each member on its own Poisson bootstrap
resample (``functional.poisson_bootstrap_weights``). With beta > 0 each member is a *randomized prior
function* (Osband et al. 2018, arXiv:1806.03335, sec. 3): its score is ``f_k(x) + beta * p_k(x)``, ``f_k``
the SFT backbone with a fresh head (trained), ``p_k`` a frozen randomly initialised network of the same
architecture, scaled to unit standard deviation over the training texts. The prior is meant to make the
members extrapolate apart where no pair constrains them, so that mean - std (Coste et al. 2024,
arXiv:2310.02743) falls there. Draw d uses member seeds 3d..3d+2 for every beta (paired comparisons).

Each ensemble scores three sets of texts (whole sequences plus EOS, as the members score rollouts): ``good``,
grammatical reviews of gold >= 6 from the world's sampling distribution; ``exploit``, the policies' exploit
of the weak RM (a prompt and 4-8 positive predicates joined by "and", which the grammar forbids: gold -6);
``sampled``, reviews from the sampling distribution. Printed per (draw, beta): each member's and the
aggregate's gold accuracy on the held-out pairs, each set's mean / spread (``functional.ensemble_std``) /
mean - spread, and P(good > exploit), the share of (good, exploit) text pairs that mean - k std orders
rightly (k = 1, 2). Written to ``OUT/prior_study.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from lit_rlhf import functional as F
from lit_rlhf.demo import evaluate, world
from lit_rlhf.demo.aggregation_study import table
from lit_rlhf.demo.assets import gold_accuracy
from lit_rlhf.demo.overoptimization import final_policy, source_entry
from lit_rlhf.demo.stages import StageRunner, export_dir, load_config, name_run
from lit_rlhf.models import ModelSpec, build_score_model, load_tokenizer, sequence_scores
from lit_rlhf.modules import WarmupCosineLR

STUDY = "prior_study"
MANIFEST = "prior_ensemble.json"
PRIOR_SEED_OFFSET = 1000  # member seed s has prior seed 1000 + s
EXPLOIT_PREDICATES = (4, 8)  # the exploit's number of "and <positive predicate>" clauses, inclusive
GOOD_MIN_GOLD = 6.0
COEFS = (1.0, 2.0)


def exploit_reviews(rng: random.Random, n: int) -> list[str]:
    """``n`` texts of the weak RM's exploit: a prompt, then 4..8 ``and [intensifier] <positive adjective>``
    clauses (more than the grammar's three opinions, so ungrammatical: gold -6)."""
    positive = [w for w, s in world.ADJECTIVES.items() if s > 0]
    texts = []
    for i in range(n):
        count = EXPLOIT_PREDICATES[0] + i % (EXPLOIT_PREDICATES[1] - EXPLOIT_PREDICATES[0] + 1)
        words = []
        for _ in range(count):
            intensifier = rng.choice(["", *world.INTENSIFIERS])
            words += ["and", *([intensifier] if intensifier else []), rng.choice(positive)]
        texts.append(world.sample_prompt(rng) + " " + " ".join(words) + ".")
    return texts


def good_reviews(rng: random.Random, n: int, min_gold: float = GOOD_MIN_GOLD) -> list[str]:
    """``n`` grammatical reviews of the sampling distribution with gold >= ``min_gold``."""
    texts: list[str] = []
    while len(texts) < n:
        review = world.sample_review(rng)
        if world.gold_reward(review) >= min_gold:
            texts.append(review)
    return texts


def ordered_share(good: torch.Tensor, exploit: torch.Tensor) -> float:
    """Share of the (good, exploit) pairs of (G,) and (E,) scores with the good text scored strictly higher."""
    return (good[:, None] > exploit[None, :]).float().mean().item()  # (G, E) -> scalar


class Member(torch.nn.Module):
    """One ensemble member: ``f(x) + beta * p(x)``, ``f`` trained, ``p`` a frozen random network (beta 0: f)."""

    def __init__(self, f: torch.nn.Module, prior: torch.nn.Module | None, beta: float) -> None:
        super().__init__()
        self.f, self.prior, self.beta = f, prior, beta

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        scores = sequence_scores(self.f, input_ids, attention_mask)  # (B,)
        if self.beta:
            with torch.no_grad():
                prior = sequence_scores(self.prior, input_ids, attention_mask)  # (B,)
            scores = scores + self.beta * prior
        return scores


def random_prior(backbone: str, tokenizer, seed: int, texts: list[str]) -> torch.nn.Module:
    """A frozen score model of ``backbone``'s architecture, random weights (``seed``), unit std on ``texts``."""
    config = AutoConfig.from_pretrained(backbone).to_dict()
    prior = (
        build_score_model(ModelSpec(config=config, tokenizer=backbone, seed=seed), tokenizer)
        .eval()
        .requires_grad_(False)
    )
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        prior.score.weight.div_(sequence_scores(prior, enc["input_ids"], enc["attention_mask"]).std())
    return prior


def train_member(out: Path, tokenizer, pairs: list[dict], seed: int, beta: float, steps: int) -> Member:
    """One member trained with the weak RM's recipe on its bootstrap resample of ``pairs`` (see the module)."""
    recipe = load_config("rm_weak", out, small=False)
    init, batch_size = recipe["model"]["init_args"], recipe["data"]["init_args"]["batch_size"]
    eos = tokenizer.eos_token
    f = build_score_model(ModelSpec(name_or_path=str(out / "sft"), seed=seed), tokenizer).train()
    texts = [p["prompt"] + p["chosen"] + eos for p in pairs[:512]]
    member = Member(
        f, random_prior(str(out / "sft"), tokenizer, PRIOR_SEED_OFFSET + seed, texts) if beta else None, beta
    )
    optimizer = torch.optim.AdamW(f.parameters(), **init["optimizer"]["init_args"])
    scheduler = WarmupCosineLR(optimizer, total_steps=steps, **init["scheduler"]["init_args"])
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    for step in range(steps):
        rows = [order[(step * batch_size + i) % len(order)] for i in range(batch_size)]
        texts = [pairs[r]["prompt"] + pairs[r][side] + eos for side in ("chosen", "rejected") for r in rows]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        chosen, rejected = member(enc["input_ids"], enc["attention_mask"]).chunk(2)  # (B,), (B,)
        weights = F.poisson_bootstrap_weights(torch.tensor(rows), [seed])[0]  # (B,)
        loss, _ = F.pairwise_reward_loss(chosen, rejected, weights=weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(f.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return member.eval()


def scores(members: list[Member], tokenizer, texts: list[str], batch_size: int = 256) -> torch.Tensor:
    """(K, N) scores of the N whole ``texts`` by each member."""
    batches = [tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
               for i in range(0, len(texts), batch_size)]  # fmt: skip
    with torch.no_grad():
        return torch.stack(
            [torch.cat([m(b["input_ids"], b["attention_mask"]) for b in batches]) for m in members]
        )


def evaluate_ensemble(members: list[Member], tokenizer, sets: dict[str, list[str]], val: list[dict]) -> dict:
    """The figures of one ensemble (see the module docstring)."""
    eos = tokenizer.eos_token
    chosen = scores(members, tokenizer, [r["prompt"] + r["chosen"] + eos for r in val])  # (K, N)
    rejected = scores(members, tokenizer, [r["prompt"] + r["rejected"] + eos for r in val])  # (K, N)
    gold = ([r["gold_chosen"] for r in val], [r["gold_rejected"] for r in val])
    result: dict = {"member_accuracy": [gold_accuracy(c, r, *gold) for c, r in zip(chosen, rejected)]}
    for coef in COEFS:
        agg = [F.aggregate_ensemble(s, "mean_minus_std", coef) for s in (chosen, rejected)]  # 2 x (N,)
        result[f"accuracy_mean_minus_{coef:g}std"] = gold_accuracy(*agg, *gold)
    by_set = {
        name: scores(members, tokenizer, [t + eos for t in texts]) for name, texts in sets.items()
    }  # name -> (K, N)
    for name, s in by_set.items():
        result[name] = {"mean": F.aggregate_ensemble(s, "mean").mean().item(), "spread": F.ensemble_std(s).mean().item(),
                        "mean_minus_spread": F.aggregate_ensemble(s, "mean_minus_std", 1.0).mean().item()}  # fmt: skip
    for coef in COEFS:
        good, exploit = (F.aggregate_ensemble(by_set[n], "mean_minus_std", coef) for n in ("good", "exploit"))
        result[f"p_good_over_exploit_{coef:g}std"] = ordered_share(good, exploit)
    return result


def export_ensemble(members: list[Member], tokenizer, folder: Path) -> Path:
    """Write each member's ``f`` (and ``prior``) as Hugging Face folders under ``folder/member_<k>/`` and
    ``folder/prior_ensemble.json`` (the members and beta): what :func:`prior_ensemble_reward` loads."""
    entries = []
    for k, member in enumerate(members):
        entry = {}
        for part in ("f", "prior"):
            model = getattr(member, part)
            if model is not None:
                entry[part] = str((folder / f"member_{k}" / part).resolve())
                model.save_pretrained(entry[part])
                tokenizer.save_pretrained(entry[part])
        entries.append(entry)
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"beta": members[0].beta, "members": entries}, indent=1) + "\n")
    return manifest


@functools.cache
def load_ensemble(folder: str) -> tuple[list[Member], Any]:
    """The members of an :func:`export_ensemble` folder (loaded once per process) and their tokenizer."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    tokenizer = load_tokenizer(manifest["members"][0]["f"])
    members = []
    for entry in manifest["members"]:
        f, prior = (build_score_model(ModelSpec(name_or_path=entry[part]), tokenizer).eval() if part in entry else None
                    for part in ("f", "prior"))  # fmt: skip
        members.append(Member(f, prior, manifest["beta"]).eval())
    return members, tokenizer


def prior_ensemble_reward(
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    folder: str,
    coef: float = 1.0,
) -> list[float]:
    """Reward function (TRL's keyword form, see ``lit_rlhf.reward_fns``) of an exported prior ensemble: mean -
    ``coef`` std of its members' scores of prompt + completion (+ EOS where the completion stopped at one)."""
    members, tokenizer = load_ensemble(folder)
    eos = tokenizer.eos_token_id
    texts = [p + r + (tokenizer.eos_token if ids and ids[-1] == eos else "")
             for p, r, ids in zip(prompts, completions, completion_ids)]  # fmt: skip
    return F.aggregate_ensemble(scores(members, tokenizer, texts), "mean_minus_std", coef).tolist()  # (N,)


def evaluate_run(out: Path, config: dict, small: bool = False) -> dict:
    """The over-optimisation run of ``config``'s final policy evaluated as the pipeline evaluates it (the held-out
    prompts, the single weak RM as proxy): :func:`lit_rlhf.demo.overoptimization.final_policy` against the SFT
    policy of ``OUT/report.json``."""
    from lit_rlhf.rollout import GenerationSettings

    report = json.loads((out / "report.json").read_text())
    sft = {"gold_mean": report["sft_gold_mean"], "gold_std": report["sft_gold_std"]}
    prompts = [r["prompt"] for r in evaluate.read_jsonl(out / "assets" / "prompts_eval.jsonl")]
    generation = GenerationSettings(
        max_new_tokens=evaluate.EVAL_MAX_NEW_TOKENS, temperature=evaluate.EVAL_TEMPERATURE
    )
    samples = evaluate.sample_policy(Path(export_dir(config)) / "actor", prompts, generation,
                                     reference_dir=out / "sft", reward_model_dir=out / "rm_weak",
                                     batch_size=64 if small else 256)  # fmt: skip
    return final_policy(evaluate.summarize(samples), sft)


def ppo_runs(out: Path, folder: Path, name: str, seeds: list[int], threads: int, small: bool = False) -> dict:
    """The ``--ensemble`` over-optimisation PPO (``ppo_overoptimize_ensemble.yaml``) with the exported ensemble
    in ``folder`` as its reward (mean - 1 std, critic from member 0's ``f``), once per seed, evaluated as the
    pipeline evaluates it: :func:`lit_rlhf.demo.overoptimization.source_entry` of the final policies."""
    runner, rows = StageRunner(out / STUDY), []
    for seed in seeds:
        config = load_config("ppo_overoptimize_ensemble", out, small)
        init = config["model"]["init_args"]
        del init["reward_model"]
        init["reward_fn"] = [{"fn": f"{__name__}:prior_ensemble_reward", "name": "prior_ensemble",
                              "kwargs": {"folder": str(folder.resolve()), "coef": 1.0}}]  # fmt: skip
        init["critic"] = {"name_or_path": str((folder / "member_0" / "f").resolve())}
        run = f"{name}_t{threads}_seed{seed}"
        config = name_run(config, run, seed, ("rng_seed",), out / STUDY)
        config["trainer"]["logger"]["init_args"]["save_dir"] = str(out / STUDY / "tb")
        runner.fit(run, config, salt=f"threads={threads}")
        rows.append({"seed": seed, "run": run, **evaluate_run(out, config, small)})
    return source_entry(rows)


def line(draw: int, beta: float, r: dict) -> str:
    sets = "; ".join(f"{n} {r[n]['mean']:+.2f} / {r[n]['spread']:.2f} / {r[n]['mean_minus_spread']:+.2f}"
                     for n in ("good", "exploit", "sampled"))  # fmt: skip
    accuracy = " ".join(f"{a:.3f}" for a in r["member_accuracy"])
    return (f"| {draw} | {beta:g} | {accuracy} | {r['accuracy_mean_minus_1std']:.3f} | {sets} | "
            f"{r['exploit']['spread'] / r['good']['spread']:.2f} | {r['p_good_over_exploit_1std']:.3f} | "
            f"{r['p_good_over_exploit_2std']:.3f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="a finished demo folder")
    parser.add_argument("--betas", default="0,2,5", help="comma-separated prior scales (0: no prior)")
    parser.add_argument("--draws", default="0,1,2,3", help="comma-separated draws d (member seeds 3d..3d+2)")
    parser.add_argument(
        "--steps", type=int, default=150, help="optimiser steps per member (rm_weak.yaml: 150)"
    )
    parser.add_argument("--texts", type=int, default=300, help="texts per set (good, exploit, sampled)")
    parser.add_argument("--pairs", type=int, default=2400, help="training pairs (rm_weak.yaml: 2,400)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--ppo-seeds", default="", help="comma-separated training seeds of the over-optimisation "
                        "PPO run against each ensemble (default: none); needs --threads and an --ensemble demo folder")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="the folder is a `--small` pipeline run")
    args = parser.parse_args(argv)
    try:
        betas = [float(b) for b in args.betas.split(",")]
        draws = [int(d) for d in args.draws.split(",")]
        ppo_seeds = [int(d) for d in args.ppo_seeds.split(",")] if args.ppo_seeds else []
    except ValueError:
        parser.error(
            f"--betas {args.betas!r} must be numbers and --draws {args.draws!r} integers, comma-separated"
        )
    if any(b < 0 for b in betas) or any(d < 0 for d in draws) or min(args.steps, args.texts, args.pairs) < 1:
        parser.error("--betas and --draws must be >= 0; --steps, --texts and --pairs >= 1")
    assets = args.out / "assets"
    if not (args.out / "sft").is_dir() or not (assets / "prefs_train.jsonl").is_file():
        parser.error(f"--out {args.out}: no sft/ or assets/prefs_train.jsonl: run the demo pipeline first")
    if ppo_seeds and (not args.threads or not (args.out / "report.json").is_file()):
        parser.error(
            "--ppo-seeds needs --threads (the runs depend on it) and the demo's report.json in --out"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(str(args.out / "sft"))
    pairs = evaluate.read_jsonl(assets / "prefs_train.jsonl")[: args.pairs]
    val = evaluate.read_jsonl(assets / "prefs_val.jsonl")
    rng = random.Random(0)
    sets = {"good": good_reviews(rng, args.texts), "exploit": exploit_reviews(rng, args.texts),
            "sampled": [world.sample_review(rng) for _ in range(args.texts)]}  # fmt: skip
    print(
        "| draw | beta | member gold accuracy | mean - std accuracy | good; exploit; sampled: mean / spread / "
        "mean - spread | spread exploit / good | P(good > exploit), 1 std | 2 std |\n|---|---|---|---|---|---|---|---|"
    )
    results = []
    for draw in draws:
        for beta in betas:
            members = [
                train_member(args.out, tokenizer, pairs, 3 * draw + k, beta, args.steps) for k in range(3)
            ]
            results.append({"draw": draw, "beta": beta, **evaluate_ensemble(members, tokenizer, sets, val)})
            print(line(draw, beta, results[-1]), flush=True)
            if ppo_seeds:
                name = f"beta{beta:g}_draw{draw}"
                export_ensemble(members, tokenizer, args.out / STUDY / name)
                results[-1]["ppo"] = ppo_runs(
                    args.out, args.out / STUDY / name, name, ppo_seeds, args.threads
                )
    for r in results:
        if "ppo" in r:
            print(table({f"beta {r['beta']:g}, draw {r['draw']}": r["ppo"]}, args.threads))
    (args.out / "prior_study.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
