"""Every logged value of tiny PPO and critic-free fits, to compare two versions of the online modules.

Runs 9 configurations (PPO-Clip with an adaptive KL, PPO-Penalty, PPO with a shared value head and top-k,
GRPO unpacked and packed, Dr. GRPO with top-p, RLOO with a sequence ratio, REINFORCE++ and its baseline
variant), 3 rollouts and one evaluation each, written in the earlier flat layout of the arguments. With
``--migrate`` they are rewritten into the settings groups first (``modules.online_migration``), so the same
script drives both the code before the settings groups and after. Seeded, one thread.

    git worktree add /tmp/before ddcbf6b
    PYTHONPATH=/tmp/before python scripts/online_equivalence.py --out /tmp/eq/before
    python scripts/online_equivalence.py --out /tmp/eq/after --migrate
    python scripts/online_equivalence.py --compare /tmp/eq/before /tmp/eq/after
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def runs(tok: str) -> dict:
    from conftest import gpt2_config, llama_config
    from ppo_helpers import adamw

    from lit_rlhf.modules import CriticFreeModule, PPOModule

    def base(cfg, **kw):
        d = dict(actor={"config": cfg, "tokenizer": tok, "seed": 0}, reward_fn="ppo_rewards:the_count",
                 monitor_reward_fn="ppo_rewards:the_count", log_samples_every=0, rng_seed=0,
                 actor_optimizer=adamw(1e-2))  # fmt: skip
        return {**d, **kw}

    ppo, cf, critic = PPOModule, CriticFreeModule, adamw(1e-2)
    return {
        "ppo_clip": (ppo, base(gpt2_config(), generation={"max_new_tokens": 8}, ppo_epochs=2, num_minibatches=2,
                               forward_batch_size=4, critic_optimizer=critic, kl_target=1.0, ent_coef=0.01,
                               clip_coef_high=0.3, score_clip=1.5, missing_eos_penalty=0.5)),
        "ppo_penalty": (ppo, base(llama_config(), generation={"max_new_tokens": 8, "num_samples": 2},
                                  policy_loss="kl_penalty", whiten_rewards=True, ppo_epochs=2, num_minibatches=2,
                                  forward_batch_size=4, critic_optimizer=critic, loss_aggregation="seq_mean_token_mean")),
        "ppo_shared": (ppo, base(gpt2_config(), generation={"max_new_tokens": 8, "top_k": 20, "temperature": 0.7},
                                 share_critic_backbone=True, ppo_epochs=1, num_minibatches=1, forward_batch_size=8,
                                 critic_optimizer=critic, ratio_threshold=None, max_grad_norm=None,
                                 whiten_advantages=False, gamma=0.9, gae_lambda=0.8)),
        "grpo": (cf, base(gpt2_config(), advantage_estimator="grpo", generation={"max_new_tokens": 8, "num_samples": 4},
                          ppo_epochs=2, num_minibatches=2, forward_batch_size=8, kl_coef=0.0, kl_loss_coef=0.05,
                          clip_coef_high=0.28, loss_aggregation="seq_mean_token_mean", shared_prefix="off")),
        "grpo_packed": (cf, base(llama_config(), advantage_estimator="grpo",
                                 generation={"max_new_tokens": 8, "num_samples": 4}, ppo_epochs=2, num_minibatches=2,
                                 forward_batch_size=8, kl_coef=0.0, kl_loss_coef=0.05, shared_prefix="on")),
        "dr_grpo": (cf, base(gpt2_config(), advantage_estimator="dr_grpo",
                             generation={"max_new_tokens": 8, "num_samples": 4, "top_p": 0.9}, ppo_epochs=1,
                             num_minibatches=1, forward_batch_size=8, kl_coef=0.0, loss_aggregation="seq_mean_token_sum_norm")),
        "rloo": (cf, base(gpt2_config(), advantage_estimator="rloo", generation={"max_new_tokens": 8, "num_samples": 4},
                          ppo_epochs=2, num_minibatches=2, forward_batch_size=8, kl_coef=0.05, kl_target=2.0,
                          importance_sampling_level="sequence", ent_coef=0.01)),
        "reinforce_pp": (cf, base(llama_config(), advantage_estimator="reinforce_pp",
                                  generation={"max_new_tokens": 8, "num_samples": 1}, ppo_epochs=2, num_minibatches=2,
                                  forward_batch_size=4, kl_coef=0.05, gamma=0.95, kl_estimator="k3")),
        "reinforce_pp_baseline": (cf, base(gpt2_config(), advantage_estimator="reinforce_pp_baseline",
                                           generation={"max_new_tokens": 8, "num_samples": 2}, ppo_epochs=1,
                                           num_minibatches=2, forward_batch_size=8, kl_coef=0.02, score_clip=1.0)),
    }  # fmt: skip


def run(out: Path, migrate: bool, names: list[str] | None) -> None:
    import torch
    from conftest import make_corpus
    from lightning.pytorch import seed_everything
    from ppo_helpers import prompt_loader, trainer

    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    torch.set_num_threads(1)
    tok = str(out / "tokenizer")
    train_bpe_tokenizer(make_corpus(), vocab_size=320).save_pretrained(tok)
    results = {}
    for name, (cls, kwargs) in runs(tok).items():
        if names and name not in names:
            continue
        seed_everything(0)
        if migrate:
            from lit_rlhf.modules.online_migration import migrate_flat_kwargs

            kwargs = migrate_flat_kwargs(cls, kwargs)
        module = cls(**kwargs)
        fit = trainer(out / name, max_epochs=1, limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)
        fit.fit(module, prompt_loader(tok, n=24, batch_size=8), prompt_loader(tok, n=8, batch_size=8))
        (path,) = glob.glob(f"{out / name}/**/metrics.csv", recursive=True)
        results[name] = list(csv.DictReader(open(path)))
    (out / "metrics.json").write_text(json.dumps(results, indent=0))


def compare(before: Path, after: Path) -> int:
    a, b = (json.loads((p / "metrics.json").read_text()) for p in (before, after))
    bad = 0
    for name in a:
        keys = {k for row in a[name] for k, v in row.items() if v != ""}
        new = sorted({k for row in b.get(name, []) for k, v in row.items() if v != ""} - keys)
        diffs = [(k, x.get(k), y.get(k)) for x, y in zip(a[name], b.get(name, [])) for k in keys if x.get(k) != y.get(k)]
        same = len(a[name]) == len(b.get(name, [])) and not diffs
        bad += not same
        print(f"{name:24s} rows {len(a[name])}/{len(b.get(name, []))}  {len(keys)} logged keys  "
              f"{'identical' if same else f'{len(diffs)} differ, e.g. {diffs[:3]}'}  new keys: {new}")  # fmt: skip
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder of this run's metrics")
    parser.add_argument("--migrate", action="store_true", help="rewrite the flat arguments into settings groups")
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.out is None:
        parser.error("--out or --compare is required")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.out, args.migrate, args.only.split(",") if args.only else None)


if __name__ == "__main__":
    main()
