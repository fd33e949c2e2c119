"""The tool world: short arithmetic word problems with a gold integer answer, and a calculator that makes the
hard ones easy.

Problems (words separated by single spaces, the full stop and question mark set off by spaces)::

    sum      := NAME " has " A " " ITEM " and finds " B " more . how many " ITEM " ?"      # A, B in 1..9
              | NAME " buys " A " " ITEM " and " B " " ITEM " . how many " ITEM " ?"
    product  := NAME " has " A " " BOX " of " B " " ITEM " . how many " ITEM " ?"          # A, B in 32..99
              | NAME " packs " B " " ITEM " in each of " A " " BOX " . how many " ITEM " ?"

e.g. ``tom has 37 boxes of 48 apples . how many apples ?`` (gold 1776). Sums are easy: 81 facts a tiny model
learns by heart. Products of two two-digit numbers are hard: 4,624 of them, all with four-digit answers,
which a model of a fraction of a million parameters cannot compute in its head (its exact-match accuracy on
them is about 1%), yet a calculator call makes them as easy as copying (four digits, so the copy is always
at the same distance). :data:`EASY_FRACTION` of the problems are sums.

Answer format: a response ends with ``answer : N .`` (N the decimal integer, the EOS after it), e.g.
``" answer : 1776 ."``. A response may first call the calculator: a model turn that ends with
``<calc> EXPRESSION </calc>`` gets the observation ``" = VALUE"`` appended (``" = error"`` when the expression
is not one :func:`calculate` evaluates), and the model goes on writing. A tool-using response reads::

    " <calc> 37 * 48 </calc>" + " = 1776" + " answer : 1776 ."
      (model turn 1)             (observation) (model turn 2)

Observations have no trailing space, so the text of a transcript tokenises into the same tokens as its
turns and observations tokenised one by one (the byte-level pre-tokenizer splits before a space and
between digits and letters).

Reward (:func:`exact_match`, ``lit_rlhf.demo.tool_world:exact_match``): 1.0 when the response ends with
``answer : N .`` and N equals the row's gold ``answer`` column, else 0.0; only the final answer counts, not
how it was reached.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from lit_rlhf.models.tokenizer import EOS_TOKEN

NAMES = ("tom", "ann", "bob", "eve", "sam", "kim", "joe", "amy", "max", "zoe")
ITEMS = ("apples", "pens", "cards", "coins", "books", "eggs", "shells", "stamps", "nuts", "cups")
BOXES = ("boxes", "bags", "crates", "jars", "tins", "trays")
SUM_TEMPLATES = (
    "{name} has {a} {item} and finds {b} more . how many {item} ?",
    "{name} buys {a} {item} and {b} {item} . how many {item} ?",
)
PRODUCT_TEMPLATES = (
    "{name} has {a} {box} of {b} {item} . how many {item} ?",
    "{name} packs {b} {item} in each of {a} {box} . how many {item} ?",
)
SUM_OPERANDS = range(1, 10)
PRODUCT_OPERANDS = range(32, 100)  # products 1024..9801: always 4 digits
EASY_FRACTION = 0.2  # sums among sampled problems; the rest are products

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
ERROR_OBSERVATION = " = error"
MAX_OPERAND_DIGITS = 9  # the calculator refuses longer numbers (no huge products in a loop)
ANSWER = re.compile(r"answer : (\d+) \.\s*$")
_TOKEN = re.compile(r"\s*(\d+|[-+*])")


def sample_problem(rng: random.Random, kind: str | None = None) -> dict[str, Any]:
    """A problem row: ``{"prompt", "answer", "kind", "a", "b"}``; ``kind`` "sum" or "product" (None: drawn,
    a sum with probability :data:`EASY_FRACTION`)."""
    if kind is None:
        kind = "sum" if rng.random() < EASY_FRACTION else "product"
    if kind not in ("sum", "product"):
        raise ValueError(f"kind must be 'sum' or 'product', got {kind!r}")
    operands = SUM_OPERANDS if kind == "sum" else PRODUCT_OPERANDS
    templates = SUM_TEMPLATES if kind == "sum" else PRODUCT_TEMPLATES
    a, b = rng.choice(operands), rng.choice(operands)
    words = dict(name=rng.choice(NAMES), item=rng.choice(ITEMS), box=rng.choice(BOXES), a=a, b=b)
    prompt = rng.choice(templates).format(**words)
    return {"prompt": prompt, "answer": a + b if kind == "sum" else a * b, "kind": kind, "a": a, "b": b}


def expression(problem: dict[str, Any]) -> str:
    """The calculator expression of a problem, its numbers in the order of the prompt: ``"37 * 48"``."""
    operator = " + " if problem["kind"] == "sum" else " * "
    return operator.join(re.findall(r"\d+", problem["prompt"]))


def direct_response(answer: int) -> str:
    """A response that answers at once: ``" answer : 1776 ."``."""
    return f" answer : {answer} ."


def call_text(expr: str) -> str:
    """A model turn that calls the calculator: ``" <calc> 37 * 48 </calc>"``."""
    return f" {CALL_OPEN} {expr} {CALL_CLOSE}"


def tool_response(problem: dict[str, Any]) -> str:
    """The whole tool-using transcript of a problem: call, observation, answer (see the module docstring)."""
    expr = expression(problem)
    return call_text(expr) + observation(calculate(expr)) + direct_response(problem["answer"])


def observation(value: int) -> str:
    """What the calculator answers: ``" = 1776"``."""
    return f" = {value}"


def calculate(expr: str) -> int:
    """The value of ``expr``: integers joined by ``+``, ``-`` and ``*`` (``*`` binds tighter), spaces free.

    Raises:
        ValueError: anything else (an empty expression, another character, two operators or two numbers in
            a row, a number longer than :data:`MAX_OPERAND_DIGITS` digits), with what is wrong.
    """
    tokens, pos, text = [], 0, expr.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"unexpected {text[pos:].strip()[:10]!r} in {expr!r}")
        tokens.append(match.group(1))
        pos = match.end()
    if not tokens or len(tokens) % 2 == 0:
        raise ValueError(f"{expr!r} is not numbers joined by + - *")
    numbers, operators = tokens[::2], tokens[1::2]
    if not all(t.isdigit() for t in numbers) or any(t.isdigit() for t in operators):
        raise ValueError(f"{expr!r} is not numbers joined by + - *")
    if any(len(t) > MAX_OPERAND_DIGITS for t in numbers):
        raise ValueError(f"{expr!r} has a number of more than {MAX_OPERAND_DIGITS} digits")
    terms, signs, product = [], [1], int(numbers[0])
    for op, number in zip(operators, numbers[1:]):
        if op == "*":
            product *= int(number)
        else:
            terms.append(product)
            signs.append(1 if op == "+" else -1)
            product = int(number)
    terms.append(product)
    return sum(sign * term for sign, term in zip(signs, terms))


def tool_call(turn: str) -> tuple[str | None, bool]:
    """Read a model turn: ``(observation, is_call)``.

    A turn whose text (EOS and trailing spaces removed) ends with ``</calc>`` is a call; its expression is
    the text after the last ``<calc>`` before it. The observation is ``" = VALUE"``, or
    :data:`ERROR_OBSERVATION` when there is no opening tag or :func:`calculate` refuses the expression.
    Any other turn is a final answer: ``(None, False)``.
    """
    text = turn.split(EOS_TOKEN, 1)[0].rstrip()
    if not text.endswith(CALL_CLOSE):
        return None, False
    body = text[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    if start < 0:
        return ERROR_OBSERVATION, True
    try:
        return observation(calculate(body[start + len(CALL_OPEN) :])), True
    except ValueError:
        return ERROR_OBSERVATION, True


def final_answer(response: str) -> int | None:
    """The N of a response ending with ``answer : N .`` (EOS and what follows it ignored), else None."""
    match = ANSWER.search(response.split(EOS_TOKEN, 1)[0])
    return None if match is None else int(match.group(1))


def exact_match(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any], **columns: Any) -> list[float]:
    """Reward function (``lit_rlhf.demo.tool_world:exact_match``): 1.0 where the response's final answer
    (:func:`final_answer`) equals the row's gold ``answer`` column, else 0.0.

    Args:
        prompts: the prompts (unused: the gold answer travels as a column).
        responses: the decoded responses (a multi-turn one with its observations).
        answer: the gold answers, one per response (ints, or their decimal strings).
        columns: the prompt rows' other columns (unused).
    """
    if not len(prompts) == len(responses) == len(answer):
        raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses and {len(answer)} answers")
    return [float(final_answer(r) == int(gold)) for r, gold in zip(responses, answer)]
