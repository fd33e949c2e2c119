"""Row parsing, format detection, implicit-prompt splitting and rendering (no files, no datasets)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_rlhf.data.formats import (
    IMPLICIT_PROMPT_MARKER,
    DataFormatError,
    RowRef,
    detect_preference_format,
    detect_prompt_format,
    detect_sft_format,
    parse_preference_row,
    parse_prompt_row,
    parse_sft_row,
    split_implicit_prompt,
)
from lit_rlhf.data.render import clip_lengths, plain_chat, render

REF = RowRef("data.jsonl", 7)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ------------------------------------------------------------------------------------ implicit prompt
def test_implicit_split_cuts_after_last_assistant_marker():
    chosen = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: rate it\n\nAssistant: good food"
    rejected = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: rate it\n\nAssistant: good grief"
    # the common prefix runs into the answers ("... Assistant: good "), the cut goes back to the marker
    prompt, c, r = split_implicit_prompt(chosen, rejected)
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: rate it\n\nAssistant:"
    assert (c, r) == (" good food", " good grief")


def test_implicit_split_without_marker_cuts_before_last_whitespace():
    # common prefix "the food was " -> cut before its last space: responses keep the leading space
    assert split_implicit_prompt("the food was good", "the food was bad") == ("the food was", " good", " bad")
    # a shared partial word ("g") is not part of the prompt
    assert split_implicit_prompt("the food was good", "the food was great") == (
        "the food was",
        " good",
        " great",
    )
    # no whitespace and no marker in the common prefix -> empty prompt
    assert split_implicit_prompt("good", "great")[0] == ""


texts = st.text(alphabet=st.sampled_from(list("ab \nHumansAst:")), max_size=30)


@given(prefix=texts, a=texts, b=texts)
def test_implicit_split_properties(prefix, a, b):
    chosen, rejected = prefix + a, prefix + b
    prompt, c, r = split_implicit_prompt(chosen, rejected)
    # nothing is lost or invented, and the prompt is shared
    assert prompt + c == chosen and prompt + r == rejected
    # the cut is at a boundary: after the marker, or just before whitespace, or at the start
    assert prompt == "" or prompt.endswith(IMPLICIT_PROMPT_MARKER) or c[:1].isspace()


def test_parse_implicit_row_and_chat_variant():
    row = {"chosen": "the food was good", "rejected": "the food was bad"}
    pair = parse_preference_row(row, "implicit", REF)
    assert (pair.prompt, pair.chosen, pair.rejected, pair.margin) == ("the food was", " good", " bad", None)
    chats = {"chosen": [user("q"), assistant("yes")], "rejected": [user("q"), assistant("no")]}
    pair = parse_preference_row(chats, "implicit", REF)
    assert (
        pair.prompt == [user("q")]
        and pair.chosen == [assistant("yes")]
        and pair.rejected == [assistant("no")]
    )


@pytest.mark.parametrize(
    "row, field, problem",
    [
        ({"chosen": "same text", "rejected": "same text"}, "rejected", "identical"),
        ({"chosen": "good", "rejected": "great"}, "chosen", "share no prompt"),
        ({"chosen": "the a", "rejected": [assistant("x")]}, "rejected", "both be strings"),
        ({"chosen": [user("q")], "rejected": [user("q"), assistant("a")]}, "chosen", "no response"),
    ],
)
def test_implicit_rows_that_cannot_be_split(row, field, problem):
    with pytest.raises(DataFormatError, match=problem) as err:
        parse_preference_row(row, "implicit", REF)
    assert (err.value.source, err.value.row, err.value.field) == ("data.jsonl", 7, field)


# ------------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize(
    "columns, expected",
    [
        (["prompt", "chosen", "rejected"], "explicit"),
        (["chosen", "rejected"], "implicit"),
        (["conversations", "chosen", "rejected", "prompt"], "sharegpt"),
        (["prompt", "chosen", "rejected", "margin", "id"], "explicit"),
    ],
)
def test_detect_preference_format(columns, expected):
    assert detect_preference_format(columns, "f.json") == expected


def test_forced_format_needs_its_columns():
    assert detect_preference_format(["prompt", "chosen", "rejected"], "f.json", "implicit") == "implicit"
    with pytest.raises(DataFormatError, match="f.json, row 0 \\(0-based\\), field 'conversations'"):
        detect_preference_format(["prompt", "chosen", "rejected"], "f.json", "sharegpt")
    with pytest.raises(DataFormatError, match="field 'rejected': missing column"):
        detect_preference_format(["prompt", "chosen"], "f.json")


def test_detect_prompt_and_sft_formats():
    assert detect_prompt_format(["messages", "prompt"], "f") == "prompt"
    assert detect_prompt_format(["conversations"], "f") == "conversations"
    assert detect_sft_format(["prompt", "response"], "f") == "response"
    assert detect_sft_format(["prompt", "completion", "response"], "f") == "completion"
    assert detect_sft_format(["messages"], "f") == "messages"
    with pytest.raises(DataFormatError, match="field 'completion'"):
        detect_sft_format(["prompt"], "f")
    with pytest.raises(DataFormatError, match="field 'prompt'"):
        detect_prompt_format(["text"], "f")


# --------------------------------------------------------------------------------------------- parsing
def test_sharegpt_roles_are_mapped():
    row = {
        "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}],
        "chosen": {"from": "gpt", "value": "a"},
        "rejected": {"from": "assistant", "value": "b"},
    }
    pair = parse_preference_row(row, "sharegpt", REF)
    assert pair.prompt == [{"role": "system", "content": "s"}, user("q")]
    assert (pair.chosen, pair.rejected) == ([assistant("a")], [assistant("b")])
    row["chosen"] = {"from": "human", "value": "a"}
    with pytest.raises(DataFormatError, match="field 'chosen.from'"):
        parse_preference_row(row, "sharegpt", REF)


def test_margin_must_be_a_number():
    row = {"prompt": "p q", "chosen": "a", "rejected": "b", "margin": 2}
    assert parse_preference_row(row, "explicit", REF).margin == 2.0
    with pytest.raises(DataFormatError, match="field 'margin'"):
        parse_preference_row({**row, "margin": "big"}, "explicit", REF)


def test_prompt_rows_drop_a_final_assistant_turn():
    assert parse_prompt_row({"prompt": "hello"}, "prompt", REF) == "hello"
    assert parse_prompt_row({"messages": [user("q"), assistant("a")]}, "messages", REF) == [user("q")]
    conv = {"conversations": [{"from": "human", "value": "q"}]}
    assert parse_prompt_row(conv, "conversations", REF) == [user("q")]
    with pytest.raises(DataFormatError, match="field 'messages': no prompt"):
        parse_prompt_row({"messages": [assistant("a")]}, "messages", REF)


def test_sft_rows():
    assert parse_sft_row({"prompt": "p", "response": "r"}, "response", REF) == ("p", "r")
    assert parse_sft_row({"messages": [user("q"), assistant("a")]}, "messages", REF) == (
        [user("q")],
        [assistant("a")],
    )
    with pytest.raises(DataFormatError, match=r"field 'messages\[1\].role': the last message"):
        parse_sft_row({"messages": [assistant("a"), user("q")]}, "messages", REF)


@pytest.mark.parametrize(
    "value, field, problem",
    [
        (None, "prompt", "missing"),
        (5, "prompt", "got int"),
        ("  \n", "prompt", "empty text"),
        ([], "prompt", "got an empty list"),
        (["hi"], "prompt[0]", "got str"),
        ([{"role": "user", "content": 3}], "prompt[0].content", "expected a string, got int"),
        ([{"role": "robot", "content": "x"}], "prompt[0].role", "unknown role 'robot'"),
        ([user("x"), {"role": "user"}], "prompt[1].content", "missing"),
    ],
)
def test_bad_prompt_values_name_row_and_field(value, field, problem):
    with pytest.raises(DataFormatError, match=problem) as err:
        parse_preference_row({"prompt": value, "chosen": "a", "rejected": "b"}, "explicit", REF)
    assert str(err.value).startswith(f"data.jsonl, row 7 (0-based), field '{field}': ")


def test_response_chat_must_end_with_assistant():
    row = {"prompt": "p", "chosen": [user("x")], "rejected": "b"}
    with pytest.raises(DataFormatError, match=r"field 'chosen\[0\].role'"):
        parse_preference_row(row, "explicit", REF)


# ------------------------------------------------------------------------------------------- rendering
def test_plain_chat_fallback():
    chat = [{"role": "system", "content": "be nice"}, user("hi")]
    assert plain_chat(chat, add_generation_prompt=True) == "System: be nice\n\nUser: hi\n\nAssistant:"
    assert plain_chat([*chat, assistant("yo")], False) == "System: be nice\n\nUser: hi\n\nAssistant: yo"


def test_render_strings_verbatim_and_chats(tokenizer, chat_tokenizer_dir):
    from lit_rlhf.models.tokenizer import load_tokenizer

    assert render(tokenizer, "p q", ["a", "b"]).responses == ("a", "b")
    # a string response to a chat prompt becomes an assistant message
    plain = render(tokenizer, [user("hi")], ["yo", [assistant("no")]])
    assert (plain.prompt, plain.responses, plain.templated) == (
        "User: hi\n\nAssistant:",
        (" yo", " no"),
        False,
    )
    templated = render(load_tokenizer(chat_tokenizer_dir), "hi", [[assistant("yo")]])
    assert templated.prompt == "<|user|>hi<|end|><|assistant|>"
    assert templated.responses == ("yo<|end|>",) and templated.templated


def test_clip_lengths_keeps_prompt_end_and_response_start():
    # prompt 6 > 4 -> last 4; budget = 7 - 4 = 3: response [7, 8] fits, [9..13] -> [9, 10, 11]
    prompt, responses, over = clip_lengths([1, 2, 3, 4, 5, 6], [[7, 8], [9, 10, 11, 12, 13]], 4, 7)
    assert (prompt, responses, over) == ([3, 4, 5, 6], [[7, 8], [9, 10, 11]], True)
    assert clip_lengths([1, 2], [[3]], 4, 7) == ([1, 2], [[3]], False)
    assert clip_lengths([1, 2, 3], [], 2, None) == ([2, 3], [], True)


def test_clip_lengths_keeps_a_leading_bos():
    # BOS 9 stays first and the prompt's last 3 tokens follow it; a prompt without BOS, or one within its
    # limit, is cut (or not) as before; a limit of 1 keeps the last token alone
    assert clip_lengths([9, 1, 2, 3, 4, 5], [[7, 8]], 4, 7, bos_token_id=9) == ([9, 3, 4, 5], [[7, 8]], True)
    assert clip_lengths([1, 2, 3, 4, 5], [], 4, None, bos_token_id=9) == ([2, 3, 4, 5], [], True)
    assert clip_lengths([9, 1, 2], [], 4, None, bos_token_id=9) == ([9, 1, 2], [], False)
    assert clip_lengths([9, 1, 2], [], 1, None, bos_token_id=9) == ([2], [], True)


def test_tokenize_rendered_appends_eos_once(tokenizer):
    from lit_rlhf.data.render import Rendered, tokenize_rendered

    eos = tokenizer.eos_token_id
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [
        Rendered("the food", (" good", " bad<|endoftext|>"), templated=False),
        # a template that writes a newline after the closing EOS: the newline goes, EOS stays single
        Rendered("<|endoftext|>the", ("good<|endoftext|>\n", " bad\n"), templated=True),
    ]
    prompts, responses, masks = tokenize_rendered(tokenizer, rows)
    assert prompts == [ids("the food"), ids("<|endoftext|>the")]
    assert masks == [[[], []], [[], []]]  # no trained spans: every response token is trained
    assert responses[0] == [[*ids(" good"), eos], [*ids(" bad"), eos]]
    assert responses[1] == [[*ids("good"), eos], [*ids(" bad\n"), eos]]
    assert tokenize_rendered(tokenizer, [Rendered("p", (), False)]) == ([ids("p")], [[]], [[]])
