"""GPU check: an RM fit and a few PPO rollouts of a ~0.5B random-init Llama-style model, bf16, FSDP2.

    python scripts/gpu_check.py                # every visible GPU, one process each (Lightning launches them)
    python scripts/gpu_check.py --tiny         # CPU smoke run of the same code path (tiny model, 1 process)
    python scripts/gpu_check.py --vllm         # GRPO with the vLLM engine instead (1 GPU; the vllm extra)
    python scripts/gpu_check.py --vllm --tiny  # its CPU smoke run (in .venv-vllm)

Prints time per rollout, generation tokens/s, update tokens/s (tokens through forward+backward of the
PPO update) and peak GPU memory, summed or maxed over ranks. With ``--vllm``: GRPO for a few rollouts with
responses from the vLLM engine (bf16 weights in vLLM, the trainer's bf16 actor), printing the trainer-vs-engine
log-prob mismatch and importance ratios, the weight-sync time and generation tokens/s. Needs no network: the tokenizer is trained
locally and the data are random token ids (the figures measure speed, not learning). Never run by tests.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_rlhf.models import ModelSpec, train_bpe_tokenizer
from lit_rlhf.modules import CriticFreeModule, PPOModule, RewardModelModule
from lit_rlhf.rollout import GenerationSettings

LLAMA_05B = dict(
    model_type="llama", hidden_size=1280, intermediate_size=3456, num_hidden_layers=24,
    num_attention_heads=20, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
)  # fmt: skip
LLAMA_TINY_VLLM = dict(  # head dim 32: vLLM's CPU attention refuses smaller ones
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, vocab_size=512, max_position_embeddings=256,
)  # fmt: skip
LLAMA_TINY = dict(
    model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
)  # fmt: skip


def local_tokenizer(folder: str) -> str:
    words = "the a food service movie plot staff room was is not very good bad great awful fine and but".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    train_bpe_tokenizer(corpus, vocab_size=300).save_pretrained(folder)
    return folder


def random_rows(n: int, length: int, vocab: int, left_pad: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random token ids (never the special ids 0-3) with ``left_pad`` padded columns on the left."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, vocab, (length,), generator=g)
        mask = torch.ones(length, dtype=torch.long)
        mask[:left_pad] = 0
        rows.append({"input_ids": ids, "attention_mask": mask})
    return rows


def pair_collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Two halves of a batch of sequences as (chosen, rejected): the (2B, L) layout of the RM."""
    ids = torch.stack([b["input_ids"] for b in batch])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class Timed:
    """An online module mixin that measures its generation and update phases (PPO and GRPO below)."""

    def on_train_start(self) -> None:
        self.times = {"rollout": [], "generate": [], "update": []}
        self.tokens = {"generate": 0, "update": 0}

    def training_step(self, batch, batch_idx):
        start = time.perf_counter()
        super().training_step(batch, batch_idx)
        self.times["rollout"].append(time.perf_counter() - start)

    def generate(self, prompts, prompt_mask, settings=None, greedy=False):
        start = time.perf_counter()
        out = super().generate(prompts, prompt_mask, settings, greedy)
        self.times["generate"].append(time.perf_counter() - start)
        self.tokens["generate"] += int(out.mask.sum())
        self._rollout_tokens = int(prompt_mask.sum() + out.mask.sum())
        return out

    def run_update_epochs(self, loss_fn, optimized):
        start = time.perf_counter()
        kl = super().run_update_epochs(loss_fn, optimized)
        self.times["update"].append(time.perf_counter() - start)
        self.tokens["update"] += self._rollout_tokens * self.update.epochs
        return kl


class TimedPPO(Timed, PPOModule):
    pass


class TimedGRPO(Timed, CriticFreeModule):
    pass


def trainer(args, **kwargs) -> Trainer:
    n = 1 if args.tiny else torch.cuda.device_count()
    return Trainer(
        accelerator="cpu" if args.tiny else "gpu",
        devices=n,
        strategy=ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def reduce(module, value: float, op: str) -> float:
    t = torch.tensor(float(value), device=module.device)
    return float(module.trainer.strategy.reduce(t, reduce_op="sum") if op == "sum" else module.all_gather(t).max())


class Last(Callback):
    """Keeps the logged metrics of every rollout."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.rows = [*getattr(module, "rows", []), {k: float(v) for k, v in trainer.callback_metrics.items()}]


def vllm_check(args, spec: ModelSpec, vocab: int, prompt_len: int, new_tokens: int, batch: int) -> None:
    """GRPO (K = 4) with the vLLM engine on one device: mismatch, sync time and generation speed."""
    from lit_rlhf.engines.vllm import VLLMEngine

    engine = VLLMEngine(dtype="bfloat16", gpu_memory_utilization=0.3, kv_cache_gib=1 if args.tiny else None)
    grpo = TimedGRPO(
        actor=spec, reward_fn="gpu_check:token_share", engine=engine,
        generation=GenerationSettings(max_new_tokens=new_tokens, num_samples=4),
        update={"epochs": 1, "num_minibatches": 2}, scoring={"forward_batch_size": batch},
        samples={"every": 0}, max_rollouts=args.rollouts,
    )  # fmt: skip
    prompts = random_rows(batch // 4 * args.rollouts, prompt_len, vocab)
    accelerator = "cpu" if args.tiny else "gpu"
    Trainer(accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=1, callbacks=[Last()]).fit(
        grpo, torch.utils.data.DataLoader(prompts, batch_size=batch // 4))  # fmt: skip
    rows = grpo.rows[1:] or grpo.rows
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    n_params = sum(p.numel() for p in grpo.actor.parameters())
    print(f"\n== gpu_check --vllm: {n_params / 1e6:.1f}M-parameter Llama, bf16, vLLM engine on 1 {accelerator}")
    print(f"generation:         {grpo.tokens['generate'] / sum(grpo.times['generate']):,.0f} tokens/s")
    print(f"weight sync:        {mean('rollout/engine_sync_s'):.3f} s per update (mean after the first rollout)")
    print(f"log-prob mismatch:  mean {mean('rollout/logprob_diff_mean'):.2e}, max {max(r['rollout/logprob_diff_max'] for r in rows):.2e} nats")
    print(f"IS ratio:           mean {mean('rollout/is_ratio_mean'):.4f}, min {min(r['rollout/is_ratio_min'] for r in rows):.4f}, "
          f"max {max(r['rollout/is_ratio_max'] for r in rows):.4f}; ESS {mean('rollout/is_ess'):.4f}")  # fmt: skip
    print(f"time per rollout:   {sum(grpo.times['rollout'][1:]) / max(len(grpo.times['rollout']) - 1, 1):.2f} s")


def token_share(prompts: list[str], responses: list[str]) -> list[float]:
    """A rule reward for the vLLM check: the share of "a" characters (the figures measure speed)."""
    return [r.count("a") / max(len(r), 1) for r in responses]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--tokenizer", default=os.path.join(tempfile.gettempdir(), "lit_rlhf_gpu_check_tok"))
    parser.add_argument("--vllm", action="store_true", help="GRPO with the vLLM engine (one device)")
    args = parser.parse_args()
    cfg = (LLAMA_TINY_VLLM if args.vllm else LLAMA_TINY) if args.tiny else LLAMA_05B
    seq, prompt_len, new_tokens, batch = (32, 16, 16, 4) if args.tiny else (512, 128, 256, 32)
    if not os.path.isdir(args.tokenizer):
        local_tokenizer(args.tokenizer)
    spec = ModelSpec(config=cfg, tokenizer=args.tokenizer, dtype="bfloat16", gradient_checkpointing=True, seed=0)
    seed_everything(0)
    if args.vllm:  # prompts of the tokenizer's ids: vLLM refuses ids its tokenizer does not have
        return vllm_check(args, spec, 300, prompt_len, new_tokens, batch)

    # 1. Reward-model fit: tokens/s of forward+backward on (chosen, rejected) pairs.
    rm = RewardModelModule(spec, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5), scheduler=None)
    rm_rows = random_rows(batch * 16, seq, cfg["vocab_size"])
    rm_loader = torch.utils.data.DataLoader(rm_rows, batch_size=2 * (batch // 4 or 1), collate_fn=pair_collate)
    rm_trainer = trainer(args, max_steps=6)
    start = time.perf_counter()
    rm_trainer.fit(rm, rm_loader)
    rm_seconds = time.perf_counter() - start
    rm_tokens = reduce(rm, 6 * rm_loader.batch_size * seq, "sum")

    # 2. PPO rollouts against a random reward model (critic initialised from it).
    ppo = TimedPPO(
        actor=spec,
        reward_model=ModelSpec(config=cfg, tokenizer=args.tokenizer, dtype="bfloat16", seed=1),
        generation=GenerationSettings(max_new_tokens=new_tokens),
        update={"epochs": 1, "num_minibatches": 2},
        scoring={"forward_batch_size": batch // 2},
        samples={"every": 0},
        max_rollouts=args.rollouts,
    )
    prompts = random_rows(batch * args.rollouts, prompt_len, cfg["vocab_size"], left_pad=prompt_len // 4)
    for row in prompts:
        row["input_ids"][: prompt_len // 4] = ppo.tokenizer.pad_token_id
    trainer(args, max_epochs=1).fit(ppo, torch.utils.data.DataLoader(prompts, batch_size=batch))

    gen_tokens, upd_tokens = reduce(ppo, ppo.tokens["generate"], "sum"), reduce(ppo, ppo.tokens["update"], "sum")
    gen_s, upd_s = reduce(ppo, sum(ppo.times["generate"]), "max"), reduce(ppo, sum(ppo.times["update"]), "max")
    rollout_s = reduce(ppo, sum(ppo.times["rollout"][1:]) / max(len(ppo.times["rollout"]) - 1, 1), "max")
    peak = reduce(ppo, torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0, "max")
    if ppo.trainer.is_global_zero:
        n_params = sum(p.numel() for p in ppo.actor.parameters())  # DTensor.numel() is the global size
        print(f"\n== gpu_check: {n_params / 1e6:.1f}M-parameter Llama, bf16, FSDP2 on {ppo.trainer.world_size} device(s)")
        print(f"RM fit:             {rm_tokens / rm_seconds:,.0f} tokens/s (incl. start-up, 6 steps)")
        print(f"time per rollout:   {rollout_s:.2f} s (after the first; {batch} prompts/rank, {new_tokens} new tokens)")
        print(f"generation:         {gen_tokens / gen_s:,.0f} tokens/s")
        print(f"PPO update:         {upd_tokens / upd_s:,.0f} tokens/s")
        print(f"peak GPU memory:    {peak:.1f} GiB (max over ranks)")


if __name__ == "__main__":
    main()
