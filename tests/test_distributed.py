"""RM, PPO and DPO under DDP, FSDP2 (ModelParallelStrategy) and FSDP1 with two CPU processes (gloo).

Each strategy runs ``tests/distributed_worker.py`` once under ``torch.distributed.run`` (RM fit, a
two-member RM ensemble fit with gradient clipping except under FSDP1, PPO fit, LoRA PPO fit; DDP and FSDP2 DPO fits; FSDP2 also a GRPO fit, one against a reward model's
last-layer posterior, and PPO saved sharded after one rollout and resumed); the single-process run of the same script with the same global batch is the
reference. Every worker ends by
releasing its process groups and fails if a gloo worker thread is still running then (such a thread
used to abort a rank at interpreter exit: ``lit_rlhf/process_groups.py``); a launch running past
``TIMEOUT`` is killed with its workers and fails its test. Part of ``make test`` (marker ``distributed``;
alone: ``pytest -m distributed tests/test_distributed.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launching import run_launch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "distributed_worker.py"
STRATEGIES = ["ddp", "fsdp2", "fsdp1"]
TOL = 1e-4
# the worker's runs per launch (each strategy launched once: a launch's start-up costs ~6 s of two cores)
RUNS = {"single": "ppo,grpo,posterior,dpo", "ddp": "ppo,dpo", "fsdp2": "ppo,grpo,multiturn,posterior,dpo", "fsdp1": "ppo"}
TIMEOUT = 400  # seconds per launch (~20-50 s each on two busy cores): a hang fails the test, killed


@pytest.fixture(scope="module")
def posterior_dir(tokenizer_dir, tmp_path_factory) -> str:
    """A reward model (random, its head seeded) and its last-layer posterior on 24 pairs: the posterior runs'
    reward source."""
    from conftest import llama_config

    from lit_rlhf.data import PreferenceDataModule
    from lit_rlhf.models import ModelSpec, build_score_model, load_tokenizer
    from lit_rlhf.posterior import fit_posterior

    folder = tmp_path_factory.mktemp("posterior")
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_score_model(ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=7), tokenizer)
    model.save_pretrained(folder / "rm")
    tokenizer.save_pretrained(folder / "rm")
    rows = [{"prompt": f"review {i}:", "chosen": " good" * (1 + i % 3), "rejected": " bad e" * (1 + i % 2)}
            for i in range(24)]  # fmt: skip
    (folder / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PreferenceDataModule(tokenizer_dir, str(folder / "pairs.jsonl"), max_length=32, max_prompt_length=16,
                                batch_size=8)  # fmt: skip
    return str(fit_posterior(folder / "rm", data, folder / "posterior"))


@pytest.fixture(scope="module")
def run(tokenizer_dir, posterior_dir, tmp_path_factory):
    """strategy -> the worker's results.json (one launch per strategy and module, its ``RUNS`` in turn)."""
    cache: dict[str, dict] = {}

    def _run(strategy: str) -> dict:
        if strategy not in cache:
            out = tmp_path_factory.mktemp(strategy)
            launch = [sys.executable]
            if strategy != "single":
                launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd = [*launch, str(WORKER), "--strategy", strategy, "--tokenizer", tokenizer_dir, "--out", str(out)]
            cmd += ["--runs", RUNS[strategy]] + (["--resume"] if strategy == "fsdp2" else [])
            cmd += ["--posterior", posterior_dir] if "posterior" in RUNS[strategy] else []
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            proc = run_launch(cmd, env, TIMEOUT, f"{strategy} launch ({RUNS[strategy]})")
            # torchrun prefixes each rank's own traceback with [rankN]: show those, and the launcher's summary
            ranks = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank"))
            assert proc.returncode == 0, (ranks[-4000:] + "\n" + proc.stderr[-2000:])
            cache[strategy] = json.loads((out / "results.json").read_text())
        return cache[strategy]

    return _run


def assert_close_lists(actual: list[float], expected: list[float], what: str) -> None:
    assert len(actual) == len(expected), (what, actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= TOL, f"{what}[{i}]: {a} != {e}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_losses_equal_single_process(run, strategy):
    single, dist = run("single"), run(strategy)
    # RM: 3 optimiser steps on the same global batches; step 1 checks the sharded forward, steps 2-3
    # that the reduced gradients (and the optimiser on shards) equal the single process's.
    assert_close_lists(dist["rm"]["loss"], single["rm"]["loss"], f"{strategy} rm train/loss")
    # validation on all 24 pairs, 12 per rank: the logged loss is the mean over both ranks (was rank 0's)
    assert len(single["rm"]["val_loss"]) == 1
    assert_close_lists(dist["rm"]["val_loss"], single["rm"]["val_loss"], f"{strategy} rm val/loss")
    for run_name in ("ppo", "ppo_lora"):
        expected, actual = single[run_name]["metrics"], dist[run_name]["metrics"]
        # The worker's exact-equality preconditions: every response has the full length T = 6
        # (token means per rank then equal the global token mean) and some reward signal exists.
        assert expected["rollout/response_length"] == [6.0, 6.0, 6.0]
        assert any(s > 0 for s in expected["rollout/score"])
        for key, values in expected.items():
            assert_close_lists(actual[key], values, f"{strategy} {run_name} {key}")
        # the policy moved: KL to the reference grows after the first rollout's update
        assert actual["rollout/kl_ref"][0] == pytest.approx(0.0, abs=1e-5)
        assert actual["rollout/kl_ref"][2] > 0.01


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ensemble_members_clipped_each_on_its_own_equal_single_process(run, strategy):
    # RewardEnsembleModule clips each member's gradient on its own; a clip every step binds makes the later
    # losses depend on it, so equal losses mean equal (reduced, or sharded) norms per member
    expected = run("single")["rm_ensemble"]
    assert len(expected) == 3 and expected[-1] < expected[0]
    assert_close_lists(run(strategy)["rm_ensemble"], expected, f"{strategy} ensemble train/loss")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_generation_equals_unsharded(run, strategy):
    # The first rollout is generated before any update, by the same initial weights: with top_k=1
    # sampling is greedy, so each prompt's response must be the unsharded model's token for token
    # (a plain HF actor and a peft actor, whose generate() bypasses the FSDP root forward).
    single, dist = run("single"), run(strategy)
    for run_name in ("ppo", "ppo_lora"):
        assert len(single[run_name]["responses"]) == 8
        assert dist[run_name]["responses"] == single[run_name]["responses"]


def test_fsdp2_sharded_resume_equals_uninterrupted(run):
    result = run("fsdp2")
    resume, full = result["resume"], result["ppo"]["metrics"]
    assert resume["sharded"], "the FSDP2 checkpoint should be a sharded (directory) checkpoint"
    for key, values in full.items():
        # rollout 1 before the checkpoint, rollouts 2-3 after resuming in a fresh module and trainer
        assert_close_lists(resume["first"][key] + resume["rest"][key], values, f"resume {key}")


def test_fsdp2_grpo_equals_single_process(run):
    # K = 2 sampled responses per prompt, groups local to each rank, KL in the reward (adaptive) and in
    # the loss, per-response means: every logged mean equals the single process's.
    expected, actual = run("single")["grpo"]["metrics"], run("fsdp2")["grpo"]["metrics"]
    assert len(expected["rollout/score"]) == 3
    assert any(s > 0 for s in expected["rollout/group_score_std"]), "some group carries signal"
    for key, values in expected.items():
        assert_close_lists(actual[key], values, f"fsdp2 grpo {key}")
    assert actual["rollout/kl_ref"][2] > 0.01, "the policy moved"


def test_fsdp2_posterior_reward_equals_single_process(run):
    # the posterior's reward model sharded like the actor: its score, its spread (read from the sharded head's
    # input) and the total the policy optimises are each rank's rows of the single process's
    expected, actual = run("single")["posterior"]["metrics"], run("fsdp2")["posterior"]["metrics"]
    assert len(expected["rollout/reward/uncertainty"]) == 2
    assert all(u > 0 for u in expected["rollout/reward/uncertainty"]), "the spread is measured"
    for key, values in expected.items():
        assert_close_lists(actual[key], values, f"fsdp2 posterior {key}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_dpo_losses_equal_single_process(run, strategy):
    # 3 optimiser steps on the same global batches of 8 pairs (4 per rank), then validation on all 24;
    # the precomputed run scores the data sets with each rank's share and all-gathers them.
    single, dist = run("single"), run(strategy)
    # validation of 23 pairs on two ranks (Lightning's sampler injected): each pair counted once, as in one process
    assert_close_lists(dist["dpo"]["val23"], single["dpo"]["val23"], f"{strategy} dpo 23-pair validation")
    for name in ("dpo", "dpo_precomputed"):
        for key, values in single[name].items():
            if key == "val23":
                continue
            assert len(values) == (1 if key == "val/loss" else 3), (name, key, values)
            assert_close_lists(dist[name][key], values, f"{strategy} {name} {key}")
    assert_close_lists(single["dpo_precomputed"]["train/loss"], single["dpo"]["train/loss"], "precomputed vs live")
    losses = single["dpo"]["train/loss"]
    assert abs(losses[0] - 0.693147) < 1e-5 and losses[-1] < losses[0], losses


def test_fsdp2_episodes_ending_at_different_turns_per_rank_do_not_hang(run):
    # rank 0's episodes end after one turn, rank 1's after two: rank 0 keeps the collective generation in
    # step with discarded turns (a hang is killed at TIMEOUT and fails the launch)
    turns = run("fsdp2")["multiturn"]["turns"]
    assert turns and all(t == pytest.approx(1.5) for t in turns), turns
