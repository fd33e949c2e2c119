"""PPOModule: the first-minibatch invariants, learning on rule and model rewards, LoRA reference."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import gpt2_config, llama_config
from ppo_helpers import prompt_loader, tiny_ppo, trainer

from lit_rlhf.modules import PPOModule
from lit_rlhf.rollout import GenerationSettings


def read_metrics(tmp_path) -> list[dict[str, float]]:
    """Rows of the CSVLogger's metrics.csv that hold rollout metrics, as floats."""
    (path,) = tmp_path.glob("ppo/version_*/metrics.csv")
    with open(path) as f:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    return [r for r in rows if "rollout/score" in r]


class RecordingPPO(PPOModule):
    """Records the loss stats of every micro-batch of the update."""

    def ppo_loss(self, part):
        loss, stats = super().ppo_loss(part)
        self.recorded = [*getattr(self, "recorded", []), stats]
        return loss, stats


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_first_minibatch_ratio_is_one_and_kl_ref_zero(tokenizer_dir, tmp_path, config):
    # Before the first optimiser step the policy is the rollout policy, so r = exp(lp - old) = 1
    # (to float error); a mismatch means a mask, dropout or temperature bug. Dropout is configured on
    # and the temperature is not 1 to make sure both are handled. The reference is the initial actor,
    # so the first rollout's KL to it is 0.
    if config["model_type"] == "gpt2":
        config = {**config, "attn_pdrop": 0.3, "resid_pdrop": 0.3, "embd_pdrop": 0.3}
    module = tiny_ppo(
        tokenizer_dir,
        config,
        cls=RecordingPPO,
        max_rollouts=1,
        generation=GenerationSettings(max_new_tokens=8, temperature=0.7),
    )
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir))
    first = module.recorded[0]
    assert first["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert first["ratio_max"].item() == pytest.approx(1.0, abs=1e-5)
    assert first["approx_kl"].item() < 1e-10
    assert first["clipfrac"].item() == 0.0
    (row,) = read_metrics(tmp_path)
    assert row["rollout/kl_ref"] == pytest.approx(0.0, abs=1e-5)
    # the later minibatches do move the policy
    assert max(s["approx_kl"].item() for s in module.recorded) > 0


def _score_and_kl(rows, n=5):
    first = sum(r["rollout/score"] for r in rows[:n]) / n
    last = sum(r["rollout/score"] for r in rows[-n:]) / n
    return first, last, rows[-1]["rollout/kl_ref"]


def test_rule_reward_rises_and_kl_grows(tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=20)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    rows = read_metrics(tmp_path)
    assert len(rows) == 20
    first, last, kl = _score_and_kl(rows)
    # The random policy writes 'the' about once in 16 responses; the score is capped at 8 (tokens).
    assert first < 0.5
    assert last > first + 2.0, (first, last)
    assert rows[0]["rollout/kl_ref"] == pytest.approx(0.0, abs=1e-5)
    assert kl > 1.0
