"""One PPO benchmark run of lit_rlhf or TRL (one process per run, so peak RSS is the run's own).

    python scripts/bench/ppo_bench.py --impl lit|trl --assets DIR [--model small|large] [--rollouts 5]
        [--warmup 1] [--threads 1] [--count-flops] [--profile FILE] [--workload control|W3_ppo --size full]
        [--precision 32-true|bf16-mixed]

``--workload control`` (default) is issue 7's fixed-length control: common.PPO, 16-token prompts, no
early stop. ``--workload W3_ppo`` is issue 16's W3: prompts of 16-256 tokens, responses of up to 64
tokens that stop at EOS (the calibrated actor of workloads.py), vocabulary 32,000, workloads.PPO32K
settings (temperature 1, 2 epochs x 2 minibatches) and workloads.SIZES[size] prompts and rollouts; the
result then also lists the real response tokens of every rollout (EOS included).

Prints one ``BENCH_RESULT {json}`` line: per-rollout phase times (generation / scoring / update /
other / total, see common.Timeline), peak RSS, and with --count-flops the update phase's FLOPs counted
by torch.utils.flop_counter.FlopCounterMode on the first (warm-up) rollout. The first ``--warmup``
rollouts are reported but excluded from the driver's statistics. Settings: common.PPO. ``--precision
bf16-mixed`` runs lit_rlhf under Lightning's bf16-mixed and TRL with ``bf16=True`` and
``ACCELERATE_MIXED_PRECISION=bf16`` (its PPOTrainer's own Accelerator reads only the latter): both autocast
to bfloat16 on the CPU, weights float32.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PPO,
    TRL_COMMON,
    Timeline,
    bench_parser,
    default_optimizer,
    emit,
    footprint,
    load_json,
    set_threads,
    trl_precision,
    with_overrides,
)  # noqa: E402
from workloads import MAX_NEW_TOKENS, PPO32K, SIZES, assets_dir, load_rows  # noqa: E402


def workload(args) -> tuple[dict, Path, list[list[int]]]:
    """(settings, models folder, prompts of every rollout) of ``args.workload``."""
    if args.workload == "control":
        prompts = load_json(Path(args.assets) / "prompts.json")
        rows = [prompts[i % len(prompts)] for i in range(PPO["batch"] * args.rollouts)]
        return PPO, Path(args.assets) / args.model, rows
    size = SIZES[args.size]
    settings = dict(
        PPO, **PPO32K, batch=size["ppo_batch"], response_len=MAX_NEW_TOKENS, vocab=32000, eos_stop=True
    )
    prompts = load_rows(args.assets, args.size)["ppo_prompts"][: size["ppo_batch"] * args.rollouts]
    return settings, assets_dir(args.assets, args.size), [p["ids"] for p in prompts]


def count_response_tokens(responses, eos: int, pad: int) -> int:
    """Real tokens of (B, T) sampled responses: up to and including the first EOS, never padding."""
    is_eos = (responses == eos).int()
    return int(((is_eos.cumsum(1) - is_eos == 0) & (responses != pad)).sum())


def count_flops(fn, sink: list[int]):
    """Run ``fn`` under FlopCounterMode and append the counted FLOPs (forward and backward) to ``sink``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn()
    sink.append(counter.get_total_flops())
    return out


def run_lit(args, timeline: Timeline, flops: list[int], tokens: list[int]):
    import torch
    from lightning.pytorch import Callback, Trainer

    from lit_rlhf.data.collators import PromptCollator
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import PPOModule
    from lit_rlhf.rollout import GenerationSettings

    class TimedPPO(PPOModule):
        def generate(self, prompts, prompt_mask, settings=None, greedy=False):
            timeline.mark("gen_start")
            out = super().generate(prompts, prompt_mask, settings, greedy)
            timeline.mark("gen_end")
            tokens.append(int(out.mask.sum()))  # lit_rlhf.engines.Responses
            return out

        def run_update_epochs(self, loss_fn, optimized):
            timeline.mark("upd_start")
            if args.count_flops and not flops:
                return count_flops(functools.partial(super().run_update_epochs, loss_fn, optimized), flops)
            return super().run_update_epochs(loss_fn, optimized)

    class Marks(Callback):
        def on_train_start(self, trainer, module):
            timeline.mark("start")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            timeline.mark("iter_end")
            timeline.engine.append(module.engine.stats())

    S, models, prompts = workload(args)
    actor_opt = default_optimizer(PPOModule, "actor_optimizer", lr=S["lr"], weight_decay=0.0)
    critic_opt = default_optimizer(PPOModule, "critic_optimizer", lr=S["lr"], weight_decay=0.0)
    kwargs = dict(
        actor=ModelSpec(name_or_path=str(models / "actor")),
        reward_model=ModelSpec(name_or_path=str(models / "reward")),
        critic=ModelSpec(name_or_path=str(models / "reward")),
        generation=GenerationSettings(max_new_tokens=S["response_len"], temperature=S["temperature"]),
        update=dict(
            epochs=S["ppo_epochs"],
            num_minibatches=S["num_minibatches"],
            clip_coef=S["clip_coef"],
            clip_coef_value=S["clip_coef_value"],
            vf_coef=S["vf_coef"],
            # TRL's PPOTrainer neither clips gradients nor skips minibatches: same work here.
            max_grad_norm=None,
            ratio_threshold=None,
        ),
        scoring=dict(forward_batch_size=S["forward_batch_size"]),
        advantage=dict(gamma=S["gamma"], gae_lambda=S["gae_lambda"]),
        kl=dict(coef=S["kl_coef"]),
        max_rollouts=args.rollouts,
        samples=dict(every=0),
        actor_optimizer=actor_opt,
        critic_optimizer=critic_opt,
    )
    module = TimedPPO(**with_overrides(kwargs, args.lit_args))
    rows = [{"prompt_input_ids": p} for p in prompts]
    collate = PromptCollator(module.tokenizer.pad_token_id)
    loader = torch.utils.data.DataLoader(rows, batch_size=S["batch"], collate_fn=collate)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_epochs=1,
            default_root_dir=root,
            callbacks=[Marks()],
            precision=args.precision,
        )
        trainer.fit(module, loader)
    return n_params(module.actor), n_params(module.critic)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run_trl(args, timeline: Timeline, flops: list[int], tokens: list[int]):
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_trainer
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    if args.count_flops:
        raise SystemExit("--count-flops is implemented for lit_rlhf only")
    generate = ppo_trainer.batch_generation
    forward = ppo_trainer.forward

    def timed_generation(model, queries, *a, **k):
        timeline.mark("gen_start")
        out = generate(model, queries, *a, **k)
        timeline.mark("gen_end")
        responses = out[0][:, queries.shape[1] :]  # out = (query_responses, logits)
        tokens.append(count_response_tokens(responses, tokenizer.eos_token_id, tokenizer.pad_token_id))
        return out

    def timed_forward(model, *a, **k):
        # The rollout calls forward() on the reference; the update on the policy+value wrapper.
        if hasattr(model, "value_model"):
            timeline.mark_update_start()
        return forward(model, *a, **k)

    ppo_trainer.batch_generation, ppo_trainer.forward = timed_generation, timed_forward

    class Marks(TrainerCallback):
        def on_train_begin(self, *a, **k):
            timeline.mark("start")

        def on_step_end(self, *a, **k):
            timeline.mark("iter_end")

    if args.precision == "bf16-mixed":
        # PPOTrainer builds its own Accelerator() without TrainingArguments' bf16: what reaches it is the
        # launcher's setting (`accelerate launch --mixed_precision bf16` sets this variable)
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    S, models, prompts = workload(args)
    tokenizer = AutoTokenizer.from_pretrained(models / "actor", padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(models / "actor", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(models / "actor", dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(
        models / "reward", num_labels=1, dtype=torch.float32
    )
    reward = AutoModelForSequenceClassification.from_pretrained(
        models / "reward", num_labels=1, dtype=torch.float32
    )
    data = Dataset.from_dict({"input_ids": prompts})
    with tempfile.TemporaryDirectory() as root:
        config = PPOConfig(
            output_dir=root,
            per_device_train_batch_size=S["batch"],  # x gradient_accumulation_steps = prompts per rollout
            gradient_accumulation_steps=1,
            num_mini_batches=S["num_minibatches"],
            num_ppo_epochs=S["ppo_epochs"],
            local_rollout_forward_batch_size=S["forward_batch_size"],
            response_length=S["response_len"],
            stop_token="eos" if S.get("eos_stop") else None,
            temperature=S["temperature"],
            learning_rate=S["lr"],
            lr_scheduler_type="constant",
            weight_decay=0.0,
            kl_coef=S["kl_coef"],
            kl_estimator="k1",
            cliprange=S["clip_coef"],
            cliprange_value=S["clip_coef_value"],
            vf_coef=S["vf_coef"],
            gamma=S["gamma"],
            lam=S["gae_lambda"],
            total_episodes=S["batch"] * args.rollouts,
            num_sample_generations=0,
            logging_steps=1,
            **{**TRL_COMMON, **trl_precision(args.precision)},
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            value_model=value,
            train_dataset=data,
            eval_dataset=data,
            callbacks=[Marks()],
        )
        trainer.train()
    return n_params(policy), n_params(value)


def main() -> None:
    parser = bench_parser(__doc__, lit_args=True, precision=True)
    parser.add_argument("--model", choices=["small", "large"], default="small")
    parser.add_argument("--rollouts", type=int, default=5)
    parser.add_argument("--count-flops", action="store_true")
    parser.add_argument("--profile", help="write a torch.profiler op table of the last rollout to this file")
    parser.add_argument("--workload", choices=["control", "W3_ppo"], default="control")
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help="W3_ppo's size preset")
    args = parser.parse_args()
    set_threads(args.threads)
    import torch

    torch.manual_seed(0)
    timeline, flops, tokens = Timeline(), [], []
    run = run_lit if args.impl == "lit" else run_trl
    if args.profile:
        from profile_ppo import profiled

        actor_params, critic_params = profiled(run, args, timeline, flops, tokens)
    else:
        actor_params, critic_params = run(args, timeline, flops, tokens)
    settings = workload(args)[0]
    emit(
        dict(
            impl=args.impl,
            model=args.model,
            threads=torch.get_num_threads(),
            actor_params=actor_params,
            critic_params=critic_params,
            workload=args.workload,
            precision=args.precision,
            tokens_per_rollout=settings["batch"] * settings["response_len"],  # the control's (no early stop)
            response_tokens=tokens,
            rollouts=timeline.rollouts(),
            engine_stats=timeline.engine,
            update_flops=flops[0] if flops else None,
            **footprint(args.impl),
        )
    )


if __name__ == "__main__":
    main()
