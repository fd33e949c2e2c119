"""Verifiable rewards: rule rewards of answers that can be checked (math, format, length, repetition).

Each function has TRL's reward-function signature, ``fn(completions, **kwargs) -> list[float]`` (see
:mod:`lit_rlhf.reward_fns`), so it is named in a config as ``lit_rlhf.verifiable:<function>``, alone or in a
weighted ``reward_fn`` list, with its options as the entry's ``kwargs``::

    reward_fn:
      - {fn: lit_rlhf.verifiable:accuracy, weight: 1.0}
      - {fn: lit_rlhf.verifiable:format_reward, weight: 0.1, kwargs: {pattern: '<answer>.*?</answer>'}}
      - {fn: lit_rlhf.verifiable:soft_overlong_punishment, kwargs: {max_length: 256, cache_length: 64}}

They also run under TRL's GRPOTrainer. A completion may be a string or, with chat prompts, TRL's conversational
form (a list of messages; the last one's ``content`` is read). ``accuracy`` needs the ``math-verify`` package.
"""

from __future__ import annotations

import decimal
import functools
import math
import numbers
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_rlhf import functional as F

# an answer already in a LaTeX math environment (else it is read as LaTeX math: wrapped in $...$). An escaped
# \$ (a currency sign) is no delimiter, nor a \begin of an environment that needs math mode (pmatrix, cases)
LATEX_DELIMITED = re.compile(
    r"(?<!\\)\$|\\\(|\\\[|\\boxed\{|\\begin\{(?:equation|align|gather|multline|displaymath|math)\*?\}"
)
# markdown emphasis around a word or the whole answer (**5**, __5__, *5*, _5_): not glued to a letter, digit or
# marker on its outside, so products (2*3*4) and subscripts (x_1) are left alone
MARKDOWN_EMPHASIS = re.compile(r"(?<![\w*])(\*\*|__|\*|_)(?=\S)(.+?)(?<=\S)\1(?![\w*])", re.DOTALL)
# a LaTeX command, with the braced argument of the text ones (\text{cm}); what is left of an answer is words
# where it has two letters in a row
LATEX_COMMAND = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\{[^{}]*\}|\\[A-Za-z]+")
PLAIN_WORD = re.compile(r"[A-Za-z]{2,}")


def accuracy(
    completions: Sequence[str | Sequence[dict]],
    gold_column: str = "answer",
    answer_pattern: str | None = None,
    timeout_seconds: int | None = 5,
    **columns: Any,
) -> list[float]:
    """1.0 where the completion's answer equals the gold answer mathematically (``math-verify``), else 0.0.

    Equivalent forms count as equal (``1/2``, ``0.5``, ``\\frac{1}{2}``, ``\\boxed{0.5}``; ``3`` and ``3.0``).
    The gold answer is the row's ``gold_column``: a number, or a string read as LaTeX math (wrapped in
    ``$...$`` unless it already has a math environment, as math-verify expects of gold answers). A gold
    answer from which math-verify extracts nothing (empty, None, ``???``, broken LaTeX) is not scored as
    wrong: the row gets NaN (in lit_rlhf a non-finite score: the ``scoring.on_nonfinite`` policy raises on
    it or drops the row, and ``rollout/reward_nonfinite/<name>`` counts it; TRL's ``nansum`` skips it) and
    a warning names it. (Not None: in a ``reward_fn`` list, None means "this function does not score the
    row" and the other functions' sum stands.) A completion from which nothing is extracted scores 0.0.

    Args:
        completions: the responses.
        gold_column: the column of the prompt rows holding the gold answers.
        answer_pattern: a regular expression whose first group is the answer (e.g.
            ``<answer>(.*?)</answer>``); its last match in the completion is checked, no match scores 0.0.
            Markdown around the match (``**5**``, backticks) is dropped; it is read as LaTeX math, like the
            gold, unless it has plain words outside LaTeX commands (``It is 5``: then as free text).
            None: math-verify extracts the answer from the whole completion (LaTeX in ``$...$`` or
            ``\\boxed{}``, else the last number or expression).
        timeout_seconds: math-verify's limit per parse and comparison (None: none); it uses
            ``signal.alarm``, so outside the main thread no limit is used.
        columns: the prompt rows' columns (and what else lit_rlhf or TRL pass), one value per completion.

    Returns:
        One float per completion, NaN where the gold answer is unparseable.
    """
    from math_verify import parse, verify  # imported on use: it pulls in sympy

    if gold_column not in columns:
        raise ValueError(
            f"accuracy: the gold answers are read from the column {gold_column!r}, which the prompt rows "
            f"lack (their columns and keywords: {sorted(columns)}); set kwargs: {{gold_column: ...}}"
        )
    golds = columns[gold_column]
    pattern = _compile(answer_pattern, "accuracy", "answer_pattern") if answer_pattern is not None else None
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    scores: list[float] = []
    for completion, gold in zip(map(_text, completions), golds, strict=True):
        target = _parse_gold(gold, timeout)
        if target is None:
            rank_zero_warn(f"accuracy: math-verify cannot parse the gold answer {gold!r}; its rows score NaN")
            scores.append(math.nan)
            continue
        if pattern is not None:  # the answer the pattern picks out (read as LaTeX math when it is math)
            matches = list(pattern.finditer(completion))
            completion = _picked_answer(matches[-1].group(1 if pattern.groups else 0)) if matches else ""
        answer = parse(completion, parsing_timeout=timeout) if completion else []
        scores.append(float(bool(answer) and verify(target, answer, timeout_seconds=timeout)))
    return scores


@functools.lru_cache(maxsize=4096)
def _parse_gold_text(text: str, timeout: int | None) -> tuple | None:
    """math-verify's parse of a gold answer (as LaTeX math), None when it extracts no expression."""
    from math_verify import parse

    parsed = parse(_as_math(text), fallback_mode="no_fallback", parsing_timeout=timeout)
    return tuple(parsed) or None


def _picked_answer(text: str) -> str:
    """The answer an ``answer_pattern`` picked out, for math-verify: without markdown (backticks, emphasis
    such as ``**5**``), read as LaTeX math (like the gold) when it is math, i.e. has no plain words outside
    LaTeX commands (``2\\sqrt{2}`` is 2 sqrt(2), not its first number), else as free text, as math-verify
    reads a whole completion (``It is 5``: its last number)."""
    text = text.replace("`", "").strip()
    text = MARKDOWN_EMPHASIS.sub(r"\2", text).strip()
    if not text:
        return ""
    return text if PLAIN_WORD.search(LATEX_COMMAND.sub(" ", text)) else _as_math(text)


def _as_math(text: str) -> str:
    """``text`` in a LaTeX math environment: as it is when it has one, else wrapped in ``$...$``."""
    return text if LATEX_DELIMITED.search(text) else f"${text}$"


def _parse_gold(gold: Any, timeout: int | None) -> list | None:
    """The gold answer parsed; None when it is missing or unparseable. Numbers (numpy's too) are written
    out in full: ``str(0.00001)`` is ``1e-05``, which math-verify reads as e - 5; NaN is a missing value."""
    if isinstance(gold, bool) or not isinstance(gold, (str, numbers.Real)):
        return None
    if isinstance(gold, numbers.Integral):
        gold = str(int(gold))
    elif isinstance(gold, numbers.Real):
        if not math.isfinite(gold):
            return None
        gold = format(decimal.Decimal(repr(float(gold))), "f")
    if not gold.strip():
        return None
    parsed = _parse_gold_text(gold.strip(), timeout)
    return None if parsed is None else list(parsed)


def format_reward(
    completions: Sequence[str | Sequence[dict]],
    pattern: str = r"\\boxed\{.+?\}",
    fullmatch: bool = False,
    **kwargs: Any,
) -> list[float]:
    """1.0 where the completion has the required format (a regular expression), else 0.0.

    Args:
        completions: the responses.
        pattern: the regular expression (``.`` matches newlines too); the default asks for a ``\\boxed{}``
            answer, ``<answer>.*?</answer>`` for answer tags, ``<think>.*?</think>\\s*<answer>.*?</answer>``
            with ``fullmatch`` for a reasoning-then-answer layout.
        fullmatch: the whole completion must match (else the pattern may match anywhere in it).
        kwargs: the other keywords lit_rlhf or TRL pass (unused).
    """
    regex = _compile(pattern, "format_reward", "pattern")
    match = regex.fullmatch if fullmatch else regex.search
    return [1.0 if match(completion) else 0.0 for completion in map(_text, completions)]


def soft_overlong_punishment(
    completion_ids: Sequence[Sequence[int]], max_length: int, cache_length: int, **kwargs: Any
) -> list[float]:
    """DAPO's soft overlong punishment of each response's length in tokens (its stop token included):
    0 up to ``max_length - cache_length``, falling linearly to -1 at ``max_length``, -1 beyond
    (:func:`lit_rlhf.functional.soft_overlong_penalty`, arXiv:2503.14476 eq. 13).

    Args:
        completion_ids: each response's token ids (lit_rlhf and TRL pass them).
        max_length: L_max, e.g. the rollout's ``generation.max_new_tokens``.
        cache_length: L_cache, the length of the window in which the penalty grows.
        kwargs: the other keywords lit_rlhf or TRL pass (unused).
    """
    lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float32)  # (B,)
    return F.soft_overlong_penalty(lengths, max_length, cache_length).tolist()


def repetition_penalty(
    completions: Sequence[str | Sequence[dict]], ngram_size: int = 3, **kwargs: Any
) -> list[float]:
    """Minus the n-gram repetition rate of each completion: -(1 - distinct n-grams / n-grams), in [-1, 0].

    The n-grams are of lower-cased whitespace-separated words; a completion with fewer than ``ngram_size``
    words scores 0. Scale it with the entry's ``weight``.

    Args:
        completions: the responses.
        ngram_size: n >= 1.
        kwargs: the other keywords lit_rlhf or TRL pass (unused).
    """
    if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
        raise ValueError(f"repetition_penalty: ngram_size must be an integer >= 1, got {ngram_size!r}")
    scores = []
    for completion in map(_text, completions):
        words = completion.lower().split()
        ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
        rate = 1.0 - len(set(ngrams)) / len(ngrams) if ngrams else 0.0
        scores.append(-rate if rate else 0.0)
    return scores


def _text(completion: str | Sequence[dict]) -> str:
    """A completion's text: the string, or the ``content`` of the last message of TRL's conversational form."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _compile(pattern: Any, fn: str, argument: str) -> re.Pattern:
    if not isinstance(pattern, str):
        raise TypeError(f"{fn}: {argument} must be a regular expression string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"{fn}: {argument} {pattern!r} is not a valid regular expression ({err})") from err
