"""The demo world: a small synthetic language of short reviews with a documented gold reward.

Grammar (words separated by single spaces, the tag carries a colon, the full stop follows the last
word directly)::

    review       := TAG ": " opener (" " CONJ " " opinion){0,MAX_OPINIONS} "."
    opener       := "the" NOUN[TAG] COPULA neutral       # a fact: "the room was very large"
    opinion      := "the" NOUN[TAG] COPULA predicate | predicate
    neutral      := ["not"] [INTENSIFIER] NEUTRAL_ADJECTIVE
    predicate    := ["not"] [INTENSIFIER] ADJECTIVE     # any adjective, neutral ones included

e.g. ``hotel: the room was large but the staff was not very lovely and extremely weak.`` Nouns must
belong to the review's domain (``TAG``). The grammar is unambiguous (no word is in two classes and "the"
starts only a clause), so :func:`count_sentences` counts derivations.

Gold reward (deterministic, :func:`gold_reward`): the sum over clauses of
``negation * intensifier * strength``: ``strength`` from :data:`ADJECTIVES` (-3..3, neutral words 0),
``intensifier`` from :data:`INTENSIFIERS` (1 when absent; "very" 1.5, "extremely" 2, "slightly" 0.5),
``negation`` -0.5 after "not" ("not good" = -1, "not terrible" = +1.5) and 1 otherwise. Clause scores
add up; "and" and "but" weigh the same, so the gold stays a plain sum (an RM must learn composition,
not a contrast rule). A clause scores in [-6, 6], the opener 0, a review in [-18, 18]. Text the
grammar cannot produce scores :data:`UNGRAMMATICAL_REWARD` = -6 (the worst one-opinion review, about
2 standard deviations below the mean of sampled reviews): garbage never earns gold, yet a few
ungrammatical samples do not swamp the mean and standard deviation of an evaluation.

Prompt and response: the prompt is the tag and the opener (``hotel: the room was large``); the response
is the rest, ending with the full stop: ``.`` or ``" but the staff was weak."`` (leading space
included). The full text is ``prompt + response``; grammaticality and gold are computed on it. Openers
are neutral so that the prompt carries no gold: every bit of gold variance is in what the policy writes.

Sampling distribution (:func:`sample_review`): domain, noun, copula, conjunction uniform; an opener
adjective uniform over the neutral ones; an opinion's polarity positive/negative/neutral with
probabilities 0.4/0.4/0.2 and the adjective uniform within it (the strengths mirror each other, so the
expected gold is exactly 0); an intensifier with probability 0.4 (uniform), "not" with probability 0.2;
0/1/2/3 opinions with probabilities 0.1/0.3/0.35/0.25; an opinion is a full clause with probability
0.6, else a bare predicate. Over sampled reviews the gold has mean 0 and standard deviation ~2.83.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from lit_rlhf.models.tokenizer import EOS_TOKEN

MAX_OPINIONS = 3
NEGATION = "not"
NEGATION_FACTOR = -0.5
UNGRAMMATICAL_REWARD = -6.0
CONJUNCTIONS = ("and", "but")
COPULAS = ("is", "was", "seemed", "felt")

DOMAINS: dict[str, tuple[str, ...]] = {
    "restaurant": ("food", "pizza", "pasta", "soup", "salad", "dessert", "coffee", "staff", "service", "price"),
    "movie": ("movie", "plot", "acting", "ending", "music", "script", "cast", "dialogue", "pacing", "price"),
    "hotel": ("room", "bed", "view", "pool", "breakfast", "location", "lobby", "staff", "service", "price"),
    "phone": ("phone", "battery", "screen", "camera", "speaker", "charger", "design", "software", "price"),
    "book": ("book", "story", "plot", "writing", "ending", "cover", "dialogue", "pacing", "translation"),
    "game": ("game", "graphics", "story", "controls", "music", "soundtrack", "multiplayer", "price"),
}  # fmt: skip

# Strengths mirror each other (three words at +-1, four at +-2, four at +-3), so drawing positive and
# negative with equal probability and a word uniformly within them gives a gold distribution symmetric
# around 0.
ADJECTIVES: dict[str, float] = {
    "decent": 1.0, "fine": 1.0, "pleasant": 1.0,
    "good": 2.0, "nice": 2.0, "solid": 2.0, "lovely": 2.0,
    "great": 3.0, "excellent": 3.0, "amazing": 3.0, "superb": 3.0,
    "mediocre": -1.0, "bland": -1.0, "dull": -1.0,
    "bad": -2.0, "poor": -2.0, "annoying": -2.0, "weak": -2.0,
    "awful": -3.0, "terrible": -3.0, "horrible": -3.0, "dreadful": -3.0,
    "average": 0.0, "ordinary": 0.0, "typical": 0.0, "standard": 0.0, "new": 0.0,
    "old": 0.0, "small": 0.0, "large": 0.0, "quiet": 0.0, "loud": 0.0,
}  # fmt: skip

INTENSIFIERS: dict[str, float] = {
    "extremely": 2.0, "incredibly": 2.0, "very": 1.5, "really": 1.5,
    "somewhat": 0.5, "slightly": 0.5, "fairly": 0.5,
}  # fmt: skip

POLARITY_PROBS = {"positive": 0.4, "negative": 0.4, "neutral": 0.2}
INTENSIFIER_PROB = 0.4
NEGATION_PROB = 0.2
N_OPINIONS_PROBS = (0.1, 0.3, 0.35, 0.25)  # P(0 opinions), ..., P(MAX_OPINIONS opinions)
FULL_CLAUSE_PROB = 0.6

_DOMAIN_NAMES = tuple(DOMAINS)
_INTENSIFIER_WORDS = tuple(INTENSIFIERS)
_POLARITIES = tuple(POLARITY_PROBS)
_POLARITY_CUM_WEIGHTS = tuple(itertools.accumulate(POLARITY_PROBS.values()))
_N_OPINIONS_CUM_WEIGHTS = tuple(itertools.accumulate(N_OPINIONS_PROBS))
_BY_POLARITY = {
    "positive": tuple(w for w, s in ADJECTIVES.items() if s > 0),
    "negative": tuple(w for w, s in ADJECTIVES.items() if s < 0),
    "neutral": tuple(w for w, s in ADJECTIVES.items() if s == 0),
}


def vocabulary() -> list[str]:
    """Every word of the language (tags without their colon), sorted; the full stop and colon excluded."""
    words = {NEGATION, "the", *CONJUNCTIONS, *COPULAS, *ADJECTIVES, *INTENSIFIERS, *DOMAINS}
    words.update(noun for nouns in DOMAINS.values() for noun in nouns)
    return sorted(words)


def count_sentences(max_opinions: int = MAX_OPINIONS) -> int:
    """Exact number of distinct reviews with at most ``max_opinions`` opinions (0: the prompts).

    Per domain with N nouns, C copulas, J conjunctions, M = 2 * (1 + #intensifiers) modifier choices
    ([not] x [intensifier]): openers = N * C * M * #neutral; one opinion = J * (N * C + 1) * M * #adjectives
    (a full clause or a bare predicate); reviews = openers * sum_{k <= max_opinions} opinion**k.
    """
    modifiers = 2 * (1 + len(INTENSIFIERS))
    total = 0
    for nouns in DOMAINS.values():
        openers = len(nouns) * len(COPULAS) * modifiers * len(_BY_POLARITY["neutral"])
        opinion = len(CONJUNCTIONS) * (len(nouns) * len(COPULAS) + 1) * modifiers * len(ADJECTIVES)
        total += openers * sum(opinion**k for k in range(max_opinions + 1))
    return total


def _pick(rng: random.Random, words: Sequence[str]) -> str:
    # Indexing by random() is ~3x faster than rng.choice (no rejection loop); the bias is < 2**-50.
    return words[int(rng.random() * len(words))]


def _sample_predicate(rng: random.Random, adjectives: tuple[str, ...]) -> str:
    words = [_pick(rng, adjectives)]
    if rng.random() < INTENSIFIER_PROB:
        words.insert(0, _pick(rng, _INTENSIFIER_WORDS))
    if rng.random() < NEGATION_PROB:
        words.insert(0, NEGATION)
    return " ".join(words)


def _sample_opinion(rng: random.Random) -> str:
    polarity = rng.choices(_POLARITIES, cum_weights=_POLARITY_CUM_WEIGHTS)[0]
    return _sample_predicate(rng, _BY_POLARITY[polarity])


def _subject(rng: random.Random, domain: str) -> str:
    return f"the {_pick(rng, DOMAINS[domain])} {_pick(rng, COPULAS)}"


def sample_prompt(rng: random.Random) -> str:
    """A prompt: the domain tag and a neutral opener, e.g. ``"hotel: the room was very small"``."""
    domain = _pick(rng, _DOMAIN_NAMES)
    return f"{domain}: {_subject(rng, domain)} {_sample_predicate(rng, _BY_POLARITY['neutral'])}"


def sample_response(rng: random.Random, prompt: str) -> str:
    """A response to ``prompt`` from the grammar: 0..MAX_OPINIONS opinions, then the full stop."""
    domain = prompt_domain(prompt)
    n_opinions = rng.choices(range(MAX_OPINIONS + 1), cum_weights=_N_OPINIONS_CUM_WEIGHTS)[0]
    parts = []
    for _ in range(n_opinions):
        conjunction = _pick(rng, CONJUNCTIONS)
        subject = _subject(rng, domain) + " " if rng.random() < FULL_CLAUSE_PROB else ""
        parts.append(f" {conjunction} {subject}{_sample_opinion(rng)}")
    return "".join(parts) + "."


def sample_review(rng: random.Random) -> str:
    """A full review (``prompt + response``) from the sampling distribution of the module docstring."""
    prompt = sample_prompt(rng)
    return prompt + sample_response(rng, prompt)


def prompt_domain(prompt: str) -> str:
    """The domain tag of a prompt (the text before the first colon); ValueError if it is not a domain."""
    domain = prompt.split(":", 1)[0]
    if domain not in DOMAINS:
        raise ValueError(f"prompt {prompt!r} does not start with a domain tag out of {sorted(DOMAINS)}")
    return domain


def split_review(text: str) -> tuple[str, str]:
    """Split a grammatical review into (prompt, response) with ``prompt + response == text``."""
    if parse_clause_scores(text) is None:
        raise ValueError(f"not a grammatical review: {text!r}")
    words = text[:-1].split(" ")
    # The opener ends at the first adjective: tag, "the", noun, copula, "not" and intensifiers are
    # never adjectives.
    first_adjective = next(i for i, word in enumerate(words) if word in ADJECTIVES)
    prompt = " ".join(words[: first_adjective + 1])
    return prompt, text[len(prompt) :]


def _parse_predicate(words: list[str], i: int, adjectives) -> tuple[float, int] | None:
    """Score of the predicate starting at ``words[i]`` and the index after it, or None."""
    factor = 1.0
    if i < len(words) and words[i] == NEGATION:
        factor, i = NEGATION_FACTOR, i + 1
    if i < len(words) and words[i] in INTENSIFIERS:
        factor, i = factor * INTENSIFIERS[words[i]], i + 1
    if i < len(words) and words[i] in adjectives:
        return factor * ADJECTIVES[words[i]], i + 1
    return None


def _parse_clause(words: list[str], i: int, nouns: tuple[str, ...], adjectives) -> tuple[float, int] | None:
    if words[i : i + 1] != ["the"] or i + 2 >= len(words):
        return None
    if words[i + 1] not in nouns or words[i + 2] not in COPULAS:
        return None
    return _parse_predicate(words, i + 3, adjectives)


def parse_clause_scores(text: str) -> list[float] | None:
    """The gold score of each clause of ``text`` (the opener's first), or None if not in the language.

    An exact recogniser: the text must be in canonical form (single spaces, no surrounding whitespace,
    "." directly after the last word).
    """
    if not text.endswith("."):
        return None
    words = text[:-1].split(" ")
    if not words[0].endswith(":") or words[0][:-1] not in DOMAINS:
        return None
    nouns = DOMAINS[words[0][:-1]]
    parsed = _parse_clause(words, 1, nouns, _BY_POLARITY["neutral"])
    scores = []
    while parsed is not None:
        score, i = parsed
        scores.append(score)
        if i == len(words):
            return scores
        if len(scores) > MAX_OPINIONS or words[i] not in CONJUNCTIONS or i + 1 == len(words):
            return None
        if words[i + 1] == "the":
            parsed = _parse_clause(words, i + 1, nouns, ADJECTIVES)
        else:
            parsed = _parse_predicate(words, i + 1, ADJECTIVES)
    return None


def is_grammatical(text: str) -> bool:
    """True exactly for the reviews the grammar can produce."""
    return parse_clause_scores(text) is not None


def gold_reward(text: str) -> float:
    """Sum of clause scores of a grammatical review; :data:`UNGRAMMATICAL_REWARD` otherwise."""
    scores = parse_clause_scores(text)
    return UNGRAMMATICAL_REWARD if scores is None else float(sum(scores))


def gold_reward_fn(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Reward callable for PPO (``lit_rlhf.demo.world:gold_reward_fn``): gold of ``prompt + response``.

    A response decoded with its special tokens is cut at the first ``<|endoftext|>`` (the EOS and any
    padding after it are not text of the review).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    return [gold_reward(p + r.split(EOS_TOKEN, 1)[0]) for p, r in zip(prompts, responses)]


def longest_response(tokenizer: PreTrainedTokenizerBase) -> str:
    """The grammatical response with the most tokens under ``tokenizer``.

    A byte-level pre-tokenizer splits before every space and before the full stop, so a response's token
    count is the sum over its words (each with its leading space) and the longest response takes, in every
    slot, the word with the most tokens: MAX_OPINIONS full-clause opinions with "not", an intensifier,
    and the longest conjunction, noun, copula and adjective.
    """

    def longest(words) -> str:
        return max(sorted(words), key=lambda w: len(tokenizer(" " + w, add_special_tokens=False).input_ids))

    nouns = {noun for domain_nouns in DOMAINS.values() for noun in domain_nouns}
    clause = (
        f" {longest(CONJUNCTIONS)} the {longest(nouns)} {longest(COPULAS)} "
        f"{NEGATION} {longest(INTENSIFIERS)} {longest(ADJECTIVES)}"
    )
    return clause * MAX_OPINIONS + "."


def max_response_tokens(tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens of the longest grammatical response plus one for the EOS: the smallest safe max_new_tokens."""
    return len(tokenizer(longest_response(tokenizer), add_special_tokens=False).input_ids) + 1
