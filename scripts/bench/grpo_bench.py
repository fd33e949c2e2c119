"""One W1 (group RL) benchmark run: lit_rlhf CriticFreeModule(grpo) or TRL GRPOTrainer.

    python scripts/bench/grpo_bench.py --impl lit|trl --assets DIR [--size full|smoke] [--threads 1]

Both sample K = 8 responses per prompt (prompts of 64-256 tokens, responses of up to 64 tokens that stop
at EOS, vocabulary 32,000) from the same weights with transformers' ``generate`` (temperature 1, no
top-k/top-p, pad suppressed), score them with the same Python reward function, and take one optimiser
step per rollout: one pass (TRL num_iterations=1) over one minibatch of all rows, token-mean loss
aggregation (TRL loss_type="dapo"; one process, so the same as the local token mean), clipped ratio
eps 0.2, k3 KL-to-reference loss with beta 0.04, group-std advantages, AdamW lr 1e-6 without weight
decay, gradient clipping 1.0, float32 (``--precision bf16-mixed``: Lightning's bf16-mixed against TRL's
``bf16=True``, both autocast to bfloat16 with float32 weights), no gradient checkpointing. Prompts come in
dataset order (TRL ``shuffle_dataset=False``), so both runs see the same prompts per rollout.

Prints one ``BENCH_RESULT {json}`` line: per-rollout phases (common.Timeline) and the real response
tokens of each rollout (EOS included), peak RSS. The first rollout is a warm-up.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
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
)
from workloads import GRPO, MAX_NEW_TOKENS, SIZES, assets_dir, bench_reward  # noqa: E402


def run_lit(args, timeline: Timeline, tokens: list[int]) -> int:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lit_rlhf.data.collators import PromptCollator
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import CriticFreeModule
    from lit_rlhf.rollout import GenerationSettings

    class TimedGRPO(CriticFreeModule):
        def generate(self, prompts, prompt_mask, settings=None, greedy=False):
            timeline.mark("gen_start")
            out = super().generate(prompts, prompt_mask, settings, greedy)
            timeline.mark("gen_end")
            tokens.append(int(out.mask.sum()))  # lit_rlhf.engines.Responses
            return out

        def run_update_epochs(self, loss_fn, optimized):
            timeline.mark("upd_start")
            return super().run_update_epochs(loss_fn, optimized)

    class Marks(Callback):
        def on_train_start(self, trainer, module):
            timeline.mark("start")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            timeline.mark("iter_end")
            timeline.engine.append(module.engine.stats())

    size, folder = SIZES[args.size], asset_folder(args)
    kwargs = dict(
        actor=ModelSpec(name_or_path=str(folder / "actor")),
        reward_fn="workloads:bench_reward",
        advantage=dict(estimator="grpo"),
        generation=GenerationSettings(
            max_new_tokens=MAX_NEW_TOKENS, temperature=GRPO["temperature"], num_samples=args.k
        ),
        update=dict(
            epochs=1,
            num_minibatches=1,
            loss_aggregation="token_mean",
            clip_coef=GRPO["clip"],
            ratio_threshold=None,  # TRL never skips a minibatch
            max_grad_norm=GRPO["max_grad_norm"],
        ),
        kl=dict(coef=0.0, loss_coef=GRPO["beta"], loss_estimator="k3"),
        max_rollouts=args.rollouts,
        samples=dict(every=0),
        actor_optimizer=default_optimizer(
            CriticFreeModule, "actor_optimizer", lr=GRPO["lr"], weight_decay=0.0
        ),
    )
    module = TimedGRPO(**with_overrides(kwargs, args.lit_args))
    prompts = load_json(folder / "data.json")["grpo_prompts"]
    rows = [{"prompt_input_ids": p["ids"]} for p in prompts[: size["grpo_groups"] * args.rollouts]]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=size["grpo_groups"], collate_fn=PromptCollator(module.tokenizer.pad_token_id)
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=1, default_root_dir=root, callbacks=[Marks()],
            precision=args.precision,
        )  # fmt: skip
        trainer.fit(module, loader)
    return sum(p.numel() for p in module.actor.parameters())


def run_trl(args, timeline: Timeline, tokens: list[int]) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            timeline.mark("gen_start")
            completion_ids, logprobs = super()._generate_single_turn(*a, **k)
            timeline.mark("gen_end")
            tokens.append(sum(len(c) for c in completion_ids))  # EOS included, nothing after it
            return completion_ids, logprobs

        def compute_loss(self, *a, **k):
            timeline.mark_update_start()
            return super().compute_loss(*a, **k)

    class Marks(TrainerCallback):
        def on_train_begin(self, *a, **k):
            timeline.mark("start")

        def on_step_end(self, *a, **k):
            timeline.mark("iter_end")

    if args.trl_compact_head:
        compact_fused_head()
    size, folder = SIZES[args.size], asset_folder(args)
    tokenizer = AutoTokenizer.from_pretrained(folder / "actor", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder / "actor", dtype=torch.float32)
    prompts = load_json(folder / "data.json")["grpo_prompts"]
    n = size["grpo_groups"] * args.rollouts
    data = Dataset.from_dict({"prompt": [p["text"] for p in prompts[:n]]})
    rows = size["grpo_groups"] * args.k
    with tempfile.TemporaryDirectory() as root:
        config = GRPOConfig(
            output_dir=root,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            num_generations=args.k,
            max_completion_length=MAX_NEW_TOKENS,
            temperature=GRPO["temperature"],
            top_p=1.0,
            top_k=0,
            generation_kwargs={"suppress_tokens": [tokenizer.pad_token_id]},  # as lit_rlhf's generate
            beta=GRPO["beta"],
            use_bias_correction_kl=False,  # lit_rlhf's k3 KL loss is not multiplied by the ratio
            epsilon=GRPO["clip"],
            loss_type="dapo",
            scale_rewards="group",
            learning_rate=GRPO["lr"],
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=GRPO["max_grad_norm"],
            max_steps=args.rollouts,
            shuffle_dataset=False,
            disable_dropout=True,
            logging_steps=1,
            **{**TRL_COMMON, **trl_precision(args.precision)},
            **TRL_VLLM.get(args.trl_vllm, {}),
        )
        trainer = TimedGRPOTrainer(
            model=model, reward_funcs=[bench_reward], args=config, train_dataset=data,
            processing_class=tokenizer, callbacks=[Marks()],
        )  # fmt: skip
        trainer.train()
    return sum(p.numel() for p in model.parameters())


def asset_folder(args) -> Path:
    """The folder of the actor and data.json: ``--folder``, else the workload assets of ``--size``."""
    return Path(args.folder) if args.folder else assets_dir(args.assets, args.size)


def compact_fused_head() -> None:
    """--trl-compact-head: TRL >= 1.13's fused LM head (``add_fused_lm_head``, which GRPOTrainer always applies)
    scores only the completion tokens on the CPU too. It compacts the positions to the valid labels only
    where ``_use_triton(device)`` (CUDA/XPU with Triton) and elsewhere projects every position, prompt and
    padding included, through the LM head; no setting turns that off. This patches the private switch of
    ``trl.trainer.utils``, not the kernel choice (the tiles stay torch ops): a what-if, not a user setting."""
    import trl
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_use_triton"):
        raise SystemExit(f"--trl-compact-head: trl {trl.__version__} has no fused LM head to compact")
    trl_utils._use_triton = lambda device: True


# --trl-vllm colocate: GRPOTrainer's vLLM generation in the trainer process, as a TRL user with vLLM picks it
# (vLLM must be importable: the vLLM environment with trl on the path, see engine_bench.py)
TRL_VLLM = {"colocate": dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                             vllm_enable_sleep_mode=False, vllm_importance_sampling_correction=True)}  # fmt: skip


def main() -> None:
    parser = bench_parser(__doc__, lit_args=True, precision=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--trl-vllm", choices=sorted(TRL_VLLM), help="TRL generates with vLLM (colocate)")
    parser.add_argument(
        "--trl-compact-head", action="store_true",
        help="what-if: TRL >= 1.13's fused LM head scores the completion tokens only on the CPU (compact_fused_head)",
    )  # fmt: skip
    parser.add_argument(
        "--folder", help="the asset folder itself (actor/, data.json: a point of scaling.py) instead of "
        "--assets' v32k_<size>",
    )  # fmt: skip
    parser.add_argument("--k", type=int, default=GRPO["num_generations"], help="responses per prompt")
    parser.add_argument("--rollouts", type=int, help="rollouts per run, the first a warm-up (default: --size)")
    args = parser.parse_args()
    args.rollouts = args.rollouts or SIZES[args.size]["grpo_rollouts"]
    set_threads(args.threads)
    import torch

    torch.manual_seed(0)
    timeline, tokens = Timeline(), []
    actor_params = (run_lit if args.impl == "lit" else run_trl)(args, timeline, tokens)
    rollouts = timeline.rollouts()
    if len(tokens) != len(rollouts):
        raise SystemExit(f"{len(tokens)} generations for {len(rollouts)} rollouts: the timing hooks are stale")
    emit(
        dict(
            impl=args.impl,
            workload="W1_grpo",
            size=args.size,
            precision=args.precision,
            threads=torch.get_num_threads(),
            actor_params=actor_params,
            response_tokens=tokens,
            rows_per_rollout=SIZES[args.size]["grpo_groups"] * args.k,
            rollouts=rollouts,
            engine_stats=timeline.engine,
            **footprint(args.impl),
        )
    )


if __name__ == "__main__":
    main()
