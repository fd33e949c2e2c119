"""The demo world (grammar, gold reward, prompts) and its assets (tokenizer, SFT, prompts, BT pairs)."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_rlhf.demo import assets, world
from lit_rlhf.demo.world import gold_reward, is_grammatical

seeds = st.integers(0, 2**32 - 1)

GRAMMATICAL = [
    "hotel: the room was large.",
    "hotel: the room was not very large.",
    "hotel: the room was large and large.",
    "hotel: the room was large but the staff seemed extremely lovely and terrible.",
    "book: the plot is old but the story felt not slightly dull and good and the cover was bad.",
    "game: the price felt quiet and the controls was great.",
]

UNGRAMMATICAL = [
    "",
    ".",
    "hotel: the room was large",  # no full stop
    "hotel: the room was large .",  # space before the full stop
    " hotel: the room was large.",  # leading space
    "hotel: the room was large.\n",
    "hotel: the room was large..",
    "hotel:the room was large.",
    "hotel: the room was  large.",  # double space
    "pizza: the room was large.",  # not a domain
    "hotel: the pizza was large.",  # noun of another domain
    "hotel: the room was good.",  # the opener must be neutral
    "hotel: the room were large.",  # not a copula
    "hotel: the room was very not large.",  # "not" comes before the intensifier
    "hotel: the room was large and not not good.",
    "hotel: the room was large and.",
    "hotel: the room was large and the staff was.",
    "hotel: the room was large and the staff good.",
    "hotel: the room was large good.",  # no conjunction
    "hotel: the room was large and good and good and good and good.",  # 4 opinions > MAX_OPINIONS
    "hotel: the room was large and good. and good.",
    "hotel: the room was large and good.<|endoftext|>",
]


@pytest.mark.parametrize("text", GRAMMATICAL)
def test_grammatical_strings(text):
    assert is_grammatical(text)


@pytest.mark.parametrize("text", UNGRAMMATICAL)
def test_ungrammatical_strings_get_the_fixed_low_reward(text):
    assert not is_grammatical(text)
    assert gold_reward(text) == world.UNGRAMMATICAL_REWARD == -6.0


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        (".", 0.0),  # the opener is neutral
        (" and good.", 2.0),
        (" and very good.", 3.0),  # 1.5 * 2
        (" and extremely good.", 4.0),  # 2 * 2
        (" and slightly good.", 1.0),  # 0.5 * 2
        (" and not good.", -1.0),  # -0.5 * 2: negation flips and damps
        (" and not terrible.", 1.5),  # -0.5 * -3
        (" and not extremely terrible.", 3.0),  # -0.5 * 2 * -3
        (" and very large.", 0.0),  # neutral words score 0 whatever their modifiers
        (" and good but the staff was awful.", -1.0),  # 2 + -3: clause scores add
        (" and good and the staff was awful.", -1.0),  # "and" and "but" weigh the same
        (" and great but not very bad and the pool seemed somewhat excellent.", 6.0),  # 3 + 1.5 + 1.5
        (" and extremely great and extremely superb and extremely amazing.", 18.0),  # the maximum, 3 * 6
    ],
)
def test_gold_reward_hand_computed(response, gold):
    assert gold_reward("hotel: the room was not extremely large" + response) == gold


@given(seeds)
def test_sampled_reviews_are_grammatical_and_split_into_prompt_and_response(seed):
    rng = random.Random(seed)
    text = world.sample_review(rng)
    assert is_grammatical(text)
    assert -18.0 <= gold_reward(text) <= 18.0
    prompt, response = world.split_review(text)
    assert prompt + response == text
    assert is_grammatical(prompt + ".") and gold_reward(prompt + ".") == 0.0
    assert response == "." or response.startswith(" and ") or response.startswith(" but ")


@given(seeds, st.sampled_from(world.CONJUNCTIONS))
def test_opinion_scores_add_and_negation_flips(seed, conjunction):
    rng = random.Random(seed)
    prompt = world.sample_prompt(rng)
    r1, r2 = (world.sample_response(rng, prompt)[:-1] for _ in range(2))  # without the full stop
    if r1.count(" and ") + r1.count(" but ") + r2.count(" and ") + r2.count(" but ") > world.MAX_OPINIONS:
        assert not is_grammatical(prompt + r1 + r2 + ".")
        return
    assert gold_reward(prompt + r1 + r2 + ".") == gold_reward(prompt + r1 + ".") + gold_reward(
        prompt + r2 + "."
    )
    adjective = rng.choice(list(world.ADJECTIVES))
    plain = gold_reward(f"{prompt} {conjunction} {adjective}.")
    assert plain == world.ADJECTIVES[adjective]
    assert gold_reward(f"{prompt} {conjunction} not {adjective}.") == -0.5 * plain


def _grammar_regex() -> re.Pattern:
    """The grammar of the world.py docstring as a regular expression: an independent recogniser."""

    def alt(words) -> str:
        return "(?:" + "|".join(map(re.escape, words)) + ")"

    def predicate(adjectives) -> str:
        return f"(?:not )?(?:{alt(world.INTENSIFIERS)} )?{alt(adjectives)}"

    neutral = [w for w, s in world.ADJECTIVES.items() if s == 0]
    domains = []
    for domain, nouns in world.DOMAINS.items():
        subject = f"the {alt(nouns)} {alt(world.COPULAS)} "
        opinion = f" {alt(world.CONJUNCTIONS)} (?:{subject})?{predicate(world.ADJECTIVES)}"
        domains.append(f"{domain}: {subject}{predicate(neutral)}(?:{opinion}){{0,{world.MAX_OPINIONS}}}")
    return re.compile("(?:" + "|".join(domains) + r")\.")


GRAMMAR_REGEX = _grammar_regex()


@given(seeds, st.data())
def test_parser_agrees_with_a_regex_of_the_grammar_on_mutated_reviews(seed, data):
    words = world.sample_review(random.Random(seed))[:-1].split(" ")
    i = data.draw(st.integers(0, len(words) - 1))
    vocab = [*world.vocabulary(), "hotel:", "book:", ""]
    mutation = data.draw(st.sampled_from(["replace", "delete", "insert", "swap", "none"]))
    if mutation == "replace":
        words[i] = data.draw(st.sampled_from(vocab))
    elif mutation == "delete":
        del words[i]
    elif mutation == "insert":
        words.insert(i, data.draw(st.sampled_from(vocab)))
    elif mutation == "swap":
        j = data.draw(st.integers(0, len(words) - 1))
        words[i], words[j] = words[j], words[i]
    text = " ".join(words) + data.draw(st.sampled_from([".", "", " .", ".."]))
    grammatical = GRAMMAR_REGEX.fullmatch(text) is not None
    assert is_grammatical(text) == grammatical
    if grammatical:
        prompt, response = world.split_review(text)
        assert prompt + response == text
        assert gold_reward(text) == sum(world.parse_clause_scores(text))
    else:
        assert gold_reward(text) == world.UNGRAMMATICAL_REWARD


@pytest.mark.parametrize("text", GRAMMATICAL + UNGRAMMATICAL)
def test_hand_picked_strings_agree_with_the_regex(text):
    assert is_grammatical(text) == (GRAMMAR_REGEX.fullmatch(text) is not None)


def test_language_size_exact_and_well_over_a_million():
    # modifiers M = 2 ([not]) * 8 ([intensifier], 7 or none) = 16; 4 copulas; 10 neutral of 32 adjectives.
    # A domain with N nouns: openers = N * 4 * 16 * 10, one opinion = 2 * (N * 4 + 1) * 16 * 32.
    def reviews(n: int) -> int:
        opinion = 2 * (n * 4 + 1) * 16 * 32
        return n * 4 * 16 * 10 * (1 + opinion + opinion**2 + opinion**3)

    # Nouns per domain: restaurant, movie, hotel 10; phone, book 9; game 8.
    assert world.count_sentences() == 3 * reviews(10) + 2 * reviews(9) + reviews(8)
    assert world.count_sentences() > 2 * 10**18
    assert world.count_sentences(1) > 10**9  # even one-opinion reviews are far beyond memorisation
    assert world.count_sentences(0) == (3 * 10 + 2 * 9 + 8) * 4 * 16 * 10 == 35_840  # the prompts
    assert 80 <= len(world.vocabulary()) <= 200


def _predicates(adjectives):
    for neg, intensifier, adjective in itertools.product(["", "not "], ["", *world.INTENSIFIERS], adjectives):
        yield f"{neg}{intensifier}{' ' if intensifier else ''}{adjective}"


def test_enumerated_prompts_and_opinions_are_distinct_grammatical_and_counted():
    neutral = [w for w, s in world.ADJECTIVES.items() if s == 0]
    prompts = {
        f"{domain}: the {noun} {copula} {predicate}"
        for domain, nouns in world.DOMAINS.items()
        for noun, copula, predicate in itertools.product(nouns, world.COPULAS, _predicates(neutral))
    }
    assert len(prompts) == world.count_sentences(0)
    assert all(is_grammatical(p + ".") for p in prompts)
    # Every one-opinion response to one prompt: 2 * (10 * 4 + 1) * 16 * 32 = 41,984 distinct strings.
    prompt = "hotel: the room was large"
    subjects = ["", *(f"the {n} {c} " for n, c in itertools.product(world.DOMAINS["hotel"], world.COPULAS))]
    reviews = {
        f"{prompt} {conj} {subject}{pred}."
        for conj, subject, pred in itertools.product(
            world.CONJUNCTIONS, subjects, _predicates(world.ADJECTIVES)
        )
    }
    assert len(reviews) == 41_984
    assert all(is_grammatical(r) for r in reviews)


def test_gold_reward_fn_cuts_at_eos_and_checks_lengths():
    prompts = ["hotel: the room was large"] * 3
    responses = [" and good.<|endoftext|><|pad|>", " and good.", " and good"]
    assert world.gold_reward_fn(prompts, responses) == [2.0, 2.0, -6.0]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        world.gold_reward_fn(prompts[:2], responses[:1])


def test_sampled_gold_is_centred_with_a_spread_of_a_few_units():
    rng = random.Random(0)
    golds = [gold_reward(world.sample_review(rng)) for _ in range(4000)]
    mean = sum(golds) / len(golds)
    std = math.sqrt(sum((g - mean) ** 2 for g in golds) / len(golds))
    assert abs(mean) < 0.15  # symmetric strengths: the expectation is exactly 0; 0.15 ~ 3 standard errors
    assert 2.5 < std < 3.2
    assert sum(g < world.UNGRAMMATICAL_REWARD for g in golds) / len(golds) < 0.03


def test_bradley_terry_labels_are_right_for_large_gaps_and_noisy_for_small_ones():
    rng = random.Random(0)
    n = 4000

    def agreement(gap: float) -> float:
        return sum(assets.bradley_terry_prefers_first(rng, gap, 0.0, 1.0) for _ in range(n)) / n

    assert agreement(4.0) > 0.96  # sigmoid(4) = 0.982
    assert 0.53 < agreement(0.25) < 0.60  # sigmoid(0.25) = 0.562; std error 0.008
    assert 0.45 < agreement(0.0) < 0.55  # a tie is a coin flip
    assert not assets.bradley_terry_prefers_first(rng, -40.0, 0.0, 0.01)  # sigmoid(-4000): no overflow


def test_gold_accuracy_hand_computed():
    # pair 1: right (1 > 0, gold 1 > 0); pair 2: right (2 < 3, gold 0 < 1); pair 3: gold tie, left out;
    # pair 4: wrong (0 < 1 but gold 5 > 4) -> 2 / 3.
    acc = assets.gold_accuracy([1, 2, 3, 0], [0, 3, 3, 1], [1, 0, 2, 5], [0, 1, 2, 4])
    assert acc == pytest.approx(2 / 3)
    assert assets.gold_accuracy([1.0], [1.0], [2.0], [1.0]) == 0.0  # a score tie counts as wrong
    with pytest.raises(ValueError, match="no pair has different gold"):
        assets.gold_accuracy([1.0], [0.0], [1.0], [1.0])


@pytest.fixture(scope="module")
def small_assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return assets.main(["--out", str(out), "--small"])


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_assets_rows_are_well_formed_and_held_out_prompts_disjoint(small_assets):
    sft = _rows(small_assets["sft_train"])
    assert len(sft) == assets.SMALL["n_sft"]
    for row in sft + _rows(small_assets["sft_val"]):
        assert set(row) == {"prompt", "completion"}
        assert is_grammatical(row["prompt"] + row["completion"]) and "<|" not in row["completion"]
    eval_prompts = [r["prompt"] for r in _rows(small_assets["prompts_eval"])]
    assert len(eval_prompts) == len(set(eval_prompts)) == assets.SMALL["n_eval_prompts"]
    train_prompts = {
        r["prompt"]
        for name in ("sft_train", "prompts_train", "prefs_train")
        for r in _rows(small_assets[name])
    }
    assert not train_prompts & set(eval_prompts)
    assert all(assets.is_heldout(p) for p in eval_prompts) and not any(map(assets.is_heldout, train_prompts))
    prefs = _rows(small_assets["prefs_train"])
    assert len(prefs) == assets.SMALL["n_pref_prompts"] * 3  # C(3, 2) pairs per prompt
    for row in prefs:
        assert row["chosen"] != row["rejected"]
        assert row["gold_chosen"] == gold_reward(row["prompt"] + row["chosen"])
        assert row["gold_rejected"] == gold_reward(row["prompt"] + row["rejected"])
    agree = [(r["gold_chosen"] > r["gold_rejected"]) for r in prefs if r["gold_chosen"] != r["gold_rejected"]]
    far = [
        r["gold_chosen"] > r["gold_rejected"]
        for r in prefs
        if abs(r["gold_chosen"] - r["gold_rejected"]) >= 4
    ]
    assert 0.7 < sum(agree) / len(agree) < 1.0  # mostly right, but noisy
    assert sum(far) / len(far) > 0.9
    manifest = json.loads(small_assets["manifest"].read_text())
    assert (
        manifest["rows"]["prefs_train"] == len(prefs) and manifest["language_size"] == world.count_sentences()
    )


def test_assets_are_deterministic_for_a_seed(small_assets, tmp_path):
    again = assets.build_assets(tmp_path / "a", **assets.SMALL)
    other = assets.build_assets(tmp_path / "b", **assets.SMALL, seed=1)
    for name in ("sft_train", "prompts_eval", "prefs_train", "manifest"):
        assert again[name].read_bytes() == small_assets[name].read_bytes()
        assert other[name].read_bytes() != small_assets[name].read_bytes()
    assert (again["tokenizer"] / "tokenizer.json").read_bytes() == (
        small_assets["tokenizer"] / "tokenizer.json"
    ).read_bytes()


def test_tokenizer_round_trips_and_longest_response_bounds_every_response(small_assets, tokenizer):
    from lit_rlhf.models.tokenizer import load_tokenizer

    demo_tokenizer = load_tokenizer(str(small_assets["tokenizer"]))
    assert (
        demo_tokenizer.eos_token == "<|endoftext|>"
        and demo_tokenizer.pad_token_id != demo_tokenizer.eos_token_id
    )
    rng = random.Random(0)
    prompts = [world.sample_prompt(rng) for _ in range(500)]
    responses = [world.sample_response(rng, p) for p in prompts]
    for tok in (demo_tokenizer, tokenizer):  # the demo's and one trained on other words (many tokens a word)
        for p, r in zip(prompts, responses):
            ids = tok(p + r, add_special_tokens=False).input_ids
            assert tok.decode(ids) == p + r
        bound = world.max_response_tokens(tok)
        longest = world.longest_response(tok)
        assert bound == len(tok(longest, add_special_tokens=False).input_ids) + 1  # + EOS
        assert max(len(tok(r, add_special_tokens=False).input_ids) for r in responses) < bound
        noun = longest.split(" ")[3]
        domain = next(d for d, nouns in world.DOMAINS.items() if noun in nouns)
        assert is_grammatical(f"{domain}: the {noun} was large{longest}")
    # With the demo tokenizer every word is one token: 3 opinions of 7 words, the full stop and the EOS.
    assert world.max_response_tokens(demo_tokenizer) == 3 * 7 + 1 + 1
