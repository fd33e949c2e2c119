"""Multi-turn rollouts: engine generation and environment steps in turn, batched across episodes.

Turn by turn, every episode still running is generated in one engine call (left-padded contexts), then each
episode's environment answers its turn. Token-in, token-out: a model turn's tokens are kept exactly as the
engine sampled them, with their behaviour log-probs; an observation is tokenised once, on its own, and
appended. The transcript is never re-tokenised from text. The episode's response is the concatenation of
its turns and observations, and its loss mask is 1 on the model's tokens only: observation tokens are
attended to but get no ratio, KL, entropy or advantage.

Shapes: B episodes (prompt rows x K samples, each prompt's K rows contiguous), P prompt length
(left-padded), T episode response length (right-padded), n the episodes still running at a turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from lit_rlhf.data.render import plain_chat
from lit_rlhf.engines.base import Responses
from lit_rlhf.environments.base import Environment, check_reset, check_step
from lit_rlhf.environments.settings import EnvironmentSettings

__all__ = ["ENDED", "EPISODE_METRICS", "Episodes", "left_pad", "open_episodes", "run_episodes"]

# how an episode ended (Episodes.ended): the environment said done, max_turns, or the token budget
ENDED = ("done", "max_turns", "length")
# the per-episode means of Episodes.metrics (rollout/<name>, val/<name>, test/<name>)
EPISODE_METRICS = (
    "turns", "tool_calls", "tool_errors", "observation_tokens", "env_reward", "episode_max_turns", "episode_length_limit",
)  # fmt: skip
Generate = Callable[[torch.Tensor, torch.Tensor, Any, bool], Responses]


class Episodes(NamedTuple):
    """A batch of finished episodes.

    Attributes:
        responses: the transcripts as ``Responses`` (ids (B, T), mask, truncated, behaviour log-probs and
            kept mass of the model's tokens, 0 on observations) with ``loss_mask`` (B, T) True on the
            model's tokens only. ``truncated``: the episode hit its token budget, or its last model turn had
            no stop within ``max_new_tokens``.
        rewards: (B,) float32 sum of the environment's step rewards.
        turns: (B,) long model turns.
        tool_calls: (B,) long turns that called a tool; tool_errors: (B,) long calls that failed.
        observation_tokens: (B,) long tokens the environment appended.
        ended: (B,) long index into :data:`ENDED`.
    """

    responses: Responses
    rewards: torch.Tensor
    turns: torch.Tensor
    tool_calls: torch.Tensor
    tool_errors: torch.Tensor
    observation_tokens: torch.Tensor
    ended: torch.Tensor

    def metrics(self) -> dict[str, torch.Tensor]:
        """Per-episode means, logged as ``rollout/<name>`` (and ``val/``, ``test/``)."""
        return {
            "turns": self.turns.float().mean(),
            "tool_calls": self.tool_calls.float().mean(),
            "tool_errors": self.tool_errors.float().mean(),
            "observation_tokens": self.observation_tokens.float().mean(),
            "env_reward": self.rewards.mean(),
            "episode_max_turns": (self.ended == ENDED.index("max_turns")).float().mean(),
            "episode_length_limit": (self.ended == ENDED.index("length")).float().mean(),
        }


def open_episodes(
    env_cls: type[Environment],
    settings: EnvironmentSettings,
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    group_size: int = 1,
) -> tuple[list[Environment], torch.Tensor, torch.Tensor]:
    """One environment per episode, reset on its prompt row; the (B, P) left-padded prompts they open with.

    Args:
        env_cls: the environment class (``settings.kwargs`` are its constructor's arguments).
        rows: per episode, the prompt row's columns and ``prompt`` (its text).
        prompts, prompt_mask: (B, P) the dataset's left-padded prompts, each prompt's ``group_size`` copies
            contiguous; an environment whose ``reset`` returns None keeps its row's.

    Raises:
        ValueError: the ``group_size`` episodes of one prompt were reset to different prompts (the group
            estimators compare the K responses to one prompt).
    """
    name = f"environment {env_cls.__module__}.{env_cls.__qualname__}"
    envs, prompt_ids = [], []
    for i, row in enumerate(rows):
        what = f"construction with kwargs {settings.kwargs}"
        try:
            env = env_cls(**settings.kwargs)
            what = "reset"
            opened = env.reset(dict(row)) if callable(getattr(env, "reset", None)) else None
        except Exception as err:
            raise RuntimeError(f"{name}: {what} of episode {i} raised {type(err).__name__}: {err}") from err
        opened = check_reset(opened, f"{name} (episode {i})")
        envs.append(env)
        if opened is None:
            prompt_ids.append(prompts[i][prompt_mask[i].bool()].tolist())
        elif isinstance(opened, str):
            prompt_ids.append(tokenizer(opened)["input_ids"])
        else:  # chat messages, with the environment's tools
            tools = getattr(env, "tools", None) or None
            if tokenizer.chat_template is None:  # the data's plain rendering ("User: ...\n\nAssistant:")
                if tools:
                    raise ValueError(
                        f"{name}: reset of episode {i} returned chat messages with tools, and the tokenizer has no"
                        " chat template to show the tools to the model; give the tokenizer one"
                    )
                text = plain_chat(opened, add_generation_prompt=True)
            else:
                text = tokenizer.apply_chat_template(opened, tools=tools, add_generation_prompt=True, tokenize=False)
            prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    for start in range(0, len(prompt_ids), group_size):
        if any(ids != prompt_ids[start] for ids in prompt_ids[start : start + group_size]):
            raise ValueError(
                f"{name}: reset returned different prompts for the {group_size} samples of prompt row "
                f"{start // group_size}; the K samples of a row must open with one prompt"
            )
    ids, mask = left_pad([torch.tensor(p, dtype=torch.long) for p in prompt_ids], tokenizer.pad_token_id)
    return envs, ids.to(prompts.device), mask.to(prompts.device)


def run_episodes(
    generate: Generate,
    tokenizer: Any,
    envs: Sequence[Environment],
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    generation: Any,
    settings: EnvironmentSettings,
    greedy: bool = False,
    any_running: Callable[[bool], bool] | None = None,
) -> Episodes:
    """Run the episodes to their end: model turns from ``generate`` and environment steps in turn.

    Args:
        generate: ``(prompt_ids, prompt_mask, generation_settings, greedy) -> Responses`` (the online
            module's engine call); turn 1 is one call over all episodes under ``generation`` (its K groups
            intact), each later turn one call over the episodes still running, with ``num_samples=1``.
        envs: one reset environment per episode (:func:`open_episodes`).
        prompts, prompt_mask: (B, P) left-padded prompts.
        generation: the ``GenerationSettings`` of a turn (``max_new_tokens`` per turn); the environment's
            ``stop_strings`` are added to its own.
        settings: the episode limits (``max_turns``, ``max_total_tokens``).
        greedy: argmax decoding (evaluation).
        any_running: whether this or any other data-parallel rank still has an episode running (given this
            rank's answer; None = one process). A sharded or ``synced_gpus`` generation is collective: a rank
            whose episodes have all ended generates a dummy turn (discarded) for as long as another
            rank's go on, so every rank makes as many engine calls, all with the same length limit.
    """
    B, device, pad = prompts.shape[0], prompts.device, tokenizer.pad_token_id
    budget = settings.token_budget(generation.max_new_tokens)
    turn_settings = replace(generation, stop_strings=[*generation.stop_strings, *settings.stop_strings])
    state = [_Episode(p[m.bool()]) for p, m in zip(prompts, prompt_mask)]
    active = list(range(B))
    for turn in range(settings.max_turns):
        if not (active if any_running is None else any_running(bool(active))):
            break
        if not active:  # another rank's episodes go on: keep its collective generation in step
            ids, mask = left_pad([state[0].context()], pad)
            generate(ids.to(device), mask.to(device), replace(turn_settings, num_samples=1), greedy)
            continue
        # one process: no longer a turn than the most room left; several: every rank the same limit (its
        # turns are cut at each episode's budget below)
        room = max(budget - state[i].length for i in active) if any_running is None else budget
        step_settings = replace(turn_settings, max_new_tokens=min(turn_settings.max_new_tokens, room))
        if turn == 0:
            ids, mask = prompts, prompt_mask
        else:
            step_settings = replace(step_settings, num_samples=1)
            ids, mask = left_pad([state[i].context() for i in active], pad)
            ids, mask = ids.to(device), mask.to(device)
        out = generate(ids, mask, step_settings, greedy)  # n rows
        still = []
        for row, i in enumerate(active):
            last = turn == settings.max_turns - 1  # an observation after it is not appended
            where = f"episode {i}, turn {turn + 1}"
            if _play_turn(state[i], envs[i], out, row, budget, generation.max_new_tokens, tokenizer, where, last):
                still.append(i)
        active = still
    for env in envs:  # an environment need not subclass Environment: reset and close are optional
        close = getattr(env, "close", None)
        if callable(close):
            close()
    return _assemble(state, pad, device, greedy)


def turn_text(tokenizer, ids: torch.Tensor) -> str:
    """A model turn's text for the environment: without the EOS and pad tokens that end it, but with every
    other special token (tool tags such as Mistral's ``[TOOL_CALLS]`` are special tokens in some
    tokenizers; a ``ToolEnvironment`` must see them)."""
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return tokenizer.decode([t for t in ids.tolist() if t not in ends], skip_special_tokens=False)


class _Episode:
    """One episode's transcript so far: segments of token ids, each the model's or the environment's."""

    def __init__(self, prompt: torch.Tensor) -> None:
        self.prompt = prompt.cpu()
        self.segments: list[tuple[torch.Tensor, bool, torch.Tensor | None, torch.Tensor | None]] = []
        self.length = 0
        self.rewards = 0.0
        self.turns = self.tool_calls = self.tool_errors = self.observation_tokens = 0
        self.ended = ENDED.index("done")
        self.last_turn_truncated = False

    def context(self) -> torch.Tensor:
        return torch.cat([self.prompt, *(ids for ids, *_ in self.segments)])

    def append(self, ids: torch.Tensor, model: bool, logprobs=None, kept=None) -> None:
        self.segments.append((ids.cpu(), model, None if logprobs is None else logprobs.cpu(),
                              None if kept is None else kept.cpu()))  # fmt: skip
        self.length += ids.numel()


def _play_turn(
    episode: _Episode,
    env: Environment,
    out: Responses,
    row: int,
    budget: int,
    turn_limit: int,
    tokenizer,
    where: str,
    last: bool,
) -> bool:
    """Append row ``row`` of a turn's ``out`` to ``episode`` and let ``env`` answer; whether it goes on
    (never after the ``last`` turn: the episode then ends at ``max_turns`` unless the environment ended it).

    A turn cut by the per-turn limit ``turn_limit`` (``generation.max_new_tokens``) is answered like any
    other, also when it fills the budget exactly (the default budget, ``max_turns x max_new_tokens``, is
    filled so by a last turn of full length); only a turn cut short by the budget is not."""
    keep = out.mask[row].bool()
    room = budget - episode.length
    n = min(int(keep.sum()), room)  # the turn, cut at the episode's token budget
    ids = out.ids[row][keep][:n]
    logprobs = None if out.logprobs is None else out.logprobs[row][keep][:n]
    kept = None if out.log_kept_mass is None else out.log_kept_mass[row][keep][:n]
    episode.append(ids, True, logprobs, kept)
    episode.turns += 1
    episode.last_turn_truncated = bool(out.truncated[row])
    # cut mid-turn by the token budget (the turn had more, or stopped at a budget tighter than the per-turn
    # limit without a stop token): the environment never sees a partial turn
    if n < int(keep.sum()) or (episode.last_turn_truncated and n >= room and room < turn_limit):
        episode.ended, episode.last_turn_truncated = ENDED.index("length"), True
        return False
    try:
        result = env.step(turn_text(tokenizer, ids))
    except Exception as err:
        raise RuntimeError(f"environment {type(env).__qualname__}: step of {where} raised {type(err).__name__}: {err}") from err
    result = check_step(result, f"environment {type(env).__qualname__} ({where})")
    episode.rewards += result.reward
    episode.tool_calls += result.tool_call
    episode.tool_errors += result.tool_error
    if result.done or result.observation is None:
        return False
    if last:
        episode.ended = ENDED.index("max_turns")
        return False
    obs = result.observation
    obs_ids = torch.tensor(tokenizer(obs, add_special_tokens=False)["input_ids"] if isinstance(obs, str) else list(obs),
                           dtype=torch.long)  # fmt: skip
    if obs_ids.numel() and int(obs_ids.max()) >= len(tokenizer):
        raise ValueError(
            f"environment {type(env).__qualname__} ({where}): observation token id {int(obs_ids.max())} is past the "
            f"vocabulary ({len(tokenizer)} tokens)"
        )
    room = budget - episode.length
    if obs_ids.numel() > 0:
        episode.append(obs_ids[:room], False)
        episode.observation_tokens += min(obs_ids.numel(), room)
    if obs_ids.numel() >= room:  # no room left for another model turn
        episode.ended = ENDED.index("length")
        episode.last_turn_truncated = episode.last_turn_truncated or obs_ids.numel() > room
        return False
    return True


def _assemble(state: list[_Episode], pad: int, device: torch.device, greedy: bool) -> Episodes:
    """The episodes' transcripts as right-padded (B, T) ``Responses`` with the model-token loss mask."""
    B, T = len(state), max(1, max(e.length for e in state))
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask, loss_mask = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    has_logprobs = not greedy and all(lp is not None for e in state for _, m, lp, _ in e.segments if m)
    has_kept = has_logprobs and all(k is not None for e in state for _, m, _, k in e.segments if m)
    logprobs, kept = torch.zeros(B, T), torch.zeros(B, T)
    for b, episode in enumerate(state):
        t = 0
        for seg, model, lp, km in episode.segments:
            span = slice(t, t + seg.numel())
            ids[b, span], mask[b, span], loss_mask[b, span] = seg, True, model
            if model and has_logprobs:
                logprobs[b, span] = lp.float()
                if has_kept:
                    kept[b, span] = km.float()
            t += seg.numel()
    length_limit = torch.tensor([e.ended == ENDED.index("length") for e in state])
    truncated = length_limit | torch.tensor([e.last_turn_truncated for e in state])
    responses = Responses(
        ids.to(device), mask.to(device), truncated.to(device),
        logprobs=logprobs.to(device) if has_logprobs else None,
        log_kept_mass=kept.to(device) if has_kept else None,
        loss_mask=loss_mask.to(device),
    )  # fmt: skip

    def column(name: str, dtype=torch.long) -> torch.Tensor:
        return torch.tensor([getattr(e, name) for e in state], dtype=dtype, device=device)

    return Episodes(
        responses, column("rewards", torch.float32), column("turns"), column("tool_calls"), column("tool_errors"),
        column("observation_tokens"), column("ended"),
    )  # fmt: skip


def left_pad(rows: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D token rows -> (n, L) left-padded ids and their (n, L) long mask."""
    width = max(1, max(r.numel() for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r.numel():
            ids[i, -r.numel() :], mask[i, -r.numel() :] = r, 1
    return ids, mask
