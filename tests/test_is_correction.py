"""The engine/trainer importance-sampling correction in the online modules (``update.is_correction``).

An engine written here wraps the Hugging Face engine and perturbs its behaviour log-probs by a known
amount per response position (mu x 3, mu / 4, unchanged: token ratios pi_old / mu of 1/3, 4 and 1), so the
expected weights are known by hand. Checked: the losses PPO and GRPO optimise are the hand-weighted ones
(computed from the rollout tensors with the pure functions of ``losses.py``), the ``rollout/is_*`` metrics
are the hand-computed ones, the Hugging Face engine's weights are 1 and change no loss, the default
(``auto``) leaves the Hugging Face engine alone, tiny fits with the correction still learn, a resumed run
repeats, and the settings check themselves (Python and CLI).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from test_online_contract import read_metrics
from test_ppo import StopAfter

from lit_rlhf import functional as F
from lit_rlhf.engines import HFEngine, Responses, RolloutEngine
from lit_rlhf.modules.online_correction import ISCorrectionMode
from lit_rlhf.modules.online_settings import ISCorrectionSettings, UpdateSettings

ROOT = Path(__file__).resolve().parents[1]
# log mu - log mu_HF at response position t % 3: mu x 3 (ratio 1/3), mu / 4 (ratio 4), unchanged
SHIFTS = (math.log(3.0), -math.log(4.0), 0.0)


def shifts(T: int, scale: float = 1.0) -> torch.Tensor:
    """(T,) the perturbation of each response position."""
    return scale * torch.tensor([SHIFTS[t % 3] for t in range(T)])


class PerturbedEngine(RolloutEngine):
    """The Hugging Face engine's responses with behaviour log-probs shifted by ``scale * SHIFTS``; an engine
    with its own copy of the policy as far as the module can tell (``uses_policy`` False)."""

    def __init__(self, scale: float = 1.0) -> None:
        self.inner, self.scale, self.responses = HFEngine(), scale, []

    def setup(self, model, tokenizer, *, world_size=1):
        super().setup(model, tokenizer, world_size=world_size)
        self.inner.setup(model, tokenizer, world_size=world_size)

    def generate(self, prompt_ids, prompt_mask, settings, *, greedy=False):
        out = self.inner.generate(prompt_ids, prompt_mask, settings, greedy=greedy)
        self.responses.append(out)
        shifted = torch.where(out.mask, out.logprobs + shifts(out.ids.shape[1], self.scale), 0.0)
        return out._replace(logprobs=shifted)


def hand_weights(mask: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """(B, T) min(pi_old / mu, C) by hand: 1/3, min(4, C), 1 by position, 0 off the mask."""
    ratios = torch.tensor([1 / 3, min(4.0, cap), 1.0])
    return torch.where(mask, ratios[torch.arange(mask.shape[1]) % 3], 0.0)


def hand_policy_loss(module, part, weights) -> torch.Tensor:
    """The clipped surrogate of ``part`` with ``weights`` multiplied in by hand (same forward as the loss)."""
    update, T = module.update, part.response_mask.shape[1]
    with torch.no_grad():
        logprobs, _ = module.actor_forward(
            module.actor, part.input_ids, part.attention_mask, T, module.generation.temperature, entropy=False
        )
    mask = part.loss_mask
    ratio = torch.where(mask, (logprobs - part.old_logprobs).exp(), 0.0)
    adv = torch.where(mask, part.advantages, 0.0)
    high = update.clip_coef if update.clip_coef_high is None else update.clip_coef_high
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - update.clip_coef, 1 + high))
    return F.aggregate_loss(terms * weights, mask, update.loss_aggregation, module.generation.max_new_tokens)


def record_losses(module, name: str, weights_fn) -> list:
    """Wrap the module's loss ``name``: each call records (part, its policy loss, the hand-weighted loss with
    ``weights_fn(part)``, the unweighted one), the hand losses from the same weights as the call's."""
    calls, loss_fn = [], getattr(module, name)

    def recorded(part):
        loss, stats = loss_fn(part)
        if part.old_logprobs is None:  # the on-policy shortcut: the old log-probs are the update's own
            calls.append((part, stats["policy_loss"], None, None))
        else:
            unweighted = hand_policy_loss(module, part, part.loss_mask.float())
            calls.append(
                (part, stats["policy_loss"], hand_policy_loss(module, part, weights_fn(part)), unweighted)
            )
        return loss, stats

    setattr(module, name, recorded)
    return calls


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_the_loss_is_the_hand_weighted_loss_and_the_metrics_are_right(tokenizer_dir, tmp_path, kind):
    engine = PerturbedEngine()
    if kind == "grpo":
        # a dense reward (non-zero advantages); a second epoch, whose ratios are not 1 (in the first, the
        # loss of zero-sum group advantages over equally long responses is 0 whatever the weights)
        module = tiny_critic_free(
            tokenizer_dir,
            gpt2_config(),
            engine=engine,
            max_rollouts=2,
            reward_fn="ppo_rewards:e_rate",
            update={"epochs": 2, "num_minibatches": 1},
        )
        calls = record_losses(module, "policy_loss", lambda part: hand_weights(part.loss_mask))
    else:
        module = tiny_ppo(tokenizer_dir, gpt2_config(), engine=engine, max_rollouts=2)
        calls = record_losses(module, "ppo_loss", lambda part: hand_weights(part.loss_mask))
    assert module.update.is_correction.mode == "auto"  # auto: TIS for an engine that is not the policy
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=8 if kind == "ppo" else 4))
    assert calls
    for part, policy_loss, expected, _ in calls:
        torch.testing.assert_close(part.is_weights, hand_weights(part.loss_mask), atol=1e-4, rtol=0)
        torch.testing.assert_close(policy_loss, expected, atol=1e-5, rtol=1e-4)
    assert max(abs(float(c[2] - c[3])) for c in calls) > 1e-3, "the weights changed the loss"
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row, responses in zip(rows, engine.responses):
        w = hand_weights(responses.mask)[responses.mask]  # (N,) the rollout's learned tokens
        clipped = float((w == 2.0).float().mean())
        assert row["rollout/is_weight_mean"] == pytest.approx(float(w.mean()), abs=1e-4)
        assert row["rollout/is_weight_max"] == pytest.approx(2.0)
        assert row["rollout/is_clipped_frac"] == pytest.approx(clipped, abs=1e-6) and 0 < clipped < 1
        assert row["rollout/is_ess"] == pytest.approx(
            float(w.sum() ** 2 / (w.numel() * w.square().sum())), abs=1e-4
        )
        assert row["rollout/is_ratio_max"] == pytest.approx(4.0, rel=1e-4)  # the raw token ratio
        assert "rollout/is_masked_frac" not in row and "rollout/is_seq_ratio_mean" not in row


def test_the_hf_engine_weights_are_one_and_change_no_loss(tokenizer_dir, tmp_path):
    # top-k truncation: the kept mass Z < 1 at every step is not part of the weights (trainer's support)
    module = tiny_critic_free(
        tokenizer_dir,
        gpt2_config(),
        max_rollouts=2,
        update={"is_correction": {"mode": "token_truncate"}},
        generation={"max_new_tokens": 8, "num_samples": 4, "top_k": 20, "temperature": 0.7},
    )
    calls = record_losses(module, "policy_loss", lambda part: part.loss_mask.float())
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    for part, policy_loss, unweighted, _ in calls:
        mask = part.loss_mask
        assert (part.is_weights[mask] - 1).abs().max() < 1e-4 and (part.is_weights[~mask] == 0).all()
        torch.testing.assert_close(policy_loss, unweighted, atol=1e-6, rtol=1e-4)
    rows = read_metrics(tmp_path)
    for row in rows:
        assert row["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["rollout/is_ess"] == pytest.approx(1.0, abs=1e-6) and row["rollout/is_clipped_frac"] == 0.0


def test_auto_leaves_the_hf_engine_and_an_engine_without_logprobs_alone(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1)
    calls = record_losses(module, "policy_loss", lambda part: part.loss_mask.float())
    trainer(tmp_path / "hf").fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    assert calls and all(c[0].is_weights is None for c in calls)
    rows = read_metrics(tmp_path / "hf")
    assert not any(k.startswith("rollout/is_w") for k in rows[0])
    # the old log-probs are the sampler's own record here: no mismatch to measure, the kept mass only
    assert "rollout/kept_mass_mean" in rows[0] and "rollout/is_ratio_mean" not in rows[0]
    settings = ISCorrectionSettings()
    no_logprobs = Responses(torch.zeros(1, 2), torch.ones(1, 2).bool(), torch.zeros(1).bool())
    assert settings.resolve(PerturbedEngine(), no_logprobs, "M") is None
    assert settings.resolve(HFEngine(), no_logprobs._replace(logprobs=torch.zeros(1, 2)), "M") is None
    assert (
        settings.resolve(PerturbedEngine(), no_logprobs._replace(logprobs=torch.zeros(1, 2)), "M")
        == "token_truncate"
    )
    with pytest.raises(
        ValueError, match=r"M: update.is_correction.mode='token_mask' needs the engine's behaviour"
    ):
        ISCorrectionSettings(mode="token_mask").resolve(PerturbedEngine(), no_logprobs, "M")


def test_a_corrected_rollout_skips_the_on_policy_shortcut(tokenizer_dir, tmp_path):
    # one optimiser step per rollout: the HF engine's (uncorrected) rollout takes the old log-probs from the
    # update's forward; a corrected one needs them before the update, from the scoring forward
    old = {}
    for name, engine in (("hf", None), ("perturbed", PerturbedEngine())):
        module = tiny_critic_free(
            tokenizer_dir,
            gpt2_config(),
            engine=engine,
            max_rollouts=1,
            kl={"coef": 0.0},
            update={"epochs": 1, "num_minibatches": 1},
        )
        assert module.on_policy_update
        calls = record_losses(module, "policy_loss", lambda part: part.loss_mask.float())
        trainer(tmp_path / name).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
        old[name] = [(c[0].old_logprobs, c[0].is_weights) for c in calls]
    assert all(lp is None and w is None for lp, w in old["hf"])
    assert all(lp is not None and w is not None for lp, w in old["perturbed"])


def test_sequence_mask_masks_whole_responses_and_grpo_still_learns(tokenizer_dir, tmp_path):
    # geometric means of the position ratios (1/3, 4, 1, ...): 1/3 for a response of one token, within
    # [0.8, 1.25] for every longer one (e.g. (4/3)^(1/2) = 1.155, (4/9)^(1/4) = 0.816)
    torch.manual_seed(0)
    correction = {"mode": "sequence_mask", "cap": 1.25, "low": 0.8, "sequence_ratio": "geometric_mean"}
    engine = PerturbedEngine()
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), engine=engine, max_rollouts=20, update={"is_correction": correction}
    )
    calls = record_losses(module, "policy_loss", lambda part: part.loss_mask.float())
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    for part, *_ in calls[:8]:
        lengths = part.loss_mask.sum(1)
        per_row = part.is_weights.sum(1) / lengths.clamp(min=1)  # (b,) the response's one weight
        expected = torch.tensor(
            [0.0 if n == 1 else math.prod(([1 / 3, 4.0, 1.0] * 3)[:n]) ** (1 / n) for n in lengths.tolist()]
        )
        torch.testing.assert_close(per_row, expected, atol=1e-4, rtol=0)
    rows = read_metrics(tmp_path)
    for row, responses in zip(rows, engine.responses):
        one_token = float((responses.mask.sum(1) == 1).float().mean())
        assert row["rollout/is_masked_frac"] == pytest.approx(one_token)
    first = sum(r["rollout/score"] for r in rows[:5]) / 5
    last = sum(r["rollout/score"] for r in rows[-5:]) / 5
    assert last > first + 1.5, (first, last)


def test_ppo_with_truncated_weights_still_learns(tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, gpt2_config(), engine=PerturbedEngine(scale=0.5), max_rollouts=20)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    rows = read_metrics(tmp_path)
    first = sum(r["rollout/score"] for r in rows[:5]) / 5
    last = sum(r["rollout/score"] for r in rows[-5:]) / 5
    assert first < 0.5 and last > first + 2.0, (first, last)
    assert (
        rows[-1]["rollout/is_weight_max"] == pytest.approx(2.0, rel=1e-4)
        and rows[-1]["rollout/is_ess"] < 0.95
    )


def test_a_resumed_corrected_run_repeats(tokenizer_dir, tmp_path, prompt_file):
    from lit_rlhf.data import PromptDataModule

    def run(root, callbacks=(), ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_critic_free(
            tokenizer_dir,
            gpt2_config(),
            engine=PerturbedEngine(scale=0.3),
            max_rollouts=4,
            update={"is_correction": {"mode": "token_mask", "cap": 1.5, "low": 0.5}},
        )
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=4, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(
            module, data, ckpt_path=ckpt_path
        )
        return read_metrics(root)

    full = run(tmp_path / "full")
    run(tmp_path / "part", callbacks=[StopAfter(2)])
    resumed = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "part" / "mid.ckpt"))
    assert len(full) == 4 and len(resumed) == 2
    for a, b in zip(full[2:], resumed):
        assert set(a) == set(b) and "rollout/is_masked_frac" in a
        for key in a:
            if key not in ("epoch", "step"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(
    "values, message",
    [
        ({"mode": "tis"}, "update.is_correction.mode must be one of ['auto', 'none', 'token_truncate'"),
        ({"cap": 0.5}, "update.is_correction.cap must be >= 1"),
        ({"cap": float("inf")}, "update.is_correction.cap must be a finite number"),
        ({"mode": "token_mask", "low": 1.5}, "update.is_correction.low must be in [0, 1]"),
        (
            {"mode": "token_truncate", "low": 0.5},
            "update.is_correction.low must be 0 unless mode is token_mask",
        ),
        (
            {"mode": "token_mask", "sequence_ratio": "geometric_mean"},
            "sequence_ratio must be 'product' unless",
        ),
        (
            {"mode": "sequence_mask", "sequence_ratio": "mean"},
            "sequence_ratio must be one of ['product', 'geometric_mean']",
        ),
    ],
)
def test_the_settings_check_themselves_naming_the_key(values, message):
    with pytest.raises(ValueError) as err:
        UpdateSettings.coerce({"is_correction": values})
    assert message in str(err.value)
    with pytest.raises(
        TypeError, match=r"update.is_correction: unknown ISCorrectionSettings field\(s\) \['clip'\]"
    ):
        UpdateSettings(is_correction={"clip": 2.0})


def test_the_mode_names_come_from_the_registry():
    hints = {f.name: f.type for f in ISCorrectionSettings.__dataclass_fields__.values()}
    assert get_args(ISCorrectionMode) == ("auto", "none", *F.IS_CORRECTION_MODES)
    assert str(list(F.IS_SEQUENCE_RATIOS))[1:-1] in str(hints["sequence_ratio"])


def test_a_module_names_the_group_and_stores_it_as_plain_values(tokenizer_dir):
    with pytest.raises(ValueError, match=r"^PPOModule: update.is_correction.cap must be >= 1"):
        tiny_ppo(tokenizer_dir, gpt2_config(), update={"is_correction": {"cap": 0.9}})
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), update={"is_correction": {"mode": "sequence_truncate", "cap": 3.0}}
    )
    assert module.hparams["update"]["is_correction"] == {
        "mode": "sequence_truncate",
        "cap": 3.0,
        "low": 0.0,
        "sequence_ratio": "product",
    }


def test_the_cli_parses_the_group(tmp_path):
    def cli(*args):
        cmd = [sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", "configs/grpo_tiny.yaml", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)

    out = cli(
        "--model.init_args.update.is_correction.mode",
        "sequence_mask",
        "--model.init_args.update.is_correction.sequence_ratio",
        "geometric_mean",
        "--model.init_args.update.is_correction.low",
        "0.999",
        "--print_config",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    block = out.stdout.split("is_correction:")[1]
    for line in ("mode: sequence_mask", "cap: 2.0", "low: 0.999", "sequence_ratio: geometric_mean"):
        assert line in block, block
    # a value the group refuses: one line naming the key, when the command line is parsed (before any training)
    out = cli(
        "--model.init_args.update.is_correction.mode",
        "tis",
        "--trainer.max_steps",
        "1",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert out.returncode != 0
    assert (
        "error: model.init_args.update.is_correction.mode must be one of ['auto', 'none', 'token_truncate'" in out.stderr
    ), out.stderr[-2000:]
