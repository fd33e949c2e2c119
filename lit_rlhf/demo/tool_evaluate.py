"""Evaluation of the tool world's policies: exact-match accuracy, tool calls, tool errors and turns.

Each policy answers every held-out evaluation problem once, sampled at the rollouts' temperature, in two
settings: **with the tool** (the training rollout's episodes: up to :data:`TOOL_EPISODE`'s ``max_turns``,
a turn ends at ``</calc>`` and gets the calculator's observation) and **without** (one turn, no stop string,
as in the GRPO run without the tool: a call the model writes is never answered). Both run the rollout of
the online modules, :func:`lit_rlhf.environments.run_episodes` on the Hugging Face engine, so the
evaluation samples exactly as training does; without the tool it is one turn with no stop string.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lit_rlhf.demo import tool_world as world
from lit_rlhf.demo.tool_env import Calculator
from lit_rlhf.engines import HFEngine
from lit_rlhf.environments import ENDED, EnvironmentSettings, open_episodes, run_episodes
from lit_rlhf.models import chunked, load_tokenizer
from lit_rlhf.rollout import GenerationSettings

TEMPERATURE = 1.0  # the rollouts' (configs/demo/tool_grpo*.yaml check against it)
TURN_TOKENS = 16  # generation.max_new_tokens of one turn with the tool
SINGLE_TURN_TOKENS = 32  # of the one turn without it: room for a whole call-and-answer transcript
ENVIRONMENT = "lit_rlhf.demo.tool_env:Calculator"
TOOL_EPISODE = dict(env=ENVIRONMENT, max_turns=3, max_total_tokens=48, stop_strings=[world.CALL_CLOSE])
NO_TOOL_EPISODE = dict(env=ENVIRONMENT, max_turns=1, stop_strings=[])
SETTINGS = ("tool", "no_tool")


def read_problems(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a prompts file (``{"prompt", "answer", "kind"}``)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f]


def episode_settings(tool: bool) -> tuple[EnvironmentSettings, GenerationSettings]:
    """The episode limits and a turn's sampling settings of one evaluation setting."""
    episode = EnvironmentSettings(**(TOOL_EPISODE if tool else NO_TOOL_EPISODE))
    turn = GenerationSettings(max_new_tokens=TURN_TOKENS if tool else SINGLE_TURN_TOKENS, temperature=TEMPERATURE)
    return episode, turn


@torch.no_grad()
def evaluate_policy(
    policy_dir: str | Path, problems: Sequence[dict[str, Any]], tool: bool, batch_size: int = 256, seed: int = 0
) -> list[dict[str, Any]]:
    """One episode per problem (``{"prompt", "answer", "kind"}`` rows) of an exported policy.

    Sampling uses its own seeded random stream (the global one is left as it was). Returns per problem its
    row and ``response`` (the transcript, observations included), ``correct``, ``calls_written`` (the
    response has a ``<calc>``), the environment's ``tool_calls`` and ``tool_errors``, ``turns`` and
    ``ended`` (how the episode ended, one of :data:`lit_rlhf.environments.ENDED`).
    """
    tokenizer = load_tokenizer(str(policy_dir), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    engine = HFEngine()
    engine.setup(model, tokenizer)
    episode, turn = episode_settings(tool)

    def generate(ids, mask, settings, greedy):
        return engine.generate(ids, mask, settings, greedy=greedy)

    rows: list[dict[str, Any]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for part in chunked(len(problems), batch_size):
            batch = [dict(p) for p in problems[part]]
            enc = tokenizer([p["prompt"] for p in batch], padding=True, return_tensors="pt")
            envs, prompts, mask = open_episodes(Calculator, episode, batch, tokenizer, enc.input_ids, enc.attention_mask)
            out = run_episodes(generate, tokenizer, envs, prompts, mask, turn, episode)
            responses = [
                tokenizer.decode(ids[keep], skip_special_tokens=True)
                for ids, keep in zip(out.responses.ids, out.responses.mask)
            ]
            scores = world.exact_match([p["prompt"] for p in batch], responses, [p["answer"] for p in batch])
            for i, (problem, response) in enumerate(zip(batch, responses)):
                rows.append({
                    **problem, "response": response, "correct": scores[i] == 1.0,
                    "calls_written": world.CALL_OPEN in response, "tool_calls": int(out.tool_calls[i]),
                    "tool_errors": int(out.tool_errors[i]), "turns": int(out.turns[i]), "ended": ENDED[int(out.ended[i])],
                })  # fmt: skip
    engine.close()
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the episodes of one policy in one setting, overall and per kind of problem.

    ``accuracy`` (exact match), ``tool_call_rate`` (episodes whose response writes a call),
    ``tool_calls`` and ``tool_errors`` (answered and failed calls per episode), ``turns`` (model turns per
    episode), ``answered_call_accuracy`` (accuracy of the episodes with an answered call; None without one)
    and ``n``; ``sum`` and ``product`` hold the same figures for each kind.
    """

    def figures(part: Sequence[dict[str, Any]]) -> dict[str, Any]:
        called = [r for r in part if r["tool_calls"] > r["tool_errors"]]
        return {
            "n": len(part),
            "accuracy": statistics.fmean(float(r["correct"]) for r in part),
            "tool_call_rate": statistics.fmean(float(r["calls_written"]) for r in part),
            "tool_calls": statistics.fmean(r["tool_calls"] for r in part),
            "tool_errors": statistics.fmean(r["tool_errors"] for r in part),
            "turns": statistics.fmean(r["turns"] for r in part),
            "answered_call_accuracy": statistics.fmean(float(r["correct"]) for r in called) if called else None,
        }

    summary = figures(rows)
    for kind in ("sum", "product"):
        part = [r for r in rows if r["kind"] == kind]
        if part:
            summary[kind] = figures(part)
    return summary
