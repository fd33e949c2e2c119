"""One W2 (preference pairs) benchmark run: reward model or DPO, lit_rlhf or TRL.

    python scripts/bench/pair_bench.py --algo rm|dpo --impl lit|trl --assets DIR [--size full|smoke]

Pairs: prompts of 64-512 tokens, chosen and rejected of 16-128 tokens (EOS included), vocabulary 32,000,
the same pairs in the same order for both libraries (lit_rlhf: an unshuffled DataLoader; TRL: its
trainer with a sequential sampler), so every step does the same work.

* ``rm``: ``RewardModelModule`` vs TRL ``RewardTrainer``, the same Llama sequence classifier, pre-tokenised
  pairs for both.
* ``dpo``: ``DPOModule`` vs TRL ``DPOTrainer``, the same Llama causal LM, beta 0.1, sigmoid loss, the
  reference a frozen copy of the initial policy, reference log-probs computed every step for both
  (precompute off). TRL gets the texts (it appends the EOS token string and tokenises them; the
  tokenizer gives the very ids lit_rlhf gets, see workloads.py).

Both: AdamW without weight decay at a constant lr 1e-5, gradient clipping 1.0, float32, no gradient
checkpointing, dropout off. Prints one ``BENCH_RESULT {json}`` line with the wall and CPU times at the end
of every optimiser step and the pairs of each step; the first step is a warm-up.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    TRL_COMMON,
    StepClock,
    bench_parser,
    default_optimizer,
    emit,
    footprint,
    load_json,
    set_threads,
)
from workloads import PAIRS, SIZES, assets_dir  # noqa: E402


def settings(args) -> tuple[int, int]:
    """(pairs per step, steps including the warm-up one) of this run's size."""
    size = SIZES[args.size]
    return size[f"{args.algo}_pairs_per_step"], (args.steps or size[f"{args.algo}_steps"]) + 1


def asset_folder(args) -> Path:
    """The folder of the models and data.json: ``--folder``, else the workload assets of ``--size``."""
    return Path(args.folder) if args.folder else assets_dir(args.assets, args.size)


def run_lit(args, clock: StepClock, pairs_done: list[int]) -> int:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lit_rlhf.data.collators import PreferenceCollator
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import DPOModule, RewardModelModule

    class Clock(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.tick()
            pairs_done.append(int(batch["row_index"].numel()))

    folder, (per_step, steps) = asset_folder(args), settings(args)
    if args.algo == "rm":
        module = RewardModelModule(
            model=ModelSpec(name_or_path=str(folder / "reward")),
            optimizer=default_optimizer(RewardModelModule, "optimizer", lr=PAIRS["lr"], weight_decay=0.0),
            scheduler=None,
        )
    else:
        module = DPOModule(
            model=ModelSpec(name_or_path=str(folder / "actor")),
            beta=PAIRS["beta"],
            loss_type="sigmoid",
            precompute_ref_logprobs=False,
            optimizer=default_optimizer(DPOModule, "optimizer", lr=PAIRS["lr"], weight_decay=0.0),
            scheduler=None,
            num_samples=0,
        )
    rows = [
        {
            "prompt_input_ids": p["prompt"]["ids"],
            "chosen_input_ids": p["chosen"]["ids"],
            "rejected_input_ids": p["rejected"]["ids"],
            "row_index": i,
        }
        for i, p in enumerate(load_json(folder / "data.json")["pairs"][: per_step * steps])
    ]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=per_step, collate_fn=PreferenceCollator(module.tokenizer.pad_token_id)
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=1, gradient_clip_val=PAIRS["max_grad_norm"],
            default_root_dir=root, callbacks=[Clock()],
        )  # fmt: skip
        trainer.fit(module, loader)
    return sum(p.numel() for p in module.model.parameters())


def run_trl(args, clock: StepClock, pairs_done: list[int]) -> int:
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    folder, (per_step, steps) = asset_folder(args), settings(args)
    pairs = load_json(folder / "data.json")["pairs"][: per_step * steps]

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock.tick()
            pairs_done.append(per_step)

    common = dict(
        per_device_train_batch_size=per_step,
        max_steps=steps,
        learning_rate=PAIRS["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=PAIRS["max_grad_norm"],
        max_length=None,
        disable_dropout=True,
        **TRL_COMMON,
    )
    if args.algo == "rm":
        trainer_class, path = RewardTrainer, folder / "reward"
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        data = Dataset.from_dict(
            {
                "chosen_ids": [p["prompt"]["ids"] + p["chosen"]["ids"] for p in pairs],
                "rejected_ids": [p["prompt"]["ids"] + p["rejected"]["ids"] for p in pairs],
            }
        )
        config = RewardConfig(output_dir="", **common)
    else:
        trainer_class, path = DPOTrainer, folder / "actor"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        data = Dataset.from_dict(
            {key: [p[key]["text"] for p in pairs] for key in ("prompt", "chosen", "rejected")}
        )
        config = DPOConfig(
            output_dir="", beta=PAIRS["beta"], loss_type=["sigmoid"], precompute_ref_log_probs=False, **common
        )

    class InOrder(trainer_class):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    with tempfile.TemporaryDirectory() as root:
        config.output_dir = root
        tokenizer = AutoTokenizer.from_pretrained(path)
        trainer = InOrder(
            model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()]
        )
        trainer.train()
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--algo", choices=["rm", "dpo"], required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument(
        "--folder", help="the asset folder itself (actor/, data.json: a point of scaling.py) instead of "
        "--assets' v32k_<size>",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up one (default: --size's)")
    args = parser.parse_args()
    set_threads(args.threads)
    import torch

    torch.manual_seed(0)
    clock, pairs_done = StepClock(), []
    params = (run_lit if args.impl == "lit" else run_trl)(args, clock, pairs_done)
    timed = sum(pairs_done[1:])  # pairs of the steps after the warm-up one
    emit(
        dict(
            impl=args.impl,
            algo=args.algo,
            size=args.size,
            threads=torch.get_num_threads(),
            params=params,
            steps=len(clock.wall),
            pairs=pairs_done,
            pairs_per_s=timed / (clock.wall[-1] - clock.wall[0]),
            cpu_pairs_per_s=timed / (clock.cpu[-1] - clock.cpu[0]),
            **footprint(args.impl),
        )
    )


if __name__ == "__main__":
    main()
