"""The contract between the online base and an algorithm, and the rollout-engine seam.

- a new algorithm (REINFORCE without a baseline) written here against ``OnlineRLModule`` declares only its
  settings and its loss (the plumbing is counted), fits, learns and logs;
- a loss that breaks the contract is refused with a message naming the module and the stat;
- an engine written here (it replays recorded responses) drives a GRPO fit end to end, with ``sync_weights``
  called exactly once per update, and the lifecycle hooks in order.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer

from lit_rlhf import functional as F
from lit_rlhf.engines import HFEngine, Responses, RolloutEngine, build_engine, engine_hparams
from lit_rlhf.models import load_tokenizer
from lit_rlhf.modules import OnlineRLModule
from lit_rlhf.rollout import Rollout


def read_metrics(tmp_path) -> list[dict[str, float]]:
    import csv

    (path,) = tmp_path.glob("**/metrics.csv")
    rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(path.open())]
    return [r for r in rows if "rollout/score" in r]


# --- a new algorithm in a few lines of plumbing ------------------------------------------------------------
# PLUMBING-START
class Reinforce(OnlineRLModule):
    """REINFORCE without a baseline (Williams 1992): loss = -mean_t(score * log pi(a_t))."""

    loss_stats = ("policy_loss", "policy_kl")

    def __init__(self, actor, lr: float = 1e-2, **kwargs) -> None:
        super().__init__(actor=actor, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.actor.parameters(), lr=self.hparams.lr)
# PLUMBING-END

    def training_step(self, batch, batch_idx):
        # 1. sample; 2. score; 3. the score is every token's advantage; 4. update; 5. log
        sample = self.sample(batch)
        ids, attention, mask, T = sample.input_ids, sample.attention_mask, sample.loss_mask, sample.responses.ids.shape[1]
        old, ref, _, entropy = self.score_rollout(ids, attention, T)
        scores, keep = self.score_responses(ids, attention, T, sample.responses.truncated)
        advantages = scores[:, None] * mask  # (B, T)
        self.buffer.put(self.drop_rows(self.build_rollout(sample, old, ref, advantages, scores), keep))
        self.run_update_epochs(self.loss, [(self.optimizers(), self.actor)])
        self.buffer.clear()
        kl = F.masked_kl(old, ref, mask, self.kl.estimator)
        self.log_rollout_stats(sample, scores, scores, kl, entropy, old)
        self.finish_rollout(sample.prompts, sample.responses.ids, sample.responses.mask, scores)

    def loss(self, part: Rollout):
        T = part.response_mask.shape[1]
        logprobs, _ = self.actor_forward(self.actor, part.input_ids, part.attention_mask, T, 1.0, entropy=False)
        loss = -F.masked_mean(part.advantages * logprobs, part.loss_mask)
        policy_kl = F.masked_mean(part.old_logprobs - logprobs.detach(), part.loss_mask)
        return loss, {"policy_loss": loss.detach(), "policy_kl": policy_kl}


def reinforce(tokenizer_dir, cls=Reinforce, **overrides):
    kwargs = dict(
        actor={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0},
        reward_fn="ppo_rewards:the_count",
        generation={"max_new_tokens": 8, "num_samples": 1},
        update={"epochs": 1, "num_minibatches": 1, "ratio_threshold": None},
        samples={"every": 0},
        rng_seed=0,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def test_a_new_algorithm_needs_only_its_settings_and_its_loss(tokenizer_dir, tmp_path):
    source = inspect.getsource(inspect.getmodule(test_a_new_algorithm_needs_only_its_settings_and_its_loss))
    plumbing = source.split("# PLUMBING-START\n")[1].split("# PLUMBING-END")[0]
    assert len([line for line in plumbing.splitlines() if line.strip()]) <= 30
    torch.manual_seed(0)
    module = reinforce(tokenizer_dir, max_rollouts=12, generation={"max_new_tokens": 8, "num_samples": 4},
                       update={"epochs": 2, "num_minibatches": 1, "ratio_threshold": None}, lr=3e-2)  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=96, batch_size=8))
    rows = read_metrics(tmp_path)
    assert len(rows) == 12
    assert {"policy/policy_loss", "policy/policy_kl", "rollout/kl_ref", "rollout/logprob_diff_mean"} <= set(rows[-1])
    first = sum(r["rollout/score"] for r in rows[:3]) / 3
    last = sum(r["rollout/score"] for r in rows[-3:]) / 3
    assert last > first + 1.0, (first, last)
    assert module.hparams.lr == 3e-2 and module.hparams["update"]["epochs"] == 2  # hparams of both levels


def test_a_loss_missing_a_stat_the_update_reads_is_refused_at_construction(tokenizer_dir):
    # ratio_threshold (default 10) skips minibatches by the loss's ratio_mean, which Reinforce does not return
    with pytest.raises(TypeError, match=r"Reinforce: its loss must return the stat\(s\) \['ratio_mean'\]"):
        reinforce(tokenizer_dir, update={"epochs": 1, "num_minibatches": 1})

    class NoKL(Reinforce):
        loss_stats = ("policy_loss",)

    with pytest.raises(TypeError, match=r"NoKL: its loss must return the stat\(s\) \['policy_kl'\]"):
        reinforce(tokenizer_dir, cls=NoKL)


def test_a_loss_returning_an_undeclared_or_no_required_stat_fails_naming_it(tokenizer_dir, tmp_path):
    class Chatty(Reinforce):
        def loss(self, part):
            loss, stats = super().loss(part)
            return loss, {**stats, "surprise": loss.detach()}

    class Silent(Reinforce):
        def loss(self, part):
            loss, stats = super().loss(part)
            return loss, {"policy_loss": stats["policy_loss"]}

    for cls, message in ((Chatty, r"Chatty: its loss returned undeclared stat\(s\) \['surprise'\]"),
                         (Silent, r"Silent: its loss returned no \['policy_kl'\]")):  # fmt: skip
        with pytest.raises(KeyError, match=message):
            trainer(tmp_path / cls.__name__).fit(reinforce(tokenizer_dir, cls=cls, max_rollouts=1), prompt_loader(tokenizer_dir))


def test_unknown_and_moved_arguments_are_named(tokenizer_dir):
    with pytest.raises(TypeError, match=r"'ppo_epochs' is now 'update.epochs'"):
        reinforce(tokenizer_dir, ppo_epochs=2)
    with pytest.raises(TypeError, match=r"bogus: no such argument"):
        reinforce(tokenizer_dir, bogus=1)


# --- the engine seam ----------------------------------------------------------------------------------
class ReplayEngine(RolloutEngine):
    """Replays recorded responses (token-id lists, cycled) and records its lifecycle calls."""

    def __init__(self, tokenizer_dir: str, texts: list[str]) -> None:
        tokenizer = load_tokenizer(tokenizer_dir)
        self.recorded = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.calls: list[str] = []
        self.synced: list[torch.Tensor] = []
        self.next = 0

    def setup(self, model, tokenizer, *, world_size=1):
        super().setup(model, tokenizer, world_size=world_size)
        self.calls.append("setup")

    def generate(self, prompt_ids, prompt_mask, settings, *, greedy=False):
        self.calls.append("generate")
        rows = [self.recorded[(self.next + i) % len(self.recorded)][: settings.max_new_tokens] for i in range(len(prompt_ids))]
        self.next += len(rows)
        T = max(map(len, rows))
        ids = torch.full((len(rows), T), self.tokenizer.pad_token_id)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        mask = ids != self.tokenizer.pad_token_id
        truncated = torch.tensor([self.tokenizer.eos_token_id not in r for r in rows])
        return Responses(ids, mask, truncated)

    def sync_weights(self, model):
        self.calls.append("sync_weights")
        self.synced.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")

    def close(self):
        self.calls.append("close")


def test_an_engine_from_a_test_file_drives_a_grpo_fit_and_syncs_once_per_update(tokenizer_dir, tmp_path):
    texts = ["the food was good", "the the the", "it was bad", "the staff is rude", "a room", "the plot"]
    engine = ReplayEngine(tokenizer_dir, texts)
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), engine=engine, max_rollouts=3)
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))
    calls = engine.calls
    assert calls[0] == "setup" and calls[-1] == "close" and calls.count("setup") == 1
    assert calls[1:-1] == ["generate", "sleep", "wake_up", "sync_weights"] * 3, calls
    assert len(engine.synced) == 3 and not torch.equal(engine.synced[0], engine.synced[1])  # new weights each time
    now = torch.cat([p.detach().flatten() for p in module.actor.parameters()])
    assert torch.equal(engine.synced[-1], now), "synced after the rollout's last optimiser step"
    rows = read_metrics(tmp_path)
    assert len(rows) == 3
    # the replayed responses are what was scored: 'the' counts of the cycled texts, 16 rows a rollout
    counts = [t.count("the") for t in texts]
    assert rows[0]["rollout/score"] == pytest.approx(sum(counts[i % 6] for i in range(16)) / 16)
    assert "rollout/logprob_diff_mean" not in rows[0], "no behaviour log-probs from this engine: no mismatch"


def test_no_step_means_no_sync(tokenizer_dir, tmp_path):
    engine = ReplayEngine(tokenizer_dir, ["the food"])
    # every minibatch skipped: the ratio threshold is below the first minibatch's ratio of exactly 1
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), engine=engine, max_rollouts=2, update={"ratio_threshold": 0.5})
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert "sync_weights" not in engine.calls and engine.calls.count("generate") == 2


def test_engines_from_names_dicts_and_class_paths(tokenizer_dir):
    assert isinstance(build_engine(None), HFEngine) and isinstance(build_engine("hf"), HFEngine)
    assert isinstance(build_engine({"class_path": "lit_rlhf.engines.HFEngine"}), HFEngine)
    path = f"{__name__}.ReplayEngine"
    engine = build_engine({"class_path": path, "init_args": {"tokenizer_dir": tokenizer_dir, "texts": ["a"]}})
    assert isinstance(engine, ReplayEngine)
    assert engine_hparams(HFEngine()) == {"class_path": "lit_rlhf.engines.hf.HFEngine", "init_args": {}}
    assert isinstance(build_engine(engine_hparams(HFEngine())), HFEngine)
    with pytest.raises(ValueError, match="engine: cannot import engine class 'nowhere.Engine'"):
        build_engine("nowhere.Engine")
    with pytest.raises(TypeError, match="is not a lit_rlhf.engines.RolloutEngine subclass"):
        build_engine("torch.nn.Linear")
    with pytest.raises(TypeError, match=r"engine: unknown key\(s\) \['sampler'\]; expected class_path and init_args"):
        build_engine({"sampler": "multinomial"})


def test_an_engine_breaking_the_protocol_is_named(tokenizer_dir, tmp_path):
    class TooLong(ReplayEngine):
        def generate(self, prompt_ids, prompt_mask, settings, *, greedy=False):
            out = super().generate(prompt_ids, prompt_mask, settings)
            return out._replace(ids=torch.cat([out.ids, out.ids], 1), mask=torch.cat([out.mask, out.mask], 1))

    engine = TooLong(tokenizer_dir, ["the food was good and the staff"])
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), engine=engine, max_rollouts=1)
    with pytest.raises(ValueError, match=r"rollout engine: responses of shape \(16, 1\d\) for 16 prompt rows"):
        trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))


def test_the_hf_engine_is_the_default_and_is_stored_as_plain_values(tokenizer_dir):
    module = reinforce(tokenizer_dir)
    assert isinstance(module.engine, HFEngine)
    assert module.hparams.engine == {"class_path": "lit_rlhf.engines.hf.HFEngine", "init_args": {}}
    rebuilt = Reinforce(**dict(module.hparams))
    assert isinstance(rebuilt.engine, HFEngine) and rebuilt.update == module.update
