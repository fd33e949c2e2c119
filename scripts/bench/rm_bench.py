"""One reward-model benchmark run of lit_rlhf (RewardModelModule) or TRL (RewardTrainer).

    python scripts/bench/rm_bench.py --impl lit|trl --assets DIR [--steps 80] [--warmup 10] [--threads 1]

Both train the same hidden-64, 2-layer GPT-2 sequence classifier from the same weights on the same
pre-tokenised pairs (prompt + chosen/rejected + EOS, fixed lengths so every batch has the same shape
whatever the shuffling), ``common.RM["pairs_per_batch"]`` pairs per optimiser step, constant LR, AdamW
without weight decay, gradient-norm clipping at 1.0, no gradient checkpointing, float32. Prints one
``BENCH_RESULT {json}`` line with the wall and CPU times at the end of every optimiser step.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    RM,
    TRL_COMMON,
    StepClock,
    bench_parser,
    default_optimizer,
    emit,
    footprint,
    load_json,
    set_threads,
)  # noqa: E402


def run_lit(args, clock: StepClock) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lit_rlhf.data.collators import PreferenceCollator
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import RewardModelModule

    class Clock(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.tick()

    folder = Path(args.assets) / "rm_gpt2"
    module = RewardModelModule(
        model=ModelSpec(name_or_path=str(folder)),
        optimizer=default_optimizer(RewardModelModule, "optimizer", lr=RM["lr"], weight_decay=0.0),
        scheduler=None,
    )
    rows = [
        {
            "prompt_input_ids": p["prompt"],
            "chosen_input_ids": p["chosen"],
            "rejected_input_ids": p["rejected"],
        }
        for p in load_json(Path(args.assets) / "pairs.json")
    ]
    loader = torch.utils.data.DataLoader(
        rows,
        batch_size=RM["pairs_per_batch"],
        shuffle=True,
        collate_fn=PreferenceCollator(module.tokenizer.pad_token_id),
        generator=torch.Generator().manual_seed(0),
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=args.warmup + args.steps,
            gradient_clip_val=RM["max_grad_norm"],
            default_root_dir=root,
            callbacks=[Clock()],
        )
        trainer.fit(module, loader)


def run_trl(args, clock: StepClock) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock.tick()

    folder = Path(args.assets) / "rm_gpt2"
    pairs = load_json(Path(args.assets) / "pairs.json")
    data = Dataset.from_dict(
        {
            "chosen_ids": [p["prompt"] + p["chosen"] for p in pairs],
            "rejected_ids": [p["prompt"] + p["rejected"] for p in pairs],
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as root:
        config = RewardConfig(
            output_dir=root,
            per_device_train_batch_size=RM["pairs_per_batch"],
            max_steps=args.warmup + args.steps,
            learning_rate=RM["lr"],
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=RM["max_grad_norm"],
            max_length=None,
            **TRL_COMMON,
        )
        trainer = RewardTrainer(
            model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()]
        )
        trainer.train()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=80, help="timed optimiser steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed optimiser steps before them")
    args = parser.parse_args()
    set_threads(args.threads)
    import torch

    torch.manual_seed(0)
    clock = StepClock()
    (run_lit if args.impl == "lit" else run_trl)(args, clock)
    start = args.warmup - 1  # the end of the last warm-up step
    pairs = RM["pairs_per_batch"] * (len(clock.wall) - 1 - start)
    emit(
        dict(
            impl=args.impl,
            threads=torch.get_num_threads(),
            steps=len(clock.wall),
            pairs_per_s=pairs / (clock.wall[-1] - clock.wall[start]),
            cpu_pairs_per_s=pairs / (clock.cpu[-1] - clock.cpu[start]),
            **footprint(args.impl),
        )
    )


if __name__ == "__main__":
    main()
