"""One process of the multi-process strategy tests (run under ``torch.distributed.run`` or alone).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py \
        --strategy fsdp2 --tokenizer TOK_DIR --out OUT_DIR [--runs ppo,grpo,dpo] [--resume]
    python tests/distributed_worker.py --strategy single --tokenizer TOK_DIR --out OUT_DIR [--runs ...]

``--runs`` (comma-separated; one launch runs them in turn, each from ``seed_everything(0)``): ``ppo``, a
reward-model fit and PPO fits (full fine-tuning with a separate critic; LoRA with a shared backbone);
``grpo``, a GRPO fit (K = 2 sampled responses per prompt); ``multiturn``, a GRPO fit on episodes that end
at a different turn on each rank; ``posterior``, a GRPO fit against ``--posterior`` (a reward model's
last-layer posterior); ``dpo``, DPO fits (live and precomputed
reference); under ``--resume`` also PPO saved after one rollout and resumed. Every run uses the same
global batch whatever the world size; rank 0 writes ``OUT_DIR/results.json`` with the logged metrics,
the first rollout's greedy responses (keyed by prompt) and the wall time per rollout, after releasing its
process groups; a rank with a gloo worker thread still running then exits non-zero.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).parent))  # ppo_rewards, ppo_helpers, conftest

from conftest import llama_config  # noqa: E402
from ppo_helpers import PROMPTS, adamw  # noqa: E402

from lit_rlhf.data import PreferenceDataModule  # noqa: E402
from lit_rlhf.engines import Responses  # noqa: E402
from lit_rlhf.models import ModelSpec, load_tokenizer  # noqa: E402
from lit_rlhf.modules import (  # noqa: E402
    CriticFreeModule,
    DPOModule,
    PPOModule,
    RewardEnsembleModule,
    RewardModelModule,
)
from lit_rlhf.process_groups import release_process_groups  # noqa: E402
from lit_rlhf.rollout import GenerationSettings  # noqa: E402

GLOBAL_BATCH = 8


class CPUFSDPStrategy(FSDPStrategy):
    """``strategy="fsdp"`` on CPU for tests: Lightning only refuses a CPU accelerator for the exact
    ``FSDPStrategy`` class; the modules wrap their models themselves, so nothing else differs."""


def make_strategy(name: str):
    if name == "ddp":
        return DDPStrategy(find_unused_parameters=True, process_group_backend="gloo")
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    if name == "fsdp1":
        return CPUFSDPStrategy(process_group_backend="gloo")
    return "auto"


def make_trainer(args, run: str, **kwargs) -> Trainer:
    world = 1 if args.strategy == "single" else 2
    return Trainer(
        accelerator="cpu",
        devices=world,
        strategy=make_strategy(args.strategy),
        logger=CSVLogger(args.out, name=run, version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        use_distributed_sampler=kwargs.pop("use_distributed_sampler", False),  # see loader()
        **kwargs,
    )


def read_csv(out: str, run: str) -> list[dict[str, float]]:
    if dist.is_initialized():  # rank 0's logger writes the file as its fit ends: wait for every rank's
        dist.barrier()
    with open(Path(out) / run / "version_0" / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def loader(args, rows: list, **kwargs) -> torch.utils.data.DataLoader:
    """A loader of the per-rank share of a global batch of ``GLOBAL_BATCH`` rows, in a fixed order.

    Lightning's automatic sampler for training shuffles; an unshuffled DistributedSampler gives rank r
    rows r, r+2, ..., so each global batch holds the same rows as the single process's batch.
    """
    if args.strategy == "single":
        return torch.utils.data.DataLoader(rows, batch_size=GLOBAL_BATCH, **kwargs)
    sampler = torch.utils.data.DistributedSampler(rows, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False)
    return torch.utils.data.DataLoader(rows, batch_size=GLOBAL_BATCH // 2, sampler=sampler, **kwargs)


# -- reward model ------------------------------------------------------------------------------------
def preference_loader(args, tok) -> torch.utils.data.DataLoader:
    """24 fixed pairs: 'X good' preferred to 'X bad'; (2B, L) batches, chosen rows first."""
    pairs = [(f"{PROMPTS[i % 8]} good", f"{PROMPTS[i % 8]} {'bad' if i % 3 else 'awful'}") for i in range(24)]
    enc = [[tok(t)["input_ids"] + [tok.eos_token_id] for t in pair] for pair in pairs]
    width = max(len(e) for pair in enc for e in pair)

    def pad(ids):  # right padding: scores are read at the last real token
        return torch.tensor(ids + [tok.pad_token_id] * (width - len(ids))), torch.tensor(
            [1] * len(ids) + [0] * (width - len(ids))
        )

    rows = [dict(zip(("c_ids", "c_mask", "r_ids", "r_mask"), (*pad(c), *pad(r)))) for c, r in enc]

    def collate(batch):
        return {
            "input_ids": torch.cat([torch.stack([b["c_ids"] for b in batch]), torch.stack([b["r_ids"] for b in batch])]),
            "attention_mask": torch.cat(
                [torch.stack([b["c_mask"] for b in batch]), torch.stack([b["r_mask"] for b in batch])]
            ),
        }

    return loader(args, rows, collate_fn=collate)


def run_rm(args, tok) -> dict:
    seed_everything(0)
    module = RewardModelModule(
        ModelSpec(config=llama_config(), tokenizer=args.tokenizer, seed=0), optimizer=adamw(1e-2), scheduler=None
    )
    trainer = make_trainer(args, "rm", max_steps=3)
    trainer.fit(module, preference_loader(args, tok))
    trainer.validate(module, preference_loader(args, tok))  # val/loss: the mean over every rank's pairs
    rows = read_csv(args.out, "rm")
    return {"loss": [r["train/loss"] for r in rows if "train/loss" in r], "val_loss": [r["val/loss"] for r in rows if "val/loss" in r]}


def run_rm_ensemble(args, tok) -> list[float]:
    """Two members, 3 steps, each member's gradient clipped to a norm every step binds (0.05): under DDP the
    clipping reads the reduced gradients, under FSDP2 each member's norm over both ranks' shards."""
    seed_everything(0)
    module = RewardEnsembleModule(
        ModelSpec(config=llama_config(), tokenizer=args.tokenizer), num_members=2, optimizer=adamw(1e-2), scheduler=None
    )
    make_trainer(args, "rm_ensemble", max_steps=3, gradient_clip_val=0.05).fit(module, preference_loader(args, tok))
    return [r["train/loss"] for r in read_csv(args.out, "rm_ensemble") if "train/loss" in r]


# -- PPO ---------------------------------------------------------------------------------------------
def prompt_loader(args, tok) -> torch.utils.data.DataLoader:
    enc = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, enc))
    rows = [
        {
            "input_ids": torch.tensor([tok.pad_token_id] * (width - len(e)) + e),
            "attention_mask": torch.tensor([0] * (width - len(e)) + [1] * len(e)),
        }
        for e in enc
    ]
    return loader(args, rows)


class RecordingPPO(PPOModule):
    """Keeps the first rollout's (prompt, response) token ids."""

    def generate(self, prompts, prompt_mask, settings=None, greedy=False):
        out = super().generate(prompts, prompt_mask, settings, greedy)
        if not hasattr(self, "first_responses"):
            self.first_responses = [
                (p[m.bool()].tolist(), r[rm].tolist()) for p, m, r, rm in zip(prompts, prompt_mask, out.ids, out.mask)
            ]
        return out


class Timer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


def ppo_module(args, lora: bool) -> RecordingPPO:
    # Greedy (top_k=1) rollouts make responses independent of how prompts are split across ranks.
    # Whitening (rewards and advantages) uses the moments of all ranks; token-mean losses are per rank,
    # so runs match the single process exactly when every response has the full length T (asserted by
    # the test).
    # The plain run takes the LM-head route with its fused backward (logits_chunking "on"; FSDP's sharded
    # head falls back to the full logits), the LoRA run the full-logits path.
    lora_cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    chunking = "auto" if lora else "on"
    return RecordingPPO(
        actor=ModelSpec(
            config=llama_config(), tokenizer=args.tokenizer, seed=0, lora=lora_cfg, logits_chunking=chunking
        ),
        reward_fn="ppo_rewards:e_rate",
        share_critic_backbone=lora,
        generation=GenerationSettings(max_new_tokens=6, top_k=1),
        update={"epochs": 2, "num_minibatches": 1},
        scoring={"forward_batch_size": 4},
        advantage={"whiten_rewards": True},  # advantages are whitened by default
        samples={"every": 0},
        actor_optimizer=adamw(1e-2),
        critic_optimizer=adamw(1e-2),
    )


def gather_responses(module: RecordingPPO) -> dict[str, list[int]]:
    rows = module.first_responses
    if dist.is_initialized():
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, rows)
        rows = [row for part in parts for row in part]
    return {" ".join(map(str, p)): r for p, r in rows}


PPO_KEYS = ("ppo/policy_loss", "ppo/value_loss", "rollout/score", "rollout/kl_ref", "rollout/response_length")


def ppo_rows(args, run: str) -> dict[str, list[float]]:
    rows = [r for r in read_csv(args.out, run) if "ppo/policy_loss" in r]
    return {key: [r[key] for r in rows] for key in PPO_KEYS}


def run_ppo(args, tok, run: str, lora: bool) -> dict:
    seed_everything(0)
    module, timer = ppo_module(args, lora), Timer()
    make_trainer(args, run, max_epochs=3, callbacks=[timer]).fit(module, prompt_loader(args, tok))
    module.export_pretrained(str(Path(args.out) / f"{run}_export"))
    return {"metrics": ppo_rows(args, run), "responses": gather_responses(module), "seconds": timer.times}


def run_resume(args, tok) -> dict:
    """One rollout, a (sharded under FSDP2) checkpoint, then a new process state resumed to three."""
    ckpt = str(Path(args.out) / "resume.ckpt")
    seed_everything(0)
    module = ppo_module(args, lora=False)
    trainer = make_trainer(args, "resume_a", max_epochs=1)
    trainer.fit(module, prompt_loader(args, tok))
    trainer.save_checkpoint(ckpt)
    seed_everything(0)
    module = ppo_module(args, lora=False)
    make_trainer(args, "resume_b", max_epochs=3).fit(module, prompt_loader(args, tok), ckpt_path=ckpt)
    return {"first": ppo_rows(args, "resume_a"), "rest": ppo_rows(args, "resume_b"), "sharded": Path(ckpt).is_dir()}


# -- GRPO --------------------------------------------------------------------------------------------
class RowSeededGRPO(CriticFreeModule):
    """GRPO whose responses do not depend on how the rows are split across ranks.

    K >= 2 responses to one prompt must differ, so the greedy decoding of the PPO runs cannot be used;
    instead each row is sampled alone with a seed made of its prompt, its copy index and the rollout
    number. Responses then end at different lengths, so the run uses per-response means
    (``seq_mean_token_mean``): a mean over equal numbers of rows per rank equals the global one.
    """

    def generate(self, prompts, prompt_mask, settings=None, greedy=False):
        rows = []
        for i in range(prompts.shape[0]):
            seed = int(prompts[i][prompt_mask[i].bool()].sum()) * 1009 + (i % self.num_samples) * 101
            with torch.random.fork_rng():
                torch.manual_seed(seed + self.rollouts_done)
                rows.append(super().generate(prompts[i : i + 1], prompt_mask[i : i + 1], settings, greedy))
        return cat_responses(rows, self.tokenizer.pad_token_id)


def cat_responses(rows: list[Responses], pad: int) -> Responses:
    """The rows' ``Responses`` as one batch, each right-padded to the widest (ids with ``pad``, the masks
    and log-probs with 0); a field None in any row is None."""
    width = max(r.ids.shape[1] for r in rows)

    def cat(name: str, value: float = 0):
        parts = [getattr(r, name) for r in rows]
        if any(part is None for part in parts):
            return None
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts])

    return Responses(
        cat("ids", pad), cat("mask"), torch.cat([r.truncated for r in rows]),
        cat("logprobs"), cat("log_kept_mass"), cat("loss_mask"),
    )  # fmt: skip


GRPO_KEYS = (
    "policy/policy_loss", "policy/kl_loss", "rollout/score", "rollout/kl_ref", "rollout/response_length",
    "rollout/group_score_std", "rollout/group_all_equal_frac", "policy/kl_coef",
)  # fmt: skip


def grpo_module(args, samples: dict | None = None, cls: type = None, **extra) -> RowSeededGRPO:
    """The GRPO of these tests (K = 2); ``samples``: its sample-table settings (default: none); ``cls``:
    another module class (default RowSeededGRPO), ``extra``: more arguments (or another ``reward_fn``)."""
    return (cls or RowSeededGRPO)(**{"reward_fn": "ppo_rewards:e_rate", **extra},
        actor=ModelSpec(config=llama_config(), tokenizer=args.tokenizer, seed=0),
        generation=GenerationSettings(max_new_tokens=6, num_samples=2),
        update={"epochs": 2, "num_minibatches": 1, "loss_aggregation": "seq_mean_token_mean"},
        scoring={"forward_batch_size": 4},
        kl={"coef": 0.05, "target": 1.0, "loss_coef": 0.05},
        samples=samples or {"every": 0},
        actor_optimizer=adamw(1e-2),
    )


def run_grpo(args, tok) -> dict:
    seed_everything(0)
    module = grpo_module(args)
    make_trainer(args, "grpo", max_epochs=3).fit(module, prompt_loader(args, tok))
    rows = [r for r in read_csv(args.out, "grpo") if "policy/policy_loss" in r]
    return {"metrics": {key: [r[key] for r in rows] for key in GRPO_KEYS}}


def run_multiturn(args, tok) -> dict:
    """GRPO on episodes that last 1 turn on rank 0 and 2 on rank 1 (``ppo_rewards:RankTurns``): rank 0 keeps
    generating (dummy turns) while rank 1's episodes go on, so the collective generation never hangs."""
    seed_everything(0)
    # the plain module: RowSeededGRPO generates row by row, as many calls as a rank has running episodes
    module = grpo_module(args, cls=CriticFreeModule, environment={"env": "ppo_rewards:RankTurns", "max_turns": 3})
    make_trainer(args, "multiturn", max_epochs=1).fit(module, prompt_loader(args, tok))
    rows = [r for r in read_csv(args.out, "multiturn") if "rollout/turns" in r]
    return {"turns": [r["rollout/turns"] for r in rows]}


POSTERIOR_KEYS = ("rollout/score", "rollout/reward/score", "rollout/reward/uncertainty", "policy/policy_loss")


def run_posterior(args, tok) -> dict:
    """GRPO against ``--posterior``, a reward model's last-layer posterior (its score less one spread): the reward
    model is sharded with the actor, and the spread is read from its head's input on each rank's own rows."""
    seed_everything(0)
    module = grpo_module(args, reward_fn=None, reward_model={"posterior": args.posterior, "coef": 1.0})
    make_trainer(args, "posterior", max_epochs=2).fit(module, prompt_loader(args, tok))
    rows = [r for r in read_csv(args.out, "posterior") if "rollout/reward/uncertainty" in r]
    return {"metrics": {key: [r[key] for r in rows] for key in POSTERIOR_KEYS}}


# -- DPO ---------------------------------------------------------------------------------------------
def dpo_data(args, rows: int = 24) -> PreferenceDataModule:
    """24 pairs ('X good ...' over 'X bad ...') through PreferenceDataModule: its ResumableSampler gives
    rank r positions r, r+2, ... of one seeded permutation, so a per-rank batch of GLOBAL_BATCH / 2 pairs
    makes the same global batches as the single process's GLOBAL_BATCH."""
    path = Path(args.out) / f"dpo_pairs_{rows}_{os.environ.get('RANK', '0')}.jsonl"  # one writer per file
    with path.open("w") as f:
        for i in range(rows):
            row = {"prompt": PROMPTS[i % 8], "chosen": " good" * (1 + i % 3), "rejected": " bad" * (1 + i % 2)}
            f.write(json.dumps(row) + "\n")
    world = 1 if args.strategy == "single" else 2
    return PreferenceDataModule(
        args.tokenizer, str(path), val_path=str(path), max_length=32, max_prompt_length=16,
        batch_size=GLOBAL_BATCH // world, val_batch_size=GLOBAL_BATCH // world,
    )  # fmt: skip


def run_dpo(args, run: str, precompute: bool) -> dict:
    seed_everything(0)
    module = DPOModule(
        ModelSpec(config=llama_config(), tokenizer=args.tokenizer, seed=0),
        beta=0.5,
        precompute_ref_logprobs=precompute,
        optimizer=adamw(1e-2),
        scheduler=None,
        num_samples=2,
        sample_max_new_tokens=4,
    )
    make_trainer(args, run, max_steps=3, num_sanity_val_steps=0).fit(module, dpo_data(args))
    module.export_pretrained(str(Path(args.out) / f"{run}_export"))
    rows = read_csv(args.out, run)
    result = {key: [r[key] for r in rows if key in r] for key in ("train/loss", "train/rewards/margins", "val/loss")}
    if not precompute:
        # 23 held-out pairs with Lightning's distributed sampler: 12 and 11 per rank, no pair counted twice
        make_trainer(args, f"{run}_val23", use_distributed_sampler=True).validate(module, dpo_data(args, rows=23))
        rows = read_csv(args.out, f"{run}_val23")
        result["val23"] = [rows[-1]["val/loss"], rows[-1]["val/rewards/accuracies"], rows[-1]["val/rewards/margins"]]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp2", "fsdp1"], required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--runs", default="ppo", help="comma-separated, in this order: ppo (RM + PPO runs), grpo,"
                        " multiturn, posterior, dpo")
    parser.add_argument("--posterior", help="a lit_rlhf.posterior folder (the posterior run's reward model)")
    args = parser.parse_args()
    runs = args.runs.split(",")
    if not runs or not set(runs) <= {"ppo", "grpo", "dpo", "multiturn", "posterior"}:
        parser.error(f"--runs: a comma-separated list of ppo, grpo, dpo, multiturn, posterior, got {args.runs!r}")
    if "posterior" in runs and not args.posterior:
        parser.error("--runs posterior needs --posterior")
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = load_tokenizer(args.tokenizer)
    results: dict = {}
    if "ppo" in runs:
        results["rm"] = run_rm(args, tok)
        if args.strategy != "fsdp1":  # FSDP1 clips the members' joint norm (RewardEnsembleModule)
            results["rm_ensemble"] = run_rm_ensemble(args, tok)
        results["ppo"] = run_ppo(args, tok, "ppo", lora=False)
        results["ppo_lora"] = run_ppo(args, tok, "ppo_lora", lora=True)
    if "grpo" in runs:
        results["grpo"] = run_grpo(args, tok)
    if "multiturn" in runs:
        results["multiturn"] = run_multiturn(args, tok)
    if "posterior" in runs:
        results["posterior"] = run_posterior(args, tok)
    if "dpo" in runs:
        results["dpo"] = run_dpo(args, "dpo", False)
        results["dpo_precomputed"] = run_dpo(args, "dpo_pre", True)
    if args.resume and "ppo" in runs:
        results["resume"] = run_resume(args, tok)
    rank = dist.get_rank() if dist.is_initialized() else 0
    # the groups destroyed and gloo's threads joined before the interpreter exits (see lit_rlhf.process_groups)
    if release_process_groups():
        sys.exit(f"rank {rank}: gloo worker threads still running after release_process_groups()")
    if rank == 0:
        (Path(args.out) / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
