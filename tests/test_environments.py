"""Multi-turn rollouts (lit_rlhf.environments): the token layout of an episode, token-in/token-out, ragged
episode ends, the episode limits, the loss on a multi-turn rollout, and the errors a user's environment gets."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from test_online_contract import read_metrics

from lit_rlhf import functional as F
from lit_rlhf.engines import Responses
from lit_rlhf.environments import (
    ENDED,
    Environment,
    EnvironmentSettings,
    StepResult,
    ToolEnvironment,
    open_episodes,
    run_episodes,
)
from lit_rlhf.models import load_tokenizer
from lit_rlhf.rollout import GenerationSettings


class ScriptedEngine:
    """``generate`` returning scripted turns: call c gives row r the ids ``script(c, r, context)``, with
    behaviour log-probs -0.01 * (id + 1); it records every call's contexts."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.contexts = tokenizer, script, []

    def __call__(self, ids, mask, settings, greedy=False):
        call = len(self.contexts)
        contexts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        self.contexts.append(contexts)
        rows = [self.script(call, r, ctx)[: settings.max_new_tokens] for r, ctx in enumerate(contexts)]
        T = max(map(len, rows))
        out = torch.full((len(rows), T), self.tokenizer.pad_token_id)
        for r, row in enumerate(rows):
            out[r, : len(row)] = torch.tensor(row)
        real = out != self.tokenizer.pad_token_id
        logprobs = torch.where(real, -0.01 * (out + 1).float(), 0.0)
        truncated = torch.tensor([self.tokenizer.eos_token_id not in r for r in rows])
        return Responses(out, real, truncated, logprobs=logprobs, log_kept_mass=torch.zeros_like(logprobs))


class Scripted(Environment):
    """Turn 1 -> the text ' = 7'; turn 2 -> token ids [5, 6]; turn 3 -> done with reward 1.5."""

    def reset(self, row):
        self.turn = 0

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            return StepResult(" = 7", reward=0.25, tool_call=True)
        if self.turn == 2:
            return StepResult([5, 6], tool_call=True, tool_error=True)
        return StepResult(None, reward=1.5, done=True)


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts_of(tokenizer, texts):
    enc = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    return ids, mask


def episodes(tokenizer, env_cls, engine, texts, settings=None, generation=None, columns=None, k=1):
    settings = settings or EnvironmentSettings(env="test_environments:Scripted", max_turns=4)
    generation = generation or GenerationSettings(max_new_tokens=6, num_samples=k)
    ids, mask = prompts_of(tokenizer, texts)
    rows = [{"prompt": t, **(columns or {})} for t in texts]
    envs, ids, mask = open_episodes(env_cls, settings, rows, tokenizer, ids, mask, group_size=k)
    return run_episodes(engine, tokenizer, envs, ids, mask, generation, settings), ids, mask


def test_a_scripted_three_turn_episode_has_the_exact_token_layout(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    eos = tok.eos_token_id
    turns = {0: [ids_of(tok, " the food")[0], 40], 1: [41, 42, 43], 2: [44, eos]}
    engine = ScriptedEngine(tok, lambda call, row, ctx: [t + row for t in turns[call][:-1]] + turns[call][-1:])
    out, prompts, prompt_mask = episodes(tok, Scripted, engine, ["the movie", "a room was"])
    obs1 = ids_of(tok, " = 7")
    for b in range(2):
        t1, t2, t3 = ([t + b for t in turns[c][:-1]] + turns[c][-1:] for c in range(3))
        expected = t1 + obs1 + t2 + [5, 6] + t3
        model = [True] * len(t1) + [False] * len(obs1) + [True] * len(t2) + [False] * 2 + [True] * len(t3)
        n = len(expected)
        assert out.responses.ids[b, :n].tolist() == expected, "model tokens as sampled, observations appended once"
        assert out.responses.mask[b, :n].all() and not out.responses.mask[b, n:].any()
        assert out.responses.loss_mask[b, :n].tolist() == model and not out.responses.loss_mask[b, n:].any()
        lp = torch.tensor([-0.01 * (t + 1) if m else 0.0 for t, m in zip(expected, model)])
        assert torch.allclose(out.responses.logprobs[b, :n], lp), "behaviour log-probs of the model's tokens, 0 on observations"
        # turn 2 and 3 were generated from exactly the transcript so far
        prompt = prompts[b][prompt_mask[b].bool()].tolist()
        assert engine.contexts[1][b] == prompt + t1 + obs1
        assert engine.contexts[2][b] == prompt + t1 + obs1 + t2 + [5, 6]
    assert out.rewards.tolist() == [1.75, 1.75] and out.turns.tolist() == [3, 3]
    assert out.tool_calls.tolist() == [2, 2] and out.tool_errors.tolist() == [1, 1]
    assert out.observation_tokens.tolist() == [len(obs1) + 2] * 2
    assert out.ended.tolist() == [ENDED.index("done")] * 2 and not out.responses.truncated.any()
    metrics = out.metrics()
    assert metrics["turns"] == 3 and metrics["env_reward"] == 1.75 and metrics["episode_max_turns"] == 0


def test_sampled_ids_are_kept_when_decoding_and_encoding_would_change_them(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    pieces = [ids_of(tok, c)[0] for c in "the"]  # 't', 'h', 'e' one by one
    assert ids_of(tok, tok.decode(pieces)) != pieces, "precondition: the round trip merges them"

    class Echo(Environment):
        def step(self, response):
            self.seen = response
            return StepResult(None, done=True) if getattr(self, "done", False) else StepResult(" ok")

        def reset(self, row):
            self.done = False

    def script(call, row, ctx):
        return pieces

    engine = ScriptedEngine(tok, script)
    settings = EnvironmentSettings(env="x:y", max_turns=2)
    out, *_ = episodes(tok, Echo, engine, ["the movie"], settings)
    n = len(pieces)
    assert out.responses.ids[0, :n].tolist() == pieces
    assert engine.contexts[1][0][-n - len(ids_of(tok, " ok")) : -len(ids_of(tok, " ok"))] == pieces
    assert out.ended.tolist() == [ENDED.index("max_turns")]


class EndsAtRow(Environment):
    """Row r's episode ends (reward r) after r % 3 + 1 turns; its prompt row's ``answer`` column is kept."""

    def reset(self, row):
        self.row, self.turn, self.answer = int(row["prompt"].split()[-1]), 0, row["answer"]

    def step(self, response):
        self.turn += 1
        if self.turn == self.row % 3 + 1:
            return StepResult(None, reward=float(self.row), done=True)
        return StepResult(" and")


def test_episodes_ending_at_different_turns_are_batched_turn_by_turn(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    texts = [f"the movie {r}" for r in range(5)]
    engine = ScriptedEngine(tok, lambda call, row, ctx: [ids_of(tok, " good")[0]] * (call + 1))
    out, *_ = episodes(tok, EndsAtRow, engine, texts, columns={"answer": "4"})
    assert [len(c) for c in engine.contexts] == [5, 3, 1], "one engine call per turn over the running episodes"
    assert out.turns.tolist() == [1, 2, 3, 1, 2] and out.rewards.tolist() == [0, 1, 2, 3, 4]
    obs = ids_of(tok, " and")
    good = ids_of(tok, " good")[0]
    for b, turns in enumerate(out.turns.tolist()):
        expected = []
        for t in range(turns):
            expected += [good] * (t + 1) + (obs if t < turns - 1 else [])
        assert out.responses.ids[b, : len(expected)].tolist() == expected
        assert int(out.responses.mask[b].sum()) == len(expected)
        assert int(out.responses.loss_mask[b].sum()) == turns * (turns + 1) // 2


def test_max_turns_and_the_token_budget_end_episodes_and_are_counted(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    good = ids_of(tok, " good")[0]
    engine = ScriptedEngine(tok, lambda call, row, ctx: [good] * 4)

    class Never(Environment):
        steps = 0

        def step(self, response):
            Never.steps += 1
            return StepResult(" and")

    settings = EnvironmentSettings(env="x:y", max_turns=2)
    out, *_ = episodes(tok, Never, engine, ["the movie"], settings)
    assert out.ended.tolist() == [ENDED.index("max_turns")] and out.turns.tolist() == [2]
    assert out.metrics()["episode_max_turns"] == 1
    # a budget of turn 1 (4) + ' and' + 2 tokens: turn 2 is cut at 2 tokens, and the episode ends there
    Never.steps = 0
    obs = len(ids_of(tok, " and"))
    out, *_ = episodes(tok, Never, engine, ["the movie"], EnvironmentSettings(env="x:y", max_turns=5, max_total_tokens=4 + obs + 2))
    assert int(out.responses.mask.sum()) == 4 + obs + 2, "cut mid-turn at the budget"
    assert out.ended.tolist() == [ENDED.index("length")] and out.responses.truncated.tolist() == [True]
    assert Never.steps == 1, "the environment never sees a turn cut by the budget"
    assert out.metrics()["episode_length_limit"] == 1


def test_a_turn_cut_by_the_per_turn_limit_is_answered_even_when_it_fills_the_budget(tokenizer_dir):
    # 6 tokens a turn (max_new_tokens) and no EOS: a last turn that fills the budget exactly was cut by the
    # per-turn limit, as an earlier turn may be, so the environment scores it (a verifier's -1 is not lost)
    tok = load_tokenizer(tokenizer_dir)
    good = ids_of(tok, " good")[0]
    engine = ScriptedEngine(tok, lambda call, row, ctx: [good] * 10)
    obs = len(ids_of(tok, " and"))

    class Verifier(Environment):
        turn = 0

        def step(self, response):
            self.turn += 1
            return StepResult(" and") if self.turn < self.turns else StepResult(None, reward=-1.0, done=True)

    cases = [(1, None, 1), (2, 6 + obs + 6, 2)]  # (max_turns, max_total_tokens, turns); one turn: the default budget 6
    for max_turns, budget, turns in cases:
        Verifier.turns = turns
        settings = EnvironmentSettings(env="x:y", max_turns=max_turns, max_total_tokens=budget)
        out, *_ = episodes(tok, Verifier, engine, ["the movie", "the food"], settings)
        assert out.rewards.tolist() == [-1.0, -1.0] and out.turns.tolist() == [turns, turns]
        assert out.ended.tolist() == [ENDED.index("done")] * 2 and out.responses.truncated.tolist() == [True, True]
    # a budget tighter than the per-turn limit cuts the turn short: that one is not answered
    Verifier.turns = 1
    out, *_ = episodes(tok, Verifier, engine, ["the movie"], EnvironmentSettings(env="x:y", max_turns=1, max_total_tokens=4))
    assert out.rewards.tolist() == [0.0] and out.ended.tolist() == [ENDED.index("length")]


def test_an_environment_breaking_the_interface_is_named(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [ids_of(tok, " good")[0]])

    def env_returning(value):
        class Bad(Environment):
            def step(self, response):
                if isinstance(value, Exception):
                    raise value
                return value

        return Bad

    cases = [
        ("not a result", TypeError, "step must return a StepResult"),
        ((" ok", math.nan, False), ValueError, "the reward must be a finite number"),
        ((3.5, 0.0, False), TypeError, "the observation must be a string"),
        (KeyError("x"), RuntimeError, "step of episode 0, turn 1 raised KeyError"),
    ]
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            episodes(tok, env_returning(value), engine, ["the movie"])

    class Different(Environment):
        count = 0

        def reset(self, row):
            Different.count += 1
            return f"the movie {Different.count}"

        def step(self, response):
            return StepResult(None, done=True)

    with pytest.raises(ValueError, match="different prompts for the 2 samples of prompt row 0"):
        episodes(tok, Different, engine, ["the movie", "the movie"], k=2)

    class BadReset(Different):
        def reset(self, row):
            return 42

    with pytest.raises(TypeError, match="reset must return None, the prompt text or a list of chat messages"):
        episodes(tok, BadReset, engine, ["the movie"])


def test_a_reset_prompt_is_tokenised_as_prompts_and_messages_through_the_chat_template(chat_tokenizer_dir):
    tok = load_tokenizer(chat_tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [tok.eos_token_id])

    class Chat(Environment):
        def reset(self, row):
            return [{"role": "user", "content": "the food " + row["answer"]}]

        def step(self, response):
            return StepResult(None, done=True)

    out, prompts, mask = episodes(tok, Chat, engine, ["x", "y"], columns={"answer": "was good"}, k=2)
    text = tok.apply_chat_template([{"role": "user", "content": "the food was good"}], add_generation_prompt=True, tokenize=False)
    assert prompts[0][mask[0].bool()].tolist() == ids_of(tok, text) == engine.contexts[0][1]


def test_settings_errors_name_the_field():
    assert EnvironmentSettings.coerce("pkg.mod:Env").env == "pkg.mod:Env"
    for bad, message in [({"env": "no_colon"}, "environment.env must be 'package.module:Class'"),
                         ({"env": "a:b", "max_turns": 0}, "environment.max_turns must be an integer >= 1"),
                         ({"env": "a:b", "max_total_tokens": 0}, "environment.max_total_tokens"),
                         ({"env": "a:b", "stop_strings": [""]}, "environment.stop_strings")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EnvironmentSettings.coerce(bad)
    assert EnvironmentSettings(env="a:b", max_turns=3).token_budget(10) == 30


def test_a_module_refuses_an_environment_that_cannot_be_imported(tokenizer_dir):
    with pytest.raises(ValueError, match="environment.env 'no_such_module:Env': module 'no_such_module' not found"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), environment="no_such_module:Env")
    with pytest.raises(TypeError, match="expected a class with reset"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), environment="ppo_rewards:the_count")
    with pytest.raises(ValueError, match="or an environment whose rewards score the episodes"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=None)


# --- tools -------------------------------------------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


class Calculator(ToolEnvironment):
    tools = [multiply, divide]


def test_a_tool_environment_runs_calls_and_reports_failures():
    env = Calculator()
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>'
    assert env.step("let me compute " + call) == StepResult("<tool_response>\n1776\n</tool_response>\n", tool_call=True)
    for response, why in [('<tool_call>{"name": "add", "arguments": {}}</tool_call>', "unknown tool 'add'"),
                          ('<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>', "multiply: "),
                          ('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>', "division by zero"),
                          ("<tool_call>{not json", "not JSON")]:  # fmt: skip
        result = env.step(response)
        assert result.tool_call and result.tool_error and not result.done and why in result.observation, result
    assert env.step("the answer is 1776") == StepResult(None, reward=0.0, done=True)

    def undocumented(a):
        return a

    with pytest.raises(TypeError, match="tool 'undocumented' cannot be described to the model"):
        ToolEnvironment(tools=[undocumented])
    env = ToolEnvironment(tools=["test_environments:multiply"], result_template=" = {result}")
    assert env.step('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>').observation == " = 6"


# --- in a fit ----------------------------------------------------------------------------------------------
class Followup(Environment):
    """Every episode: the model's turn, the observation ' the food', a second model turn; reward 0.5."""

    def reset(self, row):
        self.turn = 0

    def step(self, response):
        self.turn += 1
        return StepResult(" the food", tool_call=True) if self.turn == 1 else StepResult(None, reward=0.5, done=True)


def test_the_loss_of_a_multi_turn_rollout_is_the_loss_with_the_observations_masked_by_hand(tokenizer_dir, tmp_path):
    env = {"env": "test_environments:Followup", "max_turns": 3}
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), environment=env, max_rollouts=2,
                              update={"epochs": 1, "num_minibatches": 1, "ent_coef": 0.0}, kl={"coef": 0.05})  # fmt: skip
    tok = load_tokenizer(tokenizer_dir)
    obs = ids_of(tok, " the food")
    first_turns = []  # per rollout, each row's first-turn length
    generate, sample = module.generate, module.sample

    def spy_sample(batch):
        first_turns.append(None)
        return sample(batch)

    def spy_generate(ids, mask, settings=None, greedy=False):
        out = generate(ids, mask, settings, greedy)
        if first_turns[-1] is None:
            first_turns[-1] = out.mask.sum(1).tolist()
        return out

    checked = []
    loss = module.policy_loss

    def spy_loss(part):
        value, stats = loss(part)
        hand = part.response_mask.bool().clone()  # (B, T) the tokens that exist ...
        for row, b in enumerate(part.rows.tolist()):
            start = first_turns[-1][b]
            hand[row, start : start + len(obs)] = False  # ... less the observation, masked by hand
        T = part.response_mask.shape[1]
        from lit_rlhf.models import policy_forward

        logprobs, _, _ = policy_forward(module.actor, part.input_ids, part.attention_mask, T, 1.0, entropy=False)
        expected, _ = F.ppo_policy_loss(logprobs, part.old_logprobs, part.advantages, hand, 0.2, 0.2,
                                        loss_aggregation=module.update.loss_aggregation,
                                        max_response_length=module.max_response_length)  # fmt: skip
        assert torch.equal(part.loss_mask, hand)
        assert torch.allclose(value, expected, atol=1e-6), (value, expected)
        assert (part.advantages[~hand] == 0).all()
        checked.append(True)
        return value, stats

    module.generate, module.sample, module.policy_loss = spy_generate, spy_sample, spy_loss
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert len(checked) == 4, "2 rollouts of 2 micro-batches"
    rows = read_metrics(tmp_path)
    assert [r["rollout/turns"] for r in rows] == [2.0, 2.0] and all(r["rollout/tool_calls"] == 1 for r in rows)
    assert all(r["rollout/observation_tokens"] == len(obs) and r["rollout/env_reward"] == 0.5 for r in rows)
    # the environment's reward is added to the reward_fn's score ('the' count of the transcript, 'the food' included)
    assert all(r["rollout/score"] >= 1.5 for r in rows)
    val = trainer(tmp_path / "val").validate(module, prompt_loader(tokenizer_dir, n=4, batch_size=4), verbose=False)[0]
    assert val["val/turns"] == 2 and val["val/observation_tokens"] == len(obs)


def test_an_environment_alone_scores_the_episodes(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=None, max_rollouts=1,
                              environment={"env": "test_environments:Followup"})  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    (row,) = read_metrics(tmp_path)
    assert row["rollout/score"] == 0.5 and row["rollout/group_all_equal_frac"] == 1.0


class LengthReward(Environment):
    """One turn; reward: the response's length in characters (responses differ, so online DPO has pairs)."""

    def step(self, response):
        return StepResult(None, reward=float(len(response)), done=True)


def test_online_dpo_ranks_its_pairs_by_the_environments_reward(tokenizer_dir, tmp_path):
    from test_online_dpo import tiny_online_dpo

    module = tiny_online_dpo(tokenizer_dir, reward_fn=None, max_rollouts=2,
                             environment={"env": "test_environments:LengthReward"})  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:  # the episode rewards are the scores the pairs are ranked by
        assert row["rollout/env_reward"] > 0 and row["rollout/score"] == row["rollout/env_reward"]
        assert row["dpo/pairs"] > 0 and row["dpo/scores_margin"] > 0


def test_ppo_on_multi_turn_episodes_resumes_exactly(tokenizer_dir, tmp_path, prompt_file):
    # GAE over the model's tokens (the observation is a hole) and the environment's reward in the score;
    # 4 rollouts uninterrupted vs 2 + resume to 4: rollouts 3..4 log identical metrics
    from test_ppo import assert_resumed_rows_equal, uninterrupted_and_resumed

    from lit_rlhf.data import PromptDataModule

    def run(root, callbacks=(), ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=4, environment={"env": "test_environments:Followup"},
                          generation=GenerationSettings(max_new_tokens=4))  # fmt: skip
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=4, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(module, data, ckpt_path=ckpt_path)
        return read_metrics(root)

    full, resumed = uninterrupted_and_resumed(run, tmp_path)
    assert all(r["rollout/turns"] == 2 and r["rollout/env_reward"] == 0.5 for r in full)
    assert len(full) == 4 and len(resumed) == 2
    assert_resumed_rows_equal(full, resumed)


def test_the_readme_example_environment_drives_a_fit(tokenizer_dir, tmp_path, monkeypatch):
    import json
    import re
    import sys
    import types
    from pathlib import Path

    from lit_rlhf.data import PromptDataModule

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("### Tools and environments") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("my_envs")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_envs", module)
    config = re.search(r"environment: (\{.*?\})\n", section).group(1)
    assert config.startswith("{env: my_envs:Guess")
    rows = [{"prompt": p, "secret": str(i % 3)} for i, p in enumerate(["the movie", "the food was", "a room"] * 2)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = PromptDataModule(tokenizer_dir, str(path), max_prompt_length=16, batch_size=3, seed=0, val_fraction=0.0)
    gen = {"max_new_tokens": 4, "num_samples": 2, "stop_strings": []}
    model = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=None, max_rollouts=2, generation=gen,
                             environment={"env": "my_envs:Guess", "max_turns": 3, "max_total_tokens": 24})  # fmt: skip
    trainer(tmp_path).fit(model, data)
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(r["rollout/turns"] > 1 and r["rollout/env_reward"] < 0 for r in rows)


def test_the_tools_are_shown_to_the_model_through_the_chat_template(chat_tokenizer_dir):
    tok = load_tokenizer(chat_tokenizer_dir)
    tok.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}({{ t.function.parameters.properties | list | join(',') }})]"
        "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )

    class Asking(Calculator):
        def reset(self, row):
            return [{"role": "user", "content": " the food"}]

    engine = ScriptedEngine(tok, lambda call, row, ctx: [tok.eos_token_id])
    _, prompts, mask = episodes(tok, Asking, engine, ["x"])
    assert tok.decode(prompts[0][mask[0].bool()]) == "[multiply(a,b)][divide(a,b)] the food"


def test_a_failing_construction_or_reset_is_named(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [tok.eos_token_id])

    class NeedsArgs(Environment):
        def __init__(self, size):
            self.size = size

        def reset(self, row):
            raise KeyError("answer")

        def step(self, response):
            return StepResult(None, done=True)

    with pytest.raises(RuntimeError, match=r"construction with kwargs \{\} of episode 0 raised TypeError"):
        episodes(tok, NeedsArgs, engine, ["the movie"])
    settings = EnvironmentSettings(env="x:y", kwargs={"size": 3})
    with pytest.raises(RuntimeError, match="reset of episode 0 raised KeyError: 'answer'"):
        episodes(tok, NeedsArgs, engine, ["the movie"], settings)


def test_a_rank_whose_episodes_ended_keeps_generating_while_another_ranks_run(tokenizer_dir):
    # a sharded / synced_gpus generation is collective: this rank's episodes end after turn 1, another rank's
    # go on to turn 3, so this rank makes two discarded calls and its episodes are unchanged
    tok = load_tokenizer(tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [ids_of(tok, " good")[0]] * 3)

    class Once(Environment):
        def step(self, response):
            return StepResult(None, reward=1.0, done=True)

    other_rank_turns = iter([True, True, False])  # the other rank runs turns 2 and 3
    settings = EnvironmentSettings(env="x:y", max_turns=4)
    ids, mask = prompts_of(tok, ["the movie", "a room"])
    envs, ids, mask = open_episodes(Once, settings, [{"prompt": "x"}] * 2, tok, ids, mask)
    out = run_episodes(engine, tok, envs, ids, mask, GenerationSettings(max_new_tokens=6), settings,
                       any_running=lambda mine: mine or next(other_rank_turns))  # fmt: skip
    assert [len(c) for c in engine.contexts] == [2, 1, 1], "turn 1, then one dummy row per turn the other rank runs"
    assert out.turns.tolist() == [1, 1] and int(out.responses.mask.sum()) == 6


def test_an_environment_needs_only_step(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [tok.eos_token_id])

    class Plain:  # no base class, no reset, no close
        def step(self, response):
            return None, 2.0, True

    out, *_ = episodes(tok, Plain, engine, ["the movie"])
    assert out.rewards.tolist() == [2.0] and out.turns.tolist() == [1]


def test_an_error_in_scoring_the_answer_is_the_environments_not_a_tool_error(tokenizer_dir):
    class Strict(ToolEnvironment):
        tools = [multiply]

        def final_reward(self, response):
            raise ValueError("cannot read the answer")

    env = Strict()
    with pytest.raises(ValueError, match="cannot read the answer"):  # not answered to the model as a tool error
        env.step("the answer is 6")
    bad_call = env.step("<tool_call>{not json}</tool_call>")  # a call that cannot be read still is the model's
    assert bad_call.tool_error and "error: the tool call is not JSON" in bad_call.observation
    tok = load_tokenizer(tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [tok.eos_token_id])
    with pytest.raises(RuntimeError, match=r"environment .*Strict: step of episode 0, turn 1 raised ValueError"):
        episodes(tok, Strict, engine, ["the movie"])


def test_a_result_template_with_other_braces_is_refused_when_built():
    with pytest.raises(ValueError, match=r"result_template .* cannot be filled .*write literal braces as '\{\{'"):
        ToolEnvironment(tools=[multiply], result_template='{"result": {result}}')
    env = ToolEnvironment(tools=[multiply], result_template='{{"result": {result}}}')
    assert env.step('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>').observation == '{"result": 6}'


def test_observations_of_bytes_or_ids_past_the_vocabulary_are_refused(tokenizer_dir):
    from lit_rlhf.environments import check_step

    with pytest.raises(TypeError, match="the observation must be a string, a list of token ids or None"):
        check_step((b" = 1776", 0.0, False), "env (episode 0, turn 1)")
    tok = load_tokenizer(tokenizer_dir)
    engine = ScriptedEngine(tok, lambda call, row, ctx: [ids_of(tok, " good")[0]])

    class Past(Environment):
        def step(self, response):
            return StepResult([5, len(tok) + 3])

    with pytest.raises(ValueError, match=rf"environment .*Past \(episode 0, turn 1\): observation token id {len(tok) + 3} is past the vocabulary"):
        episodes(tok, Past, engine, ["the movie"])


def test_a_tool_call_with_arguments_of_other_types_than_the_schema_is_answered_with_an_error():
    env = ToolEnvironment(tools=[multiply])
    wrong = env.step('<tool_call>{"name": "multiply", "arguments": {"a": "3", "b": 4}}</tool_call>')  # "3" * 4 = "3333"
    assert wrong.tool_error and "multiply: argument 'a' must be of type integer, got '3'" in wrong.observation
    right = env.step('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>')
    assert not right.tool_error and "12" in right.observation


# ------------------------------------------------------------------ what environments see and return
def _scripted_engine(turn: list[int]):
    """An engine whose every turn is ``turn`` (token ids)."""
    from lit_rlhf.engines import Responses

    def engine(ids, mask, settings, greedy=False):
        out = torch.tensor([turn] * ids.shape[0])[:, : settings.max_new_tokens]
        return Responses(out, torch.ones_like(out, dtype=torch.bool), torch.zeros(ids.shape[0], dtype=torch.bool),
                         logprobs=-torch.ones(out.shape), log_kept_mass=torch.zeros(out.shape))  # fmt: skip

    return engine


def test_tool_tags_that_are_special_tokens_reach_the_environment(tokenizer_dir):
    """Some tokenizers mark the tool tags special (Mistral's [TOOL_CALLS]); the turn's text keeps them, so the
    call runs (before, they were skipped in decoding and the call was taken for the final answer)."""
    from lit_rlhf.environments import EnvironmentSettings, ToolEnvironment, open_episodes, run_episodes
    from lit_rlhf.models.tokenizer import load_tokenizer
    from lit_rlhf.rollout import GenerationSettings

    tok = load_tokenizer(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    seen = []

    class Calc(ToolEnvironment):
        tools = [multiply]

        def step(self, response):
            seen.append(response)
            return super().step(response)

    call = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    turn = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    settings = EnvironmentSettings(env="x:Calc", max_turns=2)
    prompt = torch.tensor([tok("the food", add_special_tokens=False)["input_ids"]])
    envs, ids, mask = open_episodes(Calc, settings, [{"prompt": "the food"}], tok, prompt, torch.ones_like(prompt))
    episodes = run_episodes(_scripted_engine(turn), tok, envs, ids, mask, GenerationSettings(max_new_tokens=64), settings)
    assert seen[0] == call and episodes.tool_calls.tolist() == [2]


def test_numpy_flags_are_taken_like_bools():
    import numpy as np

    from lit_rlhf.environments.base import StepResult, check_step

    result = check_step(StepResult(None, np.float32(1.0), done=np.isclose(3.0, 3.0), tool_call=np.int64(0)), "env")
    assert result.done is True and result.tool_call is False and result.reward == 1.0


def test_chat_messages_from_reset_without_a_chat_template_use_the_plain_rendering(tokenizer_dir):
    from lit_rlhf.data.render import plain_chat
    from lit_rlhf.environments import EnvironmentSettings, open_episodes
    from lit_rlhf.environments.base import Environment, StepResult
    from lit_rlhf.models.tokenizer import load_tokenizer

    class Chat(Environment):
        def reset(self, row):
            return [{"role": "user", "content": "the food"}]

        def step(self, response):
            return StepResult(None, 0.0, done=True)

    tok = load_tokenizer(tokenizer_dir)
    prompt = torch.tensor([[5, 6]])
    _, ids, mask = open_episodes(Chat, EnvironmentSettings(env="x:Chat"), [{}], tok, prompt, torch.ones_like(prompt))
    expected = tok(plain_chat([{"role": "user", "content": "the food"}], True), add_special_tokens=False)["input_ids"]
    assert ids[0][mask[0].bool()].tolist() == expected


class RandomUser(Environment):
    """A simulated user that draws from Python's ``random``: a random observation, then a random reward."""

    def reset(self, row):
        self.turn = 0

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            return StepResult(" " + random.choice(["the food", "we", "it was", "a room"]))
        return StepResult(None, reward=float(random.randint(0, 3)), done=True)


def test_an_environment_drawing_from_pythons_random_resumes_exactly(tokenizer_dir, tmp_path, prompt_file):
    """Checkpoints hold Python's and NumPy's RNG states with torch's (before, only torch's: the resumed
    episodes drew other observations and rewards)."""
    import lightning.pytorch as pl
    from test_ppo import StopAfter

    from lit_rlhf.data import PromptDataModule

    def run(root, callbacks=(), ckpt_path=None):
        pl.seed_everything(0, verbose=False)  # as LightningCLI at every start, resumed or not
        module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=4,
                                  environment={"env": "test_environments:RandomUser", "max_turns": 2, "max_total_tokens": 32},
                                  generation={"max_new_tokens": 4, "num_samples": 2}, update={"epochs": 1, "num_minibatches": 1})  # fmt: skip
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=2, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(module, data, ckpt_path=ckpt_path)
        return read_metrics(root)

    full = run(tmp_path / "full")
    run(tmp_path / "part", callbacks=[StopAfter(2)])
    resumed = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "part" / "mid.ckpt"))
    for key in ("rollout/env_reward", "rollout/observation_tokens"):
        assert [r[key] for r in full[2:]] == [r[key] for r in resumed], key
