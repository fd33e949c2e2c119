"""Every module under Lightning's bf16 precision: the fit runs and learns, and log-probs, KL, advantages,
values and losses stay float32.

``bf16-mixed`` (``torch.autocast`` on the CPU) runs the models' matmuls in bfloat16 while the parameters,
gradients and optimiser state stay float32; ``bf16-true`` casts the whole module to bfloat16. Under both,
every function of ``lit_rlhf.functional`` and every scoring forward of ``lit_rlhf.models`` that a fit calls
is recorded (wrapped wherever it is referenced), and none may return a bfloat16 or float16 tensor.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections import defaultdict
from functools import partial

import pytest
import torch
from conftest import gpt2_config
from lightning.pytorch import Callback, Trainer
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from test_ppo import read_metrics

from lit_rlhf.data import PreferenceDataModule, SFTDataModule
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules import DPOModule, RewardModelModule, SFTModule
from lit_rlhf.modules.optim import AdamW, CriticAdamW, PolicyAdamW

TINY_GPT2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=128)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# the scoring forwards whose outputs are float32 by contract (the logits and hidden states are not)
MODEL_FUNCTIONS = {
    "lit_rlhf.models.forwards": ("policy_forward", "critic_values", "reward_model_scores"),
    "lit_rlhf.models.scoring": (
        "next_token_logprobs", "response_logprobs", "token_values", "sequence_scores",
    ),
    "lit_rlhf.models.lm_head": ("head_token_scores",),
    "lit_rlhf.models.fused_head": ("fused_head_token_scores",),
    "lit_rlhf.models.shared_prefix": (
        "packed_token_scores", "packed_policy_forward", "packed_response_logprobs", "packed_sequence_scores",
    ),
}  # fmt: skip
# functions whose first argument is the logits: the dtype the model handed over is recorded
LOGITS_FUNCTIONS = (
    "logprobs_from_logits",
    "entropy_from_logits",
    "label_logprobs_and_entropy",
    "scaled_logits",
)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _float_dtypes(value, out: set) -> set:
    """The dtypes of the floating-point tensors in ``value`` (tensors, tuples, lists, dicts, NamedTuples)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point:
            out.add(value.dtype)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _float_dtypes(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _float_dtypes(item, out)
    return out


class FloatRecorder:
    """Wraps every function of ``lit_rlhf.functional`` and the ``MODEL_FUNCTIONS`` in every loaded
    ``lit_rlhf`` module that references them (``F.name`` and ``from ... import name`` alike); records the
    float dtypes each one returned (``outputs``) and the dtype of the logits handed to the log-prob
    functions (``logits``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.outputs: dict[str, set[torch.dtype]] = defaultdict(set)
        self.logits: set[torch.dtype] = set()
        originals = {}
        for name, module in list(sys.modules.items()):
            if name.startswith("lit_rlhf.functional"):
                for fn_name, fn in vars(module).items():
                    if inspect.isfunction(fn) and fn.__module__ == name:
                        originals[fn] = fn_name
        for module_name, names in MODEL_FUNCTIONS.items():
            for fn_name in names:
                originals[getattr(sys.modules[module_name], fn_name)] = fn_name
        wrappers = {fn: self._wrap(fn, fn_name) for fn, fn_name in originals.items()}
        for name, module in list(sys.modules.items()):
            if name.startswith("lit_rlhf") and module is not None:
                for attr, value in list(vars(module).items()):
                    if inspect.isfunction(value) and value in wrappers:
                        monkeypatch.setattr(module, attr, wrappers[value])

    def _wrap(self, fn, name: str):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if name in LOGITS_FUNCTIONS and isinstance(args[0], torch.Tensor):
                self.logits.add(args[0].dtype)
            out = fn(*args, **kwargs)
            _float_dtypes(out, self.outputs[name])
            return out

        return recorded

    def check(self, *expected: str, logits: torch.dtype | None = torch.bfloat16) -> None:
        """Every recorded output is float32 (or float64, e.g. the moments of a whitening), the ``expected``
        functions were called, and the models handed ``logits`` (the autocast dtype) to the log-prob math."""
        low = {name: dtypes for name, dtypes in self.outputs.items() if dtypes & set(LOW_PRECISION)}
        assert not low, f"low-precision outputs: {low}"
        missing = [name for name in expected if name not in self.outputs]
        assert not missing, f"not called: {missing} (called: {sorted(self.outputs)})"
        if logits is not None:
            assert logits in self.logits, f"the log-prob math saw logits of {self.logits}, not {logits}"


@pytest.fixture
def recorder(monkeypatch) -> FloatRecorder:
    return FloatRecorder(monkeypatch)


PRECISIONS = ("bf16-mixed", "bf16-true")


def assert_training_state(module: torch.nn.Module, optimizers, precision: str = "bf16-mixed") -> None:
    """bf16-mixed keeps the trained weights and the AdamW moments in float32; bf16-true has both in
    bfloat16."""
    dtype = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert {p.dtype for p in module.parameters() if p.requires_grad} == {dtype}
    states = [s for opt in optimizers for s in opt.state.values()]
    assert states, "the optimisers stepped"
    assert {v.dtype for s in states for k, v in s.items() if k != "step"} == {dtype}


def _trainer(root, precision: str = "bf16-mixed", **kwargs) -> Trainer:
    defaults = dict(
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, accelerator="cpu", precision=precision,
        gradient_clip_val=1.0,
    )  # fmt: skip
    return Trainer(**{**defaults, **kwargs})


class Losses(Callback):
    """The training loss of every step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, *args) -> None:
        self.values.append(outputs["loss"].item())


def _spec(tiny_data_dir, **kwargs) -> ModelSpec:
    return ModelSpec(
        config={**TINY_GPT2, **NO_DROPOUT}, tokenizer=f"{tiny_data_dir}/tokenizer", seed=0, **kwargs
    )


def _sft_data(tiny_data_dir) -> SFTDataModule:
    return SFTDataModule(
        f"{tiny_data_dir}/tokenizer", f"{tiny_data_dir}/sft.jsonl", max_length=64, max_prompt_length=16,
        batch_size=16,
    )  # fmt: skip


def _pairs(tiny_data_dir) -> PreferenceDataModule:
    return PreferenceDataModule(
        f"{tiny_data_dir}/tokenizer", f"{tiny_data_dir}/prefs.jsonl", max_length=64, max_prompt_length=16,
        batch_size=16,
    )  # fmt: skip


# -- offline modules --------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
def test_sft_learns_with_float32_math(tiny_data_dir, tmp_path, recorder, precision):
    torch.manual_seed(0)
    module = SFTModule(_spec(tiny_data_dir), optimizer=partial(AdamW, lr=3e-3), scheduler=None,
                       num_samples=0)  # fmt: skip
    data = _sft_data(tiny_data_dir)
    losses = Losses()
    fit = _trainer(tmp_path, precision, max_steps=16, limit_val_batches=0, callbacks=[losses])
    fit.fit(module, data)
    recorder.check("next_token_logprobs", "masked_sum")
    assert_training_state(module, fit.optimizers, precision)
    # a random model's NLL is about log(vocabulary) ~ 6
    assert losses.values[0] > 5.0 and losses.values[-1] < losses.values[0] - 2.0, losses.values


@pytest.mark.parametrize("precision", PRECISIONS)
def test_reward_model_learns_with_float32_math(tiny_data_dir, tmp_path, recorder, precision):
    torch.manual_seed(0)
    module = RewardModelModule(_spec(tiny_data_dir), optimizer=partial(AdamW, lr=3e-3),
                               scheduler=None)  # fmt: skip
    losses = Losses()
    fit = _trainer(tmp_path, precision, max_steps=24, limit_val_batches=0, callbacks=[losses])
    fit.fit(module, _pairs(tiny_data_dir))
    recorder.check("sequence_scores", "pairwise_reward_loss", logits=None)  # a score head has no logits
    assert_training_state(module, fit.optimizers, precision)
    first, last = sum(losses.values[:3]) / 3, sum(losses.values[-3:]) / 3
    # 24 steps: the loss leaves log 2 around step 10 and how fast it falls after depends on the batches (a
    # CI run in another test order averaged 0.42 over steps 14-16 under bf16-true, 0.18 alone)
    assert first == pytest.approx(math.log(2), abs=0.05) and last < 0.3, losses.values


@pytest.mark.parametrize(
    ("loss_type", "extra", "start"),
    [
        ("sigmoid", {}, math.log(2)),
        # cDPO and SimPO in the shared-prompt layout ([prompt | chosen | rejected], a 4D mask)
        ("sigmoid", {"label_smoothing": 0.1, "shared_prefix": "on"}, math.log(2)),  # cDPO
        ("ipo", {"beta": 1.0}, 0.25),  # (0 - 1 / (2 beta))^2
        ("simpo", {"beta": 1.0, "simpo_gamma": 0.5, "shared_prefix": "on"}, None),  # reference-free
    ],
    ids=["dpo", "cdpo", "ipo", "simpo"],
)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dpo_variants_learn_with_float32_math(
    tiny_data_dir, tmp_path, recorder, loss_type, extra, start, precision
):
    torch.manual_seed(0)
    module = DPOModule(
        _spec(tiny_data_dir), loss_type=loss_type, optimizer=partial(AdamW, lr=1e-3),
        scheduler=None, num_samples=0, **extra,
    )  # fmt: skip
    losses = Losses()
    fit = _trainer(tmp_path, precision, max_steps=6, limit_val_batches=0, callbacks=[losses])
    fit.fit(module, _pairs(tiny_data_dir))
    packed = extra.get("shared_prefix") == "on"
    recorder.check("packed_response_logprobs" if packed else "response_logprobs", "dpo_loss")
    assert_training_state(module, fit.optimizers, precision)
    if start is not None:  # the policy and its frozen copy run the same bf16 forward: equal log-probs
        assert losses.values[0] == pytest.approx(start, abs=1e-6)
    assert losses.values[-1] < losses.values[0], losses.values


def test_dpo_bf16_reference_under_bf16_mixed(tiny_data_dir, tmp_path, recorder):
    """A frozen reference in bfloat16 weights (half its memory) beside a float32 policy."""
    torch.manual_seed(0)
    module = DPOModule(
        _spec(tiny_data_dir), reference=_spec(tiny_data_dir, dtype="bfloat16"), precompute_ref_logprobs=True,
        optimizer=partial(AdamW, lr=1e-3), scheduler=None, num_samples=0,
    )  # fmt: skip
    assert {p.dtype for p in module.reference.parameters()} == {torch.bfloat16}
    losses = Losses()
    fit = _trainer(tmp_path, max_steps=6, limit_val_batches=0, callbacks=[losses])
    fit.fit(module, _pairs(tiny_data_dir))
    recorder.check("response_logprobs", "dpo_loss")
    assert module.ref_logps["train"].dtype == torch.float32
    assert_training_state(module, fit.optimizers)
    # the same weights rounded to bf16 and the same autocast matmuls: nearly the policy's log-probs
    assert losses.values[0] == pytest.approx(math.log(2), abs=0.02)
    assert losses.values[-1] < losses.values[0], losses.values


# -- online modules ---------------------------------------------------------------------------------------
# the modules' default optimisers (torch's fused AdamW on the CPU), with update.max_grad_norm = 1.0 clipping
PPO_OPTIMIZERS = dict(
    actor_optimizer=partial(PolicyAdamW, lr=1e-2), critic_optimizer=partial(CriticAdamW, lr=1e-2)
)


class RolloutDtypes:
    """Records the float dtypes of every rollout put into the module's replay buffer."""

    def __init__(self, module) -> None:
        self.dtypes: dict[str, set[torch.dtype]] = defaultdict(set)
        put = module.buffer.put

        def recorded(rollout, **kwargs):
            for field, value in vars(rollout).items():
                _float_dtypes(value, self.dtypes[field])
            return put(rollout, **kwargs)

        module.buffer.put = recorded

    def check(self, *fields: str) -> None:
        assert set(fields) <= {f for f, d in self.dtypes.items() if d}, dict(self.dtypes)
        assert all(dtypes <= {torch.float32} for dtypes in self.dtypes.values()), dict(self.dtypes)


def _score_rise(rows, n=5) -> tuple[float, float]:
    return sum(r["rollout/score"] for r in rows[:n]) / n, sum(r["rollout/score"] for r in rows[-n:]) / n


def test_ppo_bf16_mixed_learns_in_float32(tokenizer_dir, tmp_path, recorder):
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=20, **PPO_OPTIMIZERS)
    rollouts = RolloutDtypes(module)
    fit = trainer(tmp_path, precision="bf16-mixed", accelerator="cpu")
    fit.fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    recorder.check("policy_forward", "critic_values", "kl_shaped_rewards", "compute_gae", "ppo_policy_loss",
                   "clipped_value_loss")  # fmt: skip
    rollouts.check("old_logprobs", "ref_logprobs", "old_values", "rewards", "advantages", "returns", "scores")
    assert_training_state(module, fit.optimizers)
    rows = read_metrics(tmp_path)
    first, last = _score_rise(rows)
    assert first < 0.5 and last > first + 2.0, (first, last)
    assert rows[0]["rollout/kl_ref"] == pytest.approx(0.0, abs=1e-5)  # the same bf16 forward as its copy


def test_ppo_bf16_true_keeps_the_math_in_float32(tokenizer_dir, tmp_path, recorder):
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=3, **PPO_OPTIMIZERS)
    rollouts = RolloutDtypes(module)
    fit = trainer(tmp_path, precision="bf16-true", accelerator="cpu")
    fit.fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    recorder.check("policy_forward", "critic_values", "compute_gae", "whiten_from_moments", "ppo_policy_loss",
                   "clipped_value_loss", "aggregation_weight")  # fmt: skip
    rollouts.check("old_logprobs", "ref_logprobs", "old_values", "rewards", "advantages", "returns", "scores")
    assert_training_state(module, fit.optimizers, "bf16-true")
    rows = read_metrics(tmp_path)
    assert len(rows) == 3
    # logged in float32 too: 1e-2 in bfloat16 would read 0.010009765625
    assert rows[-1]["ppo/lr_actor"] == pytest.approx(1e-2, rel=1e-7)


@pytest.mark.parametrize("chunking", ["auto", "on"])
def test_grpo_bf16_mixed_learns_in_float32(tokenizer_dir, tmp_path, recorder, chunking):
    # "on": the LM head applied to the response tokens' hidden states in chunks, under autocast, and a
    # prompt's K responses scored and updated as one row (the shared-prompt layout, a 4D float mask)
    torch.manual_seed(0)
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), max_rollouts=20, actor_optimizer=partial(PolicyAdamW, lr=1e-2),
        kl={"coef": 0.0, "loss_coef": 0.05},
        scoring={"forward_batch_size": 8, "shared_prefix": "on" if chunking == "on" else "off"},
        actor={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0, "logits_chunking": chunking},
        generation={"max_new_tokens": 8, "num_samples": 4, "sampler": "multinomial"},
    )  # fmt: skip
    rollouts = RolloutDtypes(module)
    fit = trainer(tmp_path, precision="bf16-mixed", accelerator="cpu")
    fit.fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    forwards = ["packed_token_scores", "head_token_scores"] if chunking == "on" else ["policy_forward"]
    recorder.check(*forwards, "sequence_advantages", "ppo_policy_loss", "reference_kl_loss")
    rollouts.check("old_logprobs", "ref_logprobs", "advantages", "scores", "behavior_logprobs")
    assert_training_state(module, fit.optimizers)
    first, last = _score_rise(read_metrics(tmp_path))
    assert first < 0.5 and last > first + 1.5, (first, last)


# -- bfloat16 weights ---------------------------------------------------------------------------------------
def test_grpo_bf16_true_keeps_the_math_in_float32(tokenizer_dir, tmp_path, recorder):
    """``bf16-true``: weights, gradients and AdamW moments in bfloat16 (half the memory of each, and
    updates below a weight's bf16 resolution round away); the log-prob math and the losses stay float32.
    The fused LM head (no autocast here) takes its low-precision path."""
    torch.manual_seed(0)
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), max_rollouts=20, actor_optimizer=partial(PolicyAdamW, lr=1e-2),
        actor={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0, "logits_chunking": "on"},
        generation={"max_new_tokens": 8, "num_samples": 4, "sampler": "multinomial"},
    )  # fmt: skip
    rollouts = RolloutDtypes(module)
    fit = trainer(tmp_path, precision="bf16-true", accelerator="cpu")
    fit.fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    recorder.check("policy_forward", "fused_head_token_scores", "ppo_policy_loss", "aggregation_weight")
    rollouts.check("old_logprobs", "ref_logprobs", "advantages", "scores")
    assert_training_state(module, fit.optimizers, "bf16-true")
    rows = read_metrics(tmp_path)
    assert rows[-1]["policy/lr_actor"] == pytest.approx(1e-2, rel=1e-7)
    first, last = _score_rise(rows)
    assert first < 0.5 and last > first + 1.5, (first, last)


def test_ppo_bf16_reference_and_reward_weights(tokenizer_dir, tmp_path, recorder):
    """Frozen models in bfloat16 weights (``ModelSpec.dtype``) beside a float32 actor and critic under
    bf16-mixed: the reference's log-probs and the reward model's scores come back float32."""
    torch.manual_seed(0)
    bf16 = {"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0, "dtype": "bfloat16"}
    module = tiny_ppo(
        tokenizer_dir, gpt2_config(), max_rollouts=2, reference=bf16, reward_model=bf16, reward_fn=None,
        share_critic_backbone=True, **PPO_OPTIMIZERS,
    )  # fmt: skip
    assert {p.dtype for p in module.reference.parameters()} == {torch.bfloat16}
    rollouts = RolloutDtypes(module)
    fit = trainer(tmp_path, precision="bf16-mixed", accelerator="cpu")
    fit.fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=16))
    recorder.check("policy_forward", "reward_model_scores", "ppo_policy_loss")
    rollouts.check("old_logprobs", "ref_logprobs", "old_values", "advantages", "scores")
    assert_training_state(module, fit.optimizers)
    assert len(read_metrics(tmp_path)) == 2


# -- the generation head under autocast ---------------------------------------------------------------------
class WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the dtype casts of tensors with ``numel`` elements (the LM head's weight)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].numel() == self.numel:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_transposed_generation_head_is_cast_once_under_autocast(tokenizer_dir):
    """bf16-mixed generation: the (H, V) copy of the head is made in bfloat16 once per generate call,
    not cast again at every decoding step, and the logits are autocast's own (bfloat16 products)."""
    from lit_rlhf.models import build_causal_lm, load_tokenizer
    from lit_rlhf.models.decoding import TRANSPOSED_HEAD_MIN_ELEMENTS, decoding_lm_head

    vocab = TRANSPOSED_HEAD_MIN_ELEMENTS // 32 + 7  # a head big enough to be swapped
    spec = ModelSpec(config=gpt2_config(vocab), tokenizer=tokenizer_dir, seed=0)
    model = build_causal_lm(spec, load_tokenizer(tokenizer_dir)).eval()
    ids = torch.randint(5, 300, (3, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        plain = model(input_ids=ids).logits
        casts = WeightCasts(model.get_output_embeddings().weight.numel())
        with decoding_lm_head(model, rows=8) as used, casts:
            assert used == "transposed"  # under autocast: never packed
            steps = [model(input_ids=ids[:, : t + 1]).logits for t in range(4)]
    assert casts.count == 0, f"{casts.count} casts of the (H, V) weight in 4 decoding steps"
    assert steps[-1].dtype == plain.dtype == torch.bfloat16
    torch.testing.assert_close(steps[-1], plain[:, :4], rtol=1.6e-2, atol=1e-2)
    assert model.get_output_embeddings().weight.dtype == torch.float32  # the model itself is untouched


# -- gradient clipping with the default (fused) AdamW -----------------------------------------------------
class GradNorms(Callback):
    """The total gradient norm before clipping (``on_before_optimizer_step``) and the one the optimiser
    stepped with (a step post-hook: Lightning runs the closure, so the backward, inside ``step``)."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.stepped: list[float] = []

    @staticmethod
    def norm(optimizer) -> float:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    def on_train_start(self, trainer, module) -> None:
        for opt in trainer.optimizers:
            opt.register_step_post_hook(lambda opt, args, kwargs: self.stepped.append(self.norm(opt)))

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.before.append(self.norm(optimizer))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gradient_clipping_with_the_fused_default_optimiser(tiny_data_dir, tmp_path, precision):
    # Lightning refuses to clip for an optimiser that unscales in its step (fused AdamW) under any mixed
    # precision; bf16-mixed has no gradient scaler, so the modules clip as under 32-true
    module = SFTModule(_spec(tiny_data_dir), optimizer=partial(AdamW, lr=1e-3), scheduler=None, num_samples=0)
    data = _sft_data(tiny_data_dir)
    norms = GradNorms()
    fit = _trainer(
        tmp_path, precision, max_steps=3, limit_val_batches=0, gradient_clip_val=0.05, callbacks=[norms]
    )
    fit.fit(module, data)
    assert fit.optimizers[0].defaults["fused"], "the default AdamW is torch's fused one"
    assert len(norms.stepped) == 3 and min(norms.before) > 0.5, norms.before
    assert all(n == pytest.approx(0.05, rel=1e-3) for n in norms.stepped), norms.stepped
