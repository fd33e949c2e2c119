"""Tiny PPO and GRPO fits with the vLLM engine (``engine: vllm``) against the real vLLM: they raise the rule
reward as the Hugging Face engine's do, on policy (importance ratios ~1, log-prob gaps small after every
sync), a seeded run repeats, and a LoRA actor is synced. Runs in ``.venv-vllm`` (``make test-vllm``)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make test-vllm)")
pytestmark = pytest.mark.vllm

from conftest import gpt2_config  # noqa: E402
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer  # noqa: E402
from test_online_contract import read_metrics  # noqa: E402
from test_vllm_engine import vllm_llama  # noqa: E402

ENGINE = {"class_path": "vllm", "init_args": {"kv_cache_gib": 1}}
# the share of "e" characters: a dense rule reward this Llama (the smallest vLLM's CPU kernels take) learns
# within a few rollouts with either engine (Hugging Face: 0.08 -> 0.19 over 12 rollouts, vLLM 0.07 -> 0.23)
REWARD = "ppo_rewards:e_rate"
TIMINGS = ("rollout/engine_generate_s", "rollout/engine_sync_s")


def score_rise(rows, n=4):
    return sum(r["rollout/score"] for r in rows[:n]) / n, sum(r["rollout/score"] for r in rows[-n:]) / n


def assert_on_policy(rows, limit=1e-4):
    """The engine sampled from the trainer's current weights at every rollout: the trainer's and the
    engine's log-probs of every sampled token agree to float rounding (these fits move the policy by
    17-20 nats of KL, so a missed sync shows)."""
    for row in rows:
        assert row["rollout/logprob_diff_max"] < limit, row["rollout/logprob_diff_max"]
        assert abs(row["rollout/is_ratio_mean"] - 1) < limit, row["rollout/is_ratio_mean"]
        assert row["rollout/engine_sync_s"] > 0 and row["rollout/engine_generate_s"] > 0


def test_grpo_with_the_vllm_engine_raises_the_rule_reward_and_repeats(tokenizer_dir, tmp_path):
    def fit(root, **overrides):
        torch.manual_seed(0)
        module = tiny_critic_free(tokenizer_dir, vllm_llama(322), engine=ENGINE, reward_fn=REWARD,
                                  max_rollouts=12, **overrides)
        trainer(root).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
        return read_metrics(root)

    rows = fit(tmp_path / "a")
    first, last = score_rise(rows)
    assert last > first + 0.06, (first, last)
    assert_on_policy(rows)
    again = fit(tmp_path / "b")
    assert len(again) == len(rows)
    for a, b in zip(rows, again):  # a seeded run repeats (the engine's timings aside)
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}


def test_ppo_with_the_vllm_engine_raises_the_rule_reward(tokenizer_dir, tmp_path):
    # test_ppo's rule-reward fit (16 prompts a rollout, the count of "the"), on a GPT-2 of head dim 32; its
    # sparse reward is first found at rollout 18 with this engine's draws (rollout 7 with Hugging Face's)
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, {**gpt2_config(), "n_embd": 64}, engine=ENGINE, max_rollouts=24)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    rows = read_metrics(tmp_path)
    first, last = score_rise(rows)
    assert last > first + 1.0, (first, last)
    assert_on_policy(rows)


@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_a_lora_actor_is_synced_after_every_update(tokenizer_dir, tmp_path, lora_sync):
    engine = {"class_path": "vllm", "init_args": {"kv_cache_gib": 1, "lora_sync": lora_sync}}
    torch.manual_seed(0)
    actor = {"config": vllm_llama(322), "tokenizer": tokenizer_dir, "seed": 0,
             "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"]}}  # fmt: skip
    module = tiny_critic_free(tokenizer_dir, vllm_llama(322), actor=actor, engine=engine, reward_fn=REWARD, max_rollouts=8,
                              actor_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-2))  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    rows = read_metrics(tmp_path)
    assert_on_policy(rows)
    assert rows[-1]["rollout/kl_ref"] > 0.01, "the adapters moved the policy (so the syncs carried something)"


def test_without_the_syncs_the_on_policy_check_fails(tokenizer_dir, tmp_path, monkeypatch):
    # the same fit with the engine never synced after the first load: it samples from the initial
    # weights, and the check above sees it (so it can fail)
    from lit_rlhf.engines.vllm import VLLMEngine

    sync = VLLMEngine.sync_weights
    monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self, model: None if self.timings.get("sync_s") else sync(self, model))
    torch.manual_seed(0)
    module = tiny_critic_free(tokenizer_dir, vllm_llama(322), engine=ENGINE, reward_fn=REWARD, max_rollouts=6)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    rows = read_metrics(tmp_path)
    with pytest.raises(AssertionError):
        assert_on_policy(rows)
    assert rows[-1]["rollout/logprob_diff_mean"] > 0.1


def test_the_cli_runs_grpo_with_engine_vllm(tokenizer_dir, prompt_file, tmp_path):
    # what the README and configs/grpo_tiny.yaml tell a user: --model.init_args.engine=vllm, with an
    # evaluation rollout and the export
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_sft_rm import tb_scalars

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "grpo"
    cmd = [
        sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(root / "configs/grpo_tiny.yaml"),
        "--model.init_args.engine=vllm", "--model.init_args.actor=null",
        f'--model.init_args.actor={{"config": {{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2}}, "tokenizer": "{tokenizer_dir}"}}',
        "--model.init_args.reward_model=null", "--model.init_args.reward_fn=ppo_rewards:e_rate",
        "--model.init_args.max_rollouts=3", "--model.init_args.generation.max_new_tokens=6",
        f"--data.init_args.tokenizer={tokenizer_dir}", f"--data.init_args.train_path={prompt_file}",
        f"--data.init_args.val_path={prompt_file}", "--data.init_args.test_path=null",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        f"--trainer.logger.init_args.save_dir={run}", f"--trainer.default_root_dir={run}",
        "--trainer.callbacks=lit_rlhf.callbacks.HFExport", f"--trainer.callbacks.dirpath={run}/export",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = tb_scalars(run)
    for tag in ("rollout/score", "rollout/engine_generate_s", "rollout/engine_sync_s", "rollout/is_weight_mean",
                "val/score"):  # fmt: skip
        assert tag in scalars, (tag, sorted(scalars))
    assert (run / "export" / "actor" / "config.json").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_a_vllm_engine_per_rank_under_data_parallelism(tokenizer_dir, tmp_path, strategy):
    # two processes (gloo), each with its own vLLM engine generating its prompts; sharded actors are
    # gathered for every sync; the trainer's process group outlives the engines (the export runs after)
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "vllm_ddp_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
           "--strategy", strategy, "--tokenizer", tokenizer_dir, "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    ranks = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank"))
    assert proc.returncode == 0, ranks[-3000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 4
    assert_on_policy(rows)  # the metrics are reduced over both ranks: max and mean over every engine
    assert rows[-1]["rollout/kl_ref"] > 0.01
    assert (tmp_path / "export" / "actor" / "config.json").exists()


def test_a_resumed_run_repeats_the_uninterrupted_one(tokenizer_dir, tmp_path, prompt_file):
    # 4 rollouts uninterrupted vs 2 + resume to 4 with the vLLM engine: rollouts 3-4 log the same values
    # (the engine restarts with the resumed weights; the request seeds come from the restored generator)
    from test_ppo import StopAfter

    from lit_rlhf.data import PromptDataModule

    def run(root, callbacks=(), ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_critic_free(tokenizer_dir, vllm_llama(322), engine=ENGINE, reward_fn=REWARD, max_rollouts=4)
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=4, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(module, data, ckpt_path=ckpt_path)
        return read_metrics(root)

    full = run(tmp_path / "full")
    run(tmp_path / "part", callbacks=[StopAfter(2)])
    resumed = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "part" / "mid.ckpt"))
    assert len(full) == 4 and len(resumed) == 2
    for a, b in zip(full[2:], resumed):
        for key in set(a) - {"epoch", "step", *TIMINGS}:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_multi_turn_episodes_with_the_vllm_engine_stay_on_policy(tokenizer_dir, tmp_path):
    # the environment's observation is appended as tokens after each vLLM turn; the next turn is generated
    # by vLLM from those token ids, and the trainer scores the same ids: the log-probs agree on the model's
    # tokens (the observation is a hole in the loss mask)
    torch.manual_seed(0)
    module = tiny_critic_free(tokenizer_dir, vllm_llama(322), engine=ENGINE, reward_fn=REWARD, max_rollouts=3,
                              environment={"env": "test_environments:Followup"})  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=12, batch_size=4))
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["rollout/turns"] == 2 and r["rollout/observation_tokens"] > 0 for r in rows)
    assert_on_policy(rows)
