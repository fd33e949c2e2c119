"""Rule rewards for the PPO tests, importable as ``ppo_rewards:NAME`` (tests/ is on sys.path)."""


def the_count(prompts: list[str], responses: list[str]) -> list[float]:
    """How often the response contains the string 'the' (a frequent token of the test tokenizer)."""
    return [float(response.count("the")) for response in responses]


def e_rate(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of the response's characters that are 'e' (dense: many tokens contain one)."""
    return [response.count("e") / max(len(response), 1) for response in responses]


CALLS = {"nan_in_second_rollout": 0}


def nan_in_second_rollout(prompts: list[str], responses: list[str]) -> list[float]:
    """``the_count``, except that the second call (the second rollout) scores row 1 as NaN."""
    CALLS["nan_in_second_rollout"] += 1
    scores = the_count(prompts, responses)
    if CALLS["nan_in_second_rollout"] == 2:
        scores[1] = float("nan")
    return scores


def as_strings(prompts: list[str], responses: list[str]) -> list[str]:
    """A broken reward function: strings instead of numbers."""
    return [str(len(response)) for response in responses]


def with_none(prompts: list[str], responses: list[str]) -> list[float | None]:
    """A broken reward function: None for every response but the first."""
    return [1.0] + [None] * (len(responses) - 1)


def nan_every_other(prompts: list[str], responses: list[str]) -> list[float]:
    """``the_count``, but NaN for every second response of a call."""
    return [float("nan") if i % 2 else float(r.count("the")) + 1.0 for i, r in enumerate(responses)]


def always_nan(prompts: list[str], responses: list[str]) -> list[float]:
    return [float("nan")] * len(responses)


def target_count(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """TRL's form: how often each completion contains its prompt row's ``target`` string (a column)."""
    return [float(completion.count(t)) for completion, t in zip(completions, target)]


class RankTurns:
    """A multi-turn environment (``ppo_rewards:RankTurns``) whose episodes on data-parallel rank r last r + 1
    turns: ranks end their episodes at different turns (the distributed tests' multi-turn GRPO)."""

    def reset(self, row):
        import torch.distributed as dist

        self.turns = 1 + (dist.get_rank() if dist.is_initialized() else 0)

    def step(self, response):
        self.turns -= 1
        return (None, 1.0, True) if self.turns == 0 else (" and the", 0.0, False)


def math_task(completions: list[str], task: list[str], **kwargs) -> list[float | None]:
    """TRL's multi-task pattern: scores the rows of its task (the completion's length), None elsewhere."""
    return [float(len(c)) if t == "math" else None for c, t in zip(completions, task)]


def code_task(completions: list[str], task: list[str], **kwargs) -> list[float | None]:
    """The other task of :func:`math_task`: 1.0 on its rows, NaN (a real non-finite score) on 'broken' ones."""
    return [1.0 if t == "code" else float("nan") if t == "broken" else None for t in task]


def constant(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for every response: every online-DPO prompt is a tie."""
    return [1.0] * len(responses)
