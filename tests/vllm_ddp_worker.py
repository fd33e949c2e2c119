"""One process of the vLLM engine's multi-process test (``tests/test_vllm_fits.py``), under
``torch.distributed.run --nproc_per_node 2``: GRPO with a colocated vLLM engine per rank, under DDP, FSDP2
or FSDP1, then the export (which needs the trainer's process group after the engines closed).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/vllm_ddp_worker.py \\
        --strategy ddp --tokenizer TOK_DIR --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_worker import make_trainer, prompt_loader, read_csv  # noqa: E402

from lit_rlhf.callbacks import HFExport  # noqa: E402
from lit_rlhf.models import load_tokenizer  # noqa: E402
from lit_rlhf.modules import CriticFreeModule  # noqa: E402
from lit_rlhf.process_groups import release_process_groups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp2", "fsdp1"], required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(args.tokenizer)
    config = dict(model_type="gpt2", vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2)
    module = CriticFreeModule(
        actor={"config": config, "tokenizer": args.tokenizer, "seed": 0},
        engine={"class_path": "vllm", "init_args": {"kv_cache_gib": 1}},
        reward_fn="ppo_rewards:e_rate", generation={"max_new_tokens": 8, "num_samples": 2},
        update={"epochs": 2, "num_minibatches": 2}, scoring={"forward_batch_size": 8}, samples={"every": 0},
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), max_rollouts=4, rng_seed=0,
    )  # fmt: skip
    trainer = make_trainer(args, "grpo", max_epochs=100, callbacks=[HFExport(f"{args.out}/export")])
    trainer.fit(module, prompt_loader(args, tok))
    rows = [r for r in read_csv(args.out, "grpo") if "rollout/score" in r]
    if trainer.is_global_zero:
        Path(args.out, "results.json").write_text(json.dumps(rows))
    # the groups destroyed and gloo's threads joined before the interpreter exits (see lit_rlhf.process_groups;
    # a group vLLM's engine still holds goes with vLLM's own shutdown at exit)
    release_process_groups()


if __name__ == "__main__":
    main()
