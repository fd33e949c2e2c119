"""Length-bucketed micro-batches (lit_rlhf.batching): the planner's invariants, trimming, and that PPO,
GRPO, SFT, RM and DPO give the same losses, gradients and metrics with bucketing on as off."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import gpt2_config, llama_config
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch import seed_everything
from ppo_helpers import adamw, tiny_ppo, trainer

from lit_rlhf.batching import (
    Bucketing,
    padded_tokens,
    plan_micro_batches,
    rollout_micro_batches,
    scatter_rows,
    trim_prompt_response,
    trim_sequences,
)
from lit_rlhf.data.collators import PreferenceCollator, SFTCollator
from lit_rlhf.models import load_tokenizer
from lit_rlhf.modules import DPOModule, RewardModelModule, SFTModule
from lit_rlhf.modules.reward_model import PairMetrics
from lit_rlhf.rollout import Rollout

# bucket every batch, in small micro-batches cut by the least-cost planner
FORCED = {"token_budget": 48, "min_saving": 0.0, "split_cost": 4}
OFF = {"enabled": False}


# -- the planner --------------------------------------------------------------------------------------
@st.composite
def plans(draw):
    group_size = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 12))
    segments = draw(st.integers(1, 2))
    lengths = draw(
        st.lists(st.integers(0, 20), min_size=groups * group_size * segments, max_size=groups * group_size * segments)
    )
    budget = draw(st.one_of(st.none(), st.integers(1, 200)))
    max_rows = draw(st.one_of(st.none(), st.integers(1, 8)))
    return torch.tensor(lengths).view(-1, segments), budget, max_rows, group_size


def _plan_cost(lengths, plan, split_cost):
    return padded_tokens(lengths, plan) + split_cost * len(plan)


@settings(max_examples=200, deadline=None)
@given(plans(), st.integers(0, 50))
def test_least_cost_plan_is_valid_and_no_dearer_than_the_greedy_fill(case, split_cost):
    lengths, budget, max_rows, group_size = case
    plan = plan_micro_batches(lengths, budget, max_rows, group_size, split_cost)
    assert sorted(torch.cat(plan).tolist()) == list(range(lengths.shape[0]))
    for rows in plan:
        groups = rows.view(-1, group_size)
        assert (groups - groups[:, :1] == torch.arange(group_size)).all()
        single = len(groups) == 1
        width = int(lengths[rows].amax(0).sum())
        assert budget is None or len(rows) * width <= budget or single
        assert max_rows is None or len(rows) <= max_rows or single
    greedy = plan_micro_batches(lengths, budget, max_rows, group_size)
    assert _plan_cost(lengths, plan, split_cost) <= _plan_cost(lengths, greedy, split_cost)


def test_least_cost_plan_by_hand():
    lengths = torch.tensor([100, 10, 100, 10])  # sorted: rows 0, 2 (100), then 1, 3 (10)
    # cost 10 a micro-batch: one of 4 x 100 (410) > two of 2 x 100 and 2 x 10 (240) < four singles (260)
    two = plan_micro_batches(lengths, split_cost=10)
    assert [r.tolist() for r in two] == [[0, 2], [1, 3]]
    one = plan_micro_batches(lengths, split_cost=500)  # 900 < 1220: whole
    assert [r.tolist() for r in one] == [[0, 2, 1, 3]]
    with pytest.raises(ValueError, match="split_cost must be >= 0"):
        plan_micro_batches(lengths, split_cost=-1)


def test_split_cost_auto_resolves_by_model_size(tokenizer_dir):
    from lit_rlhf.batching import SPLIT_WORK
    from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer

    model = build_causal_lm(ModelSpec.coerce(spec(tokenizer_dir, llama_config())), load_tokenizer(tokenizer_dir))
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert Bucketing().resolved(model).split_cost == round(SPLIT_WORK / n)
    assert Bucketing(split_cost=7).resolved(model).split_cost == 7
    assert Bucketing(split_cost=None).resolved(model).split_cost is None
    for bad in (-1, "never", 1.5, True):
        with pytest.raises(ValueError, match="split_cost must be"):
            Bucketing(split_cost=bad)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_plan_covers_every_row_once_keeps_groups_and_respects_the_caps(case):
    lengths, budget, max_rows, group_size = case
    plan = plan_micro_batches(lengths, budget, max_rows, group_size)
    assert sorted(torch.cat(plan).tolist()) == list(range(lengths.shape[0]))
    for rows in plan:
        groups = rows.view(-1, group_size)
        # whole groups, their rows consecutive and in order
        assert (groups - groups[:, :1] == torch.arange(group_size)).all()
        assert (groups[:, 0] % group_size == 0).all()
        width = int(lengths[rows].amax(0).sum())
        single = len(groups) == 1
        assert budget is None or len(rows) * width <= budget or single
        assert max_rows is None or len(rows) <= max_rows or single
    # deterministic
    again = plan_micro_batches(lengths, budget, max_rows, group_size)
    assert all(torch.equal(a, b) for a, b in zip(plan, again))
    assert padded_tokens(lengths, plan) <= lengths.shape[0] * int(lengths.amax(0).sum())


def test_plan_hand_example():
    # segments (prompt, response); longest first: rows 3 (7+7), 1 (10+2), 4 (2+9), 0 (3+5), 5 (4+4), 2 (1+1)
    lengths = torch.tensor([[3, 5], [10, 2], [1, 1], [7, 7], [2, 9], [4, 4]])
    plan = plan_micro_batches(lengths, token_budget=40, max_rows=3)
    # [3, 1]: 2 x (10 + 7) = 34; with 4: 3 x (10 + 9) = 57 > 40. [4, 0, 5]: 3 x (4 + 9) = 39. [2]
    assert [p.tolist() for p in plan] == [[3, 1], [4, 0, 5], [2]]
    assert padded_tokens(lengths, plan) == 34 + 39 + 2
    assert [p.tolist() for p in plan_micro_batches(torch.tensor([5, 1, 9, 9, 2, 2]), 20, None, 2)] == [
        [2, 3],
        [0, 1, 4, 5],
    ]


def test_bucketing_settings_are_checked_and_skip_batches_that_gain_nothing():
    with pytest.raises(ValueError, match="token_budget"):
        Bucketing(token_budget=0)
    with pytest.raises(ValueError, match="min_saving"):
        Bucketing(min_saving=1.0)
    with pytest.raises(TypeError, match="PPOModule: scoring.bucketing: unknown Bucketing field"):
        Bucketing.coerce({"budget": 3}, "PPOModule: scoring.bucketing")
    assert Bucketing.coerce(False) == Bucketing(enabled=False)
    assert Bucketing.coerce({"token_budget": None}).token_budget is None
    equal = torch.full((8,), 10)
    assert Bucketing().plan(equal, 10, 4) is None  # nothing to trim
    assert Bucketing(enabled=False).plan(torch.tensor([1, 10]), 10) is None
    assert Bucketing(token_budget=None).plan(torch.tensor([1, 10, 1, 10]), 10, 2) is not None


def test_trimming_drops_the_columns_padded_in_every_row():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0]])  # P = 4, T = 3
    columns, t = trim_prompt_response(mask, 3)
    assert (columns, t) == (slice(1, 6), 2)
    assert trim_sequences(torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]])) == slice(1, 3)
    # a micro-batch whose responses are all empty keeps one response column
    assert trim_prompt_response(torch.tensor([[1, 1, 0, 0]]), 2) == (slice(0, 3), 1)
    b, P, T = 2, 4, 3
    rollout = Rollout(
        input_ids=torch.arange(b * (P + T)).view(b, P + T), attention_mask=mask,
        response_mask=mask[:, P:].bool(), old_logprobs=torch.randn(b, T), ref_logprobs=torch.randn(b, T),
        old_values=None, rewards=None, advantages=torch.randn(b, T), returns=None, scores=torch.randn(b),
    )  # fmt: skip
    trimmed = rollout.trim()
    assert torch.equal(trimmed.input_ids, rollout.input_ids[:, 1:6])
    assert torch.equal(trimmed.old_logprobs, rollout.old_logprobs[:, :2])
    assert trimmed.response_mask.sum() == rollout.response_mask.sum() and trimmed.prompt_length == 3
    assert torch.equal(trimmed.scores, rollout.scores) and trimmed.old_values is None


def test_scatter_rows_restores_batch_order_zero_filling_trimmed_columns():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])  # T = 2
    batches = rollout_micro_batches(mask, 2, Bucketing(token_budget=9, min_saving=0.0), max_rows=4)
    assert [b[0].tolist() for b in batches] == [[1], [0, 2, 3]]
    parts = [torch.full((len(rows), t), float(i + 1)) for i, (rows, _, t) in enumerate(batches)]
    out = scatter_rows(parts, [b[0] for b in batches], 4, 2)
    assert out.tolist() == [[2, 0], [1, 1], [2, 0], [2, 0]]


def assert_same_gradients(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient equal to float32 rounding: the error's norm within 1e-5 of the
    gradient's norm, plus 1e-7 of the whole gradient's norm (a parameter whose gradient is a sum that
    cancels to near 0, like a bias before a head read at one token, has no digits left to compare)."""
    assert actual.keys() == expected.keys() and expected
    total = torch.stack([g.norm() for g in expected.values()]).norm()
    for name, grad in expected.items():
        error = (actual[name] - grad).norm()
        assert error <= 1e-5 * grad.norm() + 1e-7 * total, f"{name}: error {error:.2e}, norm {grad.norm():.2e}"


# -- online modules: one rollout with bucketing on vs off ---------------------------------------------
WORDS = "the food was good and the staff is kind but we hated the long movie plot in a room".split()


def varied_prompts(tokenizer_dir: str, n: int = 8) -> torch.utils.data.DataLoader:
    """Left-padded prompts of 1 to 14 words."""
    tok = load_tokenizer(tokenizer_dir)
    enc = [tok(" ".join(WORDS[: 1 + (5 * i) % 14]))["input_ids"] for i in range(n)]
    width = max(map(len, enc))
    rows = [
        {
            "input_ids": torch.tensor([tok.pad_token_id] * (width - len(e)) + e),
            "attention_mask": torch.tensor([0] * (width - len(e)) + [1] * len(e)),
        }
        for e in enc
    ]
    return torch.utils.data.DataLoader(rows, batch_size=n)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients of its (only) step."""

    def step(self, closure=None):
        self.grads = {p: p.grad.detach().clone() for group in self.param_groups for p in group["params"]}
        return super().step(closure)


def sgd(params):
    return RecordingSGD(params, lr=1e-3)


class WidthRecorder:
    """Mixin: records the widths of the update's micro-batches."""

    def record(self, part):
        self.widths = [*getattr(self, "widths", []), part.input_ids.shape[1]]


def fit_one_rollout(tmp_path, build, bucketing):
    seed_everything(0)  # the same sampled rollout in both runs
    module = build(bucketing)
    trainer(tmp_path, enable_model_summary=False).fit(module, varied_prompts(module.tokenizer.name_or_path))
    optimizers = module.optimizers()
    recorded = {}
    for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
        recorded.update(opt.optimizer.grads)
    grads = {name: recorded[p] for name, p in module.named_parameters() if p in recorded}
    (path,) = tmp_path.glob("ppo/version_*/metrics.csv")
    with open(path) as f:
        metrics = {k: float(v) for r in csv.DictReader(f) for k, v in r.items() if v != ""}
    return module, grads, metrics


def assert_same_update(tmp_path, build):
    on_module, on_grads, on_metrics = fit_one_rollout(tmp_path / "on", build, FORCED)
    off_module, off_grads, off_metrics = fit_one_rollout(tmp_path / "off", build, OFF)
    full = max(off_module.widths)
    assert min(on_module.widths) < full and len(on_module.widths) > len(off_module.widths)  # really bucketed
    assert set(on_metrics) == set(off_metrics)
    for key, value in off_metrics.items():
        assert on_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    # the accumulated gradient of every trained parameter at the optimiser step
    assert on_grads.keys() == off_grads.keys() and len(off_grads) == len(
        [p for p in off_module.parameters() if p.requires_grad]
    )
    assert_same_gradients(on_grads, off_grads)


STOPS = list(range(5, 110))  # a third of the vocabulary: responses stop at varied lengths


def _online_kwargs(**update):
    """One optimiser step without gradient clip or ratio skip (``update`` adds keys of that group)."""
    return dict(
        max_rollouts=1, actor_optimizer=sgd, samples={"every": 0},
        update={"epochs": 1, "num_minibatches": 1, "max_grad_norm": None, "ratio_threshold": None, **update},
    )  # fmt: skip


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_ppo_update_is_the_same_with_bucketing(tokenizer_dir, tmp_path, config):
    from lit_rlhf.modules import PPOModule

    class Recording(WidthRecorder, PPOModule):
        def ppo_loss(self, part):
            self.record(part)
            return super().ppo_loss(part)

    def build(bucketing):
        return tiny_ppo(
            # old_logprobs: forward: the actor's scoring forward is what bucketing must leave unchanged (the
            # sampler's record would make the run's KL a difference of two roundings, ~1e-7)
            tokenizer_dir, config, cls=Recording, scoring={"bucketing": bucketing, "old_logprobs": "forward"},
            critic_optimizer=sgd,
            # multinomial: the inverse-CDF rollout of this seed has a near-constant return, whose explained
            # variance (a ratio of small variances) differs by 3.6e-7 between the bucketed and padded runs
            generation={"max_new_tokens": 10, "stop_token_ids": STOPS, "sampler": "multinomial"},
            **_online_kwargs(ent_coef=0.01),
        )  # fmt: skip

    assert_same_update(tmp_path, build)


def test_grpo_update_is_the_same_with_bucketing(tokenizer_dir, tmp_path):
    from lit_rlhf.modules import CriticFreeModule

    class Recording(WidthRecorder, CriticFreeModule):
        def policy_loss(self, part):
            self.record(part)
            return super().policy_loss(part)

    def build(bucketing):
        return Recording(
            actor=spec(tokenizer_dir, llama_config()), reward_fn="ppo_rewards:the_count", rng_seed=0,
            scoring={"bucketing": bucketing, "forward_batch_size": 8, "old_logprobs": "forward"}, kl={"loss_coef": 0.1},
            generation={"max_new_tokens": 10, "num_samples": 4, "stop_token_ids": STOPS},
            **_online_kwargs(ent_coef=0.01),
        )  # fmt: skip

    assert_same_update(tmp_path, build)


# -- offline modules: one step on a batch of varied prompt lengths ------------------------------------
def ragged_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(low, high):
        return torch.randint(3, 300, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    return [
        {"prompt_input_ids": ids(1, 40), "completion_input_ids": ids(1, 12), "chosen_input_ids": ids(1, 12),
         "rejected_input_ids": ids(1, 12), "margin": 0.5 * i, "row_index": i}
        for i in range(n)
    ]  # fmt: skip


def spec(tokenizer_dir, config):
    return {"config": config, "tokenizer": tokenizer_dir, "seed": 0}


def gradients(module, loss):
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_same_step(make, batch, step):
    """``step(module, batch) -> (loss, metrics dict)``: equal with bucketing forced and off, and so are the
    gradients of every parameter."""
    results = []
    for bucketing in (FORCED, OFF):
        module = make(bucketing)
        loss, metrics = step(module, batch)
        results.append((loss.detach(), metrics, gradients(module, loss)))
    (loss_on, metrics_on, grads_on), (loss_off, metrics_off, grads_off) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-7)
    for key, value in metrics_off.items():
        torch.testing.assert_close(metrics_on[key], value, rtol=1e-6, atol=1e-6, msg=key)
    assert_same_gradients(grads_on, grads_off)


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_sft_step_is_the_same_with_bucketing(tokenizer_dir, config):
    batch = SFTCollator(pad_token_id=0)(ragged_rows(8))

    def make(bucketing):
        module = SFTModule(spec(tokenizer_dir, config), bucketing=bucketing)
        module.model.eval()  # no dropout
        return module

    def step(module, batch):
        loss, acc, n_tokens = module._step(batch)
        return loss, {"accuracy": acc, "tokens": n_tokens.float()}

    assert len(make(FORCED).micro_batches(batch["attention_mask"])) > 2
    assert_same_step(make, batch, step)


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_reward_model_step_is_the_same_with_bucketing(tokenizer_dir, config):
    batch = PreferenceCollator(pad_token_id=0)(ragged_rows(6))

    def make(bucketing):
        module = RewardModelModule(spec(tokenizer_dir, config), bucketing=bucketing, center_rewards_coef=0.01)
        module.model.eval()
        return module

    def step(module, batch):
        metrics = PairMetrics()
        loss, _, _ = module._step(batch, metrics)
        return loss, metrics.compute()

    assert_same_step(make, batch, step)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_step_is_the_same_with_bucketing(tokenizer_dir, loss_type):
    batch = PreferenceCollator(pad_token_id=0)(ragged_rows(6))

    def make(bucketing):
        return DPOModule(spec(tokenizer_dir, llama_config()), bucketing=bucketing, loss_type=loss_type)

    def step(module, batch):
        with torch.no_grad():  # move the policy off the reference, so the loss has a gradient to compare
            for p in module.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        return module._step(batch, "train")

    assert_same_step(make, batch, step)


def test_bucketing_is_an_argument_of_every_module(tokenizer_dir):
    with pytest.raises(TypeError, match="SFTModule: bucketing"):
        SFTModule(spec(tokenizer_dir, gpt2_config()), bucketing="yes")
    module = RewardModelModule(spec(tokenizer_dir, gpt2_config()), bucketing={"token_budget": 512})
    assert module.hparams.bucketing == {"enabled": True, "token_budget": 512, "min_saving": 0.1, "split_cost": "auto"}
    ppo = tiny_ppo(tokenizer_dir, gpt2_config(), scoring={"bucketing": {"min_saving": 0.5}}, critic_optimizer=adamw(1e-3))
    assert ppo.scoring.bucketing == Bucketing(min_saving=0.5) and ppo.hparams.scoring["bucketing"]["min_saving"] == 0.5
    assert ppo.scoring.forward_batch_size == 4, "the helper's other scoring defaults are kept"
    with pytest.raises(TypeError, match="PPOModule: scoring.bucketing: unknown Bucketing field"):
        tiny_ppo(tokenizer_dir, gpt2_config(), scoring={"bucketing": {"budget": 3}})
    with pytest.raises(TypeError, match="PPOModule: scoring.bucketing: expected Bucketing"):
        tiny_ppo(tokenizer_dir, gpt2_config(), scoring={"bucketing": "yes"})


@pytest.mark.parametrize(
    "settings", [{"bucketing": FORCED, "shared_prefix": "off"}, {"bucketing": {"enabled": False}, "shared_prefix": "on"}]
)
def test_reward_model_validation_returns_the_pair_scores_in_batch_order(tokenizer_dir, settings):
    # Callbacks read the scores from validation_step's outputs (the demo's GoldAccuracy does), whatever
    # layout scored the rows: length-bucketed micro-batches run in another row order.
    from lit_rlhf.demo.evaluate import GoldAccuracy

    batch = PreferenceCollator(pad_token_id=0)(ragged_rows(6))
    module = RewardModelModule(spec(tokenizer_dir, llama_config()), **settings)
    module.model.eval()
    module.log = lambda *args, **kwargs: None  # outside a Trainer
    with torch.no_grad():
        outputs = module.validation_step(batch, 0)
        expected = module(batch["input_ids"], batch["attention_mask"])  # one padded forward, batch order
    torch.testing.assert_close(torch.cat([outputs["chosen"], outputs["rejected"]]), expected, rtol=1e-5, atol=1e-6)
    callback = GoldAccuracy.__new__(GoldAccuracy)
    callback.scores = []
    callback.on_validation_batch_end(None, module, outputs, batch, 0)
    torch.testing.assert_close(callback.scores[0], torch.stack(expected.double().chunk(2), dim=1), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="validation_step must return the pair scores"):
        callback.on_validation_batch_end(None, module, None, batch, 0)
