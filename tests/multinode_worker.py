"""One process of the multi-node tests (``tests/test_multinode.py``): tiny PPO and GRPO fits.

    python tests/multinode_worker.py --num_nodes 1 --tokenizer TOK --info INFO_DIR         # reference
    python -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank R \\
        --master_addr 127.0.0.1 --master_port PORT tests/multinode_worker.py --num_nodes 2 ...
    SLURM_PROCID=R ... python tests/multinode_worker.py --num_nodes 2 ...                    # SLURM-like

Builds ``Trainer(num_nodes=N, devices=1)`` (DDP over gloo when N > 1) with what a real run has beside
the fit: a CSVLogger (``logs/``; the modules' sample tables go to its ``samples.jsonl``), a
ModelCheckpoint (``ckpt/``) and an HFExport (``export/``), all relative to the working directory, so
that launching each node in a folder of its own shows which node wrote what. The fits are the ones of
``tests/distributed_worker.py`` (same modules, same fixed global batch of 8 prompts, split over the
ranks without shuffling). Every rank writes ``INFO_DIR/rank<global rank>.json`` (the ranks and cluster
environment its Trainer resolved); global rank 0 also writes ``INFO_DIR/results.json`` with the logged
per-rollout metrics of each fit.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))  # distributed_worker, ppo_rewards, ppo_helpers, conftest

from distributed_worker import (  # noqa: E402
    GLOBAL_BATCH,
    GRPO_KEYS,
    PPO_KEYS,
    make_strategy,
    ppo_module,
    prompt_loader,
)
from distributed_worker import (
    grpo_module as distributed_grpo_module,
)

from lit_rlhf.callbacks import HFExport  # noqa: E402
from lit_rlhf.models import load_tokenizer  # noqa: E402
from lit_rlhf.process_groups import release_process_groups  # noqa: E402

SAMPLE_ROWS = 2  # rows of each rollout's sample table


class SlowRank(Callback):
    """Holds every rank but global rank 0 back for ``seconds`` as the fit ends (before HFExport runs):
    rank 0 then writes the export before the other ranks look at the folder."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            time.sleep(self.seconds)


def make_trainer(args, run: str, export: str | None = None, version: int = 0, max_epochs: int = 3) -> Trainer:
    """Checkpoints go to ``ckpt/<run>``, the export to ``export/<export or run>``, the logs to
    ``logs/<run>/version_<version>``."""
    strategy = make_strategy(args.strategy) if args.num_nodes > 1 else "auto"
    callbacks = [ModelCheckpoint(dirpath=f"ckpt/{run}"), HFExport(f"export/{export or run}")]
    if args.slow_rank:
        callbacks.insert(0, SlowRank(args.slow_rank))
    return Trainer(
        accelerator="cpu",
        num_nodes=args.num_nodes,
        devices=1,
        strategy=strategy,
        logger=CSVLogger("logs", name=run, version=version),
        callbacks=callbacks,
        max_epochs=max_epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        use_distributed_sampler=False,  # see loader()
    )


def loader(args, tok, trainer: Trainer) -> torch.utils.data.DataLoader:
    """Rank r's share of the 8 prompts, rows r, r + W, ...: each global batch is the single process's batch.

    The rank is the one the Trainer resolved from its cluster environment (torchrun's RANK, SLURM's
    SLURM_PROCID), known once the Trainer is built."""
    rows = prompt_loader(SimpleNamespace(strategy="single"), tok).dataset
    world, rank = trainer.world_size, trainer.global_rank
    sampler = torch.utils.data.DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(rows, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def grpo_module(args):
    """The GRPO of ``distributed_worker.run_grpo``, with a sample table every rollout."""
    return distributed_grpo_module(args, samples={"every": 1, "rows": SAMPLE_ROWS})


def rank_info(trainer: Trainer) -> dict:
    return {
        "global_rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        "cwd": os.getcwd(),
    }


def run_continue(args, tok) -> dict:
    """GRPO fitted for one rollout, then continued from its checkpoint to two with a new module,
    Trainer and HFExport on the same export folder: the continuation is the same run (the export
    marker's run id, restored from the checkpoint) and may replace its own export."""
    markers, ckpt = [], None
    for version, epochs in enumerate((1, 2)):
        seed_everything(0)
        module = grpo_module(args)
        trainer = make_trainer(args, "grpo_continue", version=version, max_epochs=epochs)
        info = rank_info(trainer)
        trainer.fit(module, loader(args, tok, trainer), ckpt_path=ckpt)
        ckpt = trainer.checkpoint_callback.best_model_path
        if trainer.is_global_zero:  # rank 0 wrote it (after the others had checked the folder)
            markers.append(
                json.loads(Path("export/grpo_continue/lit_rlhf_export.json").read_text())["run_id"]
            )
    return {"rank": info, "metrics": {"marker_run_ids": markers, "sharded": Path(ckpt).is_dir()}}


def run(args, tok, name: str) -> dict:
    if name == "grpo_continue":
        return run_continue(args, tok)
    seed_everything(0)
    if name == "ppo":
        module = ppo_module(args, lora=False)
        module.samples = dataclasses.replace(module.samples, every=1, rows=SAMPLE_ROWS)
        keys, marker = PPO_KEYS, "ppo/policy_loss"
    else:
        module, keys, marker = grpo_module(args), GRPO_KEYS, "policy/policy_loss"
    trainer = make_trainer(args, name)
    info = rank_info(trainer)
    trainer.fit(module, loader(args, tok, trainer))
    if not trainer.is_global_zero:
        return {"rank": info}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:  # rank 0's logger wrote it as the fit ended
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    rows = [r for r in rows if marker in r]
    return {"rank": info, "metrics": {key: [r[key] for r in rows] for key in keys}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--num_nodes", type=int, default=1, help="Trainer(num_nodes=...), one device per node"
    )
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--info", required=True, help="folder for rank<R>.json and rank 0's results.json")
    parser.add_argument("--runs", default="ppo,grpo", help="comma-separated: ppo, grpo, grpo_continue")
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp", help="with num_nodes > 1")
    parser.add_argument("--slow_rank", type=float, default=0.0, help="see SlowRank (0: off)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = load_tokenizer(args.tokenizer)
    results = {name: run(args, tok, name) for name in args.runs.split(",")}
    info = Path(args.info)
    rank = next(iter(results.values()))["rank"]["global_rank"]
    (info / f"rank{rank}.json").write_text(json.dumps({name: r["rank"] for name, r in results.items()}))
    if rank == 0:
        (info / "results.json").write_text(json.dumps({name: r["metrics"] for name, r in results.items()}))
    # the groups destroyed and gloo's threads joined before the interpreter exits (see lit_rlhf.process_groups)
    if release_process_groups():
        sys.exit(f"rank {rank}: gloo worker threads still running after release_process_groups()")


if __name__ == "__main__":
    main()
