"""Non-finite guards of the online modules (PPO, GRPO): score policy, skipped steps, the rollout limit."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from ppo_rewards import CALLS

from lit_rlhf import functional as F
from lit_rlhf.guards import NonFiniteError, check_finite_weights
from lit_rlhf.modules.optim import WarmupCosineLR

NAN_FN = "ppo_rewards:nan_in_second_rollout"


def build(kind: str, tokenizer_dir: str, **overrides):
    CALLS["nan_in_second_rollout"] = 0
    if kind == "ppo":
        return tiny_ppo(tokenizer_dir, gpt2_config(), **overrides)
    return tiny_critic_free(tokenizer_dir, gpt2_config(), **overrides)


def logged(tmp_path: Path) -> list[dict[str, str]]:
    (path,) = tmp_path.rglob("metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_nonfinite_score_raises_naming_rollout_source_prompt_and_response(kind, tokenizer_dir, tmp_path):
    module = build(kind, tokenizer_dir, reward_fn=NAN_FN, max_rollouts=3)
    assert module.hparams.scoring["on_nonfinite"] == "raise", "the default stops the fit"
    with pytest.raises(NonFiniteError) as err:
        trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir))
    message = str(err.value)
    assert f"rollout 2: reward_fn {NAN_FN}" in message and "row 1" in message
    assert "prompt 'i loved the'" in message or "prompt 'the food was'" in message
    assert "response '" in message and "on_nonfinite='drop'" in message
    assert module.rollouts_done == 1
    check_finite_weights(module.actor, "actor")


def test_a_rollout_without_a_finite_score_stops_the_fit_under_drop_saying_why(tokenizer_dir, tmp_path):
    module = build("grpo", tokenizer_dir, reward_fn="ppo_rewards:always_nan", scoring={"on_nonfinite": "drop"})
    with pytest.raises(NonFiniteError) as err:
        trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    message = str(err.value)
    assert "rollout 1: reward_fn ppo_rewards:always_nan returned non-finite scores for every row" in message
    assert "every row of the rollout is non-finite; nothing to learn from" in message
    assert "on_nonfinite='drop'" not in message, "drop is already set"


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_nonfinite_score_dropped_counted_and_weights_stay_finite(kind, tokenizer_dir, tmp_path):
    module = build(kind, tokenizer_dir, reward_fn=NAN_FN, max_rollouts=3, scoring={"on_nonfinite": "drop"})
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir))
    assert module.rollouts_done == 3
    check_finite_weights(module.actor, "actor")
    rows = logged(tmp_path)
    assert column(rows, "rollout/nonfinite_scores") == [0.0, 1.0, 0.0]
    prefix = "ppo" if kind == "ppo" else "policy"
    for key in ("rollout/score", f"{prefix}/policy_loss", f"{prefix}/advantages_mean"):
        assert len(column(rows, key)) == 3 and all(map(math.isfinite, column(rows, key))), key
    assert column(rows, f"{prefix}/nonfinite_steps") == [0.0, 0.0, 0.0], "no NaN reached a loss"


def test_dropped_rows_are_imputed_by_their_group_so_group_estimators_stay_finite():
    scores = torch.tensor([1.0, float("nan"), 3.0, 5.0, float("inf"), float("nan"), 2.0, 2.0])
    keep = torch.isfinite(scores)
    filled = F.fill_dropped_scores(scores, keep, group_size=4)
    # group 1: kept mean (1 + 3 + 5) / 3 = 3; group 2: kept mean 2
    assert filled.tolist() == [1.0, 3.0, 3.0, 5.0, 2.0, 2.0, 2.0, 2.0]
    grpo = F.grpo_advantages(filled, 4)
    rloo = F.rloo_advantages(filled, 4)
    assert torch.isfinite(grpo).all() and torch.isfinite(rloo).all()
    assert grpo[1] == 0 and grpo[4:].eq(0).all(), "the filled row sits at its group mean"
    # a group with no kept row takes the mean of every kept row
    all_bad = torch.tensor([float("nan")] * 2 + [1.0, 3.0])
    assert F.fill_dropped_scores(all_bad, torch.isfinite(all_bad), 2).tolist() == [2.0, 2.0, 1.0, 3.0]


def test_dropped_rows_carry_no_policy_or_value_gradient(tokenizer_dir):
    from lit_rlhf.rollout import Rollout

    module = build("ppo", tokenizer_dir, reward_fn=NAN_FN)
    B, T = 4, 3
    ones = torch.ones(B, T)
    rollout = Rollout(
        torch.ones(B, T + 2, dtype=torch.long), torch.ones(B, T + 2), ones.bool(), ones, ones,
        old_values=torch.full((B, T), 0.5), rewards=ones, advantages=ones * 2, returns=ones * 3, scores=ones[:, 0],
    )  # fmt: skip
    out = module.drop_rows(rollout, torch.tensor([True, False, True, True]))
    assert out.advantages[1].eq(0).all() and out.advantages[[0, 2, 3]].eq(2).all()
    assert out.returns[1].eq(0.5).all() and out.returns[[0, 2, 3]].eq(3).all()
    assert out.response_mask.shape == (B, T), "shapes kept for collective forwards"


def test_nonfinite_gradient_is_never_stepped_on_either_optimiser(tokenizer_dir, tmp_path):
    module = build("ppo", tokenizer_dir, max_rollouts=3)
    seen = []
    params = [*module.actor.parameters(), *module.critic.parameters()]

    def poison(grad):  # every gradient of rollout 2's update is infinite
        return grad + float("inf") if module.rollouts_done == 1 else grad

    next(module.actor.parameters()).register_hook(poison)
    original = module.on_train_batch_start
    module.on_train_batch_start = lambda *a: (seen.append([p.detach().clone() for p in params]), original(*a))[1]
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir))
    steps = module.hparams["update"]["epochs"] * module.hparams["update"]["num_minibatches"]  # (.update is dict.update)
    assert module.step_guard.skipped == steps
    assert all(torch.equal(a, b) for a, b in zip(seen[1], seen[2])), "actor and critic untouched in rollout 2"
    assert not all(torch.equal(a, b) for a, b in zip(seen[0], seen[1])), "rollout 1 trained"
    check_finite_weights(module.actor, "actor")
    check_finite_weights(module.critic, "critic")
    assert column(logged(tmp_path), "ppo/nonfinite_steps") == [0.0, 1.0, 0.0]
    # the count is kept in checkpoints
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["online_state"]["step_guard"] == {"skipped": steps}


def _scheduler(optimizer):
    return WarmupCosineLR(optimizer, warmup_steps=0, total_steps=-1)


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_end_of_run_resume_never_exceeds_max_rollouts_and_a_larger_limit_continues(kind, tokenizer_dir, tmp_path):
    module = build(kind, tokenizer_dir, max_rollouts=2, actor_scheduler=_scheduler)
    fit = trainer(tmp_path / "a")
    fit.fit(module, prompt_loader(tokenizer_dir))
    ckpt = tmp_path / "end.ckpt"
    fit.save_checkpoint(ckpt)
    # the same limit: nothing more runs
    same = build(kind, tokenizer_dir, max_rollouts=2, actor_scheduler=_scheduler)
    same.training_step = lambda *a: pytest.fail("a rollout past max_rollouts ran")
    trainer(tmp_path / "b").fit(same, prompt_loader(tokenizer_dir), ckpt_path=ckpt)
    assert same.rollouts_done == 2
    # a larger limit: continues to it, with the LR schedule stretched to the new length
    larger = build(kind, tokenizer_dir, max_rollouts=4, actor_scheduler=_scheduler)
    resumed = trainer(tmp_path / "c")
    resumed.fit(larger, prompt_loader(tokenizer_dir), ckpt_path=ckpt)
    assert larger.rollouts_done == 4
    scheduler = resumed.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == 4 and scheduler.last_epoch == 4


def test_cli_fit_with_a_nonfinite_score_exits_nonzero_naming_rollout_source_and_prompt(tokenizer_dir, prompt_file, tmp_path):
    from test_cli_reliability import ppo_fit

    proc = ppo_fit(tokenizer_dir, prompt_file, tmp_path, f"--model.init_args.reward_fn={NAN_FN}")
    assert proc.returncode != 0
    assert f"NonFiniteError: rollout 2: reward_fn {NAN_FN} returned non-finite scores" in proc.stderr
    assert "first: row 1, score nan, prompt '" in proc.stderr and "response '" in proc.stderr
    assert not list(tmp_path.rglob("model.safetensors")), "nothing exported"
