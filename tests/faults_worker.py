"""One process of the fault tests under DDP (``tests/test_distributed_faults.py``), run under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/faults_worker.py \
        --tokenizer TOK_DIR --prompts PROMPTS.jsonl --out OUT_DIR --name NAME [options]

A PPO fit of a tiny Llama (4 rollouts of 4 prompts per rank, sampled responses) with a SigtermCheckpoint
and a ModelCheckpoint folder (``OUT_DIR/checkpoints``, so ``--ckpt-path last`` finds ``last-sigterm.ckpt``).
Each rank writes ``OUT_DIR/pid_rank<r>`` as it starts and ``OUT_DIR/<NAME>_rank<r>.json`` as it ends: its exit
status (143 after SIGTERM, 1 after an exception, 0), the error, its rollouts done, global step and a
digest of its trainable weights (also taken when the fit stops on an exception, before teardown), and
after exit 0 or 143 the gloo worker threads left once its process groups are released.
Rank 0's logged metrics are in ``OUT_DIR/<NAME>/version_0/metrics.csv``.

Fault options: ``--wait-for-sigterm N --wait-ranks R,..``: those ranks stop at the start of rollout N
(writing ``OUT_DIR/<NAME>_ready_rank<r>``) until a SIGTERM from outside reaches them, so the test knows
which rollout the signal interrupts; ``--reward faults_worker:nan_on_rank1`` scores 2 responses of rank 1
NaN in rollout 2 (``--on-nonfinite`` picks the policy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))  # conftest, ppo_helpers, ppo_rewards, distributed_worker

from conftest import llama_config  # noqa: E402
from distributed_worker import make_strategy  # noqa: E402
from ppo_helpers import adamw  # noqa: E402

from lit_rlhf.callbacks import SigtermCheckpoint  # noqa: E402
from lit_rlhf.data import PromptDataModule  # noqa: E402
from lit_rlhf.models import ModelSpec  # noqa: E402
from lit_rlhf.modules import PPOModule  # noqa: E402
from lit_rlhf.process_groups import release_process_groups  # noqa: E402
from lit_rlhf.rollout import GenerationSettings  # noqa: E402

ROLLOUTS = 4
PER_RANK_BATCH = 4
# the rollout being made (set by RolloutCounter) and the NaN scores handed out in it (nan_on_rank1)
STATE = {"rollout": 0, "nans": 0}
NAN_ROWS = 2


def nan_on_rank1(prompts: list[str], responses: list[str]) -> list[float]:
    """``e_rate`` (dense), except that rank 1 scores its first ``NAN_ROWS`` responses of rollout 2 NaN."""
    scores = [r.count("e") / max(len(r), 1) for r in responses]
    if os.environ.get("RANK") == "1" and STATE["rollout"] == 2:
        for i in range(len(scores)):
            if STATE["nans"] < NAN_ROWS:
                scores[i] = float("nan")
                STATE["nans"] += 1
    return scores


def weights_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 of the trainable weights (``actor.``/``critic.`` entries) of a module state dict, in key order."""
    digest = hashlib.sha256()
    for key in sorted(k for k in state_dict if k.startswith(("actor.", "critic."))):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


class RolloutCounter(Callback):
    """Keeps ``STATE["rollout"]`` (1-based, counted over the run) for the reward function; when the fit
    stops on an exception, records this rank's state and writes its report already (after
    SigtermCheckpoint set the exit status, before Lightning's teardown restores the default SIGTERM
    action: torchrun sends SIGTERM to the other workers as soon as one exits non-zero)."""

    def __init__(self, report: dict, path: Path) -> None:
        self.report, self.path = report, path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        STATE["rollout"] = pl_module.rollouts_done + 1

    def on_exception(self, trainer, pl_module, exception) -> None:
        code = exception.code if isinstance(exception, SystemExit) and isinstance(exception.code, int) else 1
        error = f"{type(exception).__name__}: {exception.code if isinstance(exception, SystemExit) else exception}"
        self.report.update(exit=code, error=error, at_exception=rank_state(trainer, pl_module))
        self.path.write_text(json.dumps(self.report))


class WaitForSigterm(Callback):
    """On ``ranks``, at the start of rollout ``rollout``: write a ready file, then wait (at most 120 s)
    until a SIGTERM has reached this process (the handlers already installed run first)."""

    def __init__(self, rollout: int, ranks: list[int], ready: str) -> None:
        self.rollout, self.ranks, self.ready = rollout, ranks, ready
        self.received = False

    def _note(self, signum, frame) -> None:
        self.previous(signum, frame)
        self.received = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.rollouts_done + 1 != self.rollout or trainer.global_rank not in self.ranks:
            return
        self.previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._note)
        Path(f"{self.ready}_rank{trainer.global_rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.signal(signal.SIGTERM, self.previous)
        if not self.received:
            raise TimeoutError(f"rank {trainer.global_rank}: no SIGTERM within 120 s")


def rank_state(trainer: Trainer, module: PPOModule) -> dict:
    return {
        "rollouts_done": module.rollouts_done,
        "global_step": trainer.global_step,
        "digest": weights_digest(trainer.strategy.lightning_module_state_dict()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True, help="logger name and prefix of the per-rank result files")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--wait-for-sigterm", type=int, default=None, help="rollout at which to wait")
    parser.add_argument("--wait-ranks", default="0,1")
    parser.add_argument("--reward", default="ppo_rewards:e_rate")
    parser.add_argument("--on-nonfinite", choices=["raise", "drop"], default="raise")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.modules.setdefault("faults_worker", sys.modules[__name__])  # reward_fn "faults_worker:..." is this module
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid_rank{rank}").write_text(str(os.getpid()))

    report: dict = {"pid": os.getpid(), "exit": 0, "error": None}
    report_path = out / f"{args.name}_rank{rank}.json"
    trainer = module = None
    try:
        seed_everything(0)
        module = PPOModule(
            actor=ModelSpec(config=llama_config(), tokenizer=args.tokenizer, seed=0),
            reward_fn=args.reward,
            generation=GenerationSettings(max_new_tokens=6),
            update={"epochs": 2, "num_minibatches": 1},
            scoring={"forward_batch_size": PER_RANK_BATCH, "on_nonfinite": args.on_nonfinite},
            samples={"every": 0},
            max_rollouts=ROLLOUTS,
            actor_optimizer=adamw(1e-2),
            critic_optimizer=adamw(1e-2),
        )
        data = PromptDataModule(
            args.tokenizer, args.prompts, max_prompt_length=16, batch_size=PER_RANK_BATCH, seed=0
        )
        counter = RolloutCounter(report, report_path)
        callbacks = [ModelCheckpoint(dirpath=str(out / "checkpoints"), save_top_k=0), SigtermCheckpoint(), counter]
        if args.wait_for_sigterm is not None:
            ranks = [int(r) for r in args.wait_ranks.split(",")]
            callbacks.append(WaitForSigterm(args.wait_for_sigterm, ranks, str(out / f"{args.name}_ready")))
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=make_strategy("ddp"),
            logger=CSVLogger(str(out), name=args.name, version=0),
            callbacks=callbacks,
            max_epochs=-1,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=1,
        )
        trainer.fit(module, data, ckpt_path=args.ckpt_path)
    except SystemExit as exc:  # SIGTERMException (a SystemExit whose code SigtermCheckpoint sets)
        report["exit"] = exc.code if isinstance(exc.code, int) else 1
        report["error"] = f"{type(exc).__name__}: {exc.code}"
        raise
    except BaseException as exc:
        report["exit"] = 1
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        raise
    finally:
        if trainer is not None and module is not None and report["exit"] == 0:
            report.update(rank_state(trainer, module))
        report["finite_weights"] = module is not None and all(
            math.isfinite(float(p.detach().sum())) for p in module.parameters()
        )
        if report["exit"] in (0, 143):  # every rank stopped at the same point: no collective waits for a peer
            report["gloo_threads_left"] = release_process_groups()  # see lit_rlhf.process_groups
        report_path.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
