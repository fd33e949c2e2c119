"""Row formats: detection, validation and normalisation of preference, prompt and SFT rows.

Every parser turns one raw row (a dict from ``datasets``) into plain Python values and raises a
:class:`DataFormatError` naming the source, the row and the field at the first problem it finds.
Texts are either strings (used verbatim) or *chats*: lists of ``{"role", "content"}`` messages with
role ``system``, ``user`` or ``assistant`` and non-empty string content (a message's other keys, such as
``reasoning_content``, are kept for the chat template). :mod:`lit_rlhf.data.render` turns them into model text.

Preference formats (``format="auto"`` picks the first that matches the columns, in this order):

- ``sharegpt``: ``conversations`` (list of ``{from, value}``; from = human/user, gpt/assistant or
  system) plus ``chosen``/``rejected`` single ``{from, value}`` turns from gpt/assistant (the ShareGPT preference layout).
- ``explicit``: ``prompt``, ``chosen``, ``rejected``; each a string or a chat (responses: assistant messages;
  full conversations beside the prompt are read as TRL reads them, see :func:`_parse_explicit`).
- ``implicit``: ``chosen``, ``rejected`` full texts sharing a prompt (Anthropic HH); see
  :func:`split_implicit_prompt`. Both may also be chats: the prompt is their common leading messages.

An optional numeric ``margin`` column is passed through (the reward-model margin loss).
Prompt rows: ``prompt`` (string or chat), else ``messages`` (chat), else ``conversations`` (ShareGPT);
a final assistant turn in ``messages``/``conversations`` is dropped, so SFT data doubles as prompts.
SFT rows: ``prompt`` + ``completion`` (or ``response``), else ``messages``/``conversations`` ending with an
assistant message: the prompt is everything before the first assistant message, the completion the rest
(in a multi-turn conversation, every assistant turn is trained and the user turns between them are not).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Literal

Chat = list[dict[str, Any]]  # {role, content} and whatever else a message holds for its template
Text = str | Chat

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
# The turn marker of Anthropic HH; an implicit prompt is cut right after its last occurrence.
IMPLICIT_PROMPT_MARKER = "\n\nAssistant:"

PreferenceFormat = Literal["auto", "explicit", "implicit", "sharegpt"]


class DataFormatError(ValueError):
    """A data source or row that cannot be used; the message names source, row (0-based) and field."""

    def __init__(self, source: str, problem: str, row: int | None = None, field: str | None = None) -> None:
        self.source, self.row, self.field = source, row, field
        where = str(source)
        if row is not None:
            where += f", row {row} (0-based)"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class RowRef:
    """Where a row comes from, to build errors that point at it."""

    source: str
    row: int

    def error(self, field: str, problem: str) -> DataFormatError:
        return DataFormatError(self.source, problem, row=self.row, field=field)


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def parse_string(value: Any, ref: RowRef, field: str) -> str:
    """A non-blank string."""
    if value is None:
        raise ref.error(field, "missing (null or absent)")
    if not isinstance(value, str):
        raise ref.error(field, f"expected a string, got {_type(value)}")
    if not value.strip():
        raise ref.error(field, "empty text")
    return value


def parse_chat(value: Any, ref: RowRef, field: str, *, sharegpt: bool = False) -> Chat:
    """A non-empty list of messages (``{role, content}``, or ShareGPT ``{from, value}``) as ``{role, content}``."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else _type(value)
        raise ref.error(field, f"expected a non-empty list of messages, got {got}")
    return [_parse_message(m, ref, f"{field}[{i}]", sharegpt=sharegpt) for i, m in enumerate(value)]


def _parse_message(message: Any, ref: RowRef, field: str, *, sharegpt: bool) -> dict[str, Any]:
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if not isinstance(message, dict):
        raise ref.error(field, f"expected a {{{role_key}, {content_key}}} message, got {_type(message)}")
    role = message.get(role_key)
    known = SHAREGPT_ROLES if sharegpt else {r: r for r in ROLES}
    if not isinstance(role, str) or role not in known:
        raise ref.error(f"{field}.{role_key}", f"unknown role {role!r}; expected one of {sorted(known)}")
    content = parse_string(message.get(content_key), ref, f"{field}.{content_key}")
    if sharegpt:
        return {"role": known[role], "content": content}
    # the template reads what else a message holds (Qwen3's ``reasoning_content``, ``name``, ``tool_calls``);
    # a column of messages read by ``datasets`` holds every key of every message, None where absent
    extra = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
    return {"role": known[role], "content": content, **extra}


def parse_text(value: Any, ref: RowRef, field: str) -> Text:
    """A string or a chat."""
    if isinstance(value, list):
        return parse_chat(value, ref, field)
    if value is not None and not isinstance(value, str):
        raise ref.error(
            field, f"expected a string or a list of {{role, content}} messages, got {_type(value)}"
        )
    return parse_string(value, ref, field)


def parse_response(value: Any, ref: RowRef, field: str) -> Text:
    """A response: a string, or a chat of assistant messages."""
    return check_response(parse_text(value, ref, field), ref, field)


def check_response(text: Text, ref: RowRef, field: str) -> Text:
    """``text`` when it is a string or a chat of assistant messages only: another role in a response would be
    trained as the model's own text (a full conversation given beside a ``prompt``, say)."""
    if isinstance(text, list):
        other = next((i for i, m in enumerate(text) if m["role"] != "assistant"), None)
        if other is not None:
            raise ref.error(
                f"{field}[{other}].role",
                f"a response holds assistant messages only, got {text[other]['role']!r} (a full conversation?"
                " give chosen/rejected without the prompt's messages, or without a prompt column: the"
                " implicit format takes their shared leading messages as the prompt)",
            )
    return text


def _missing_column(columns: list[str], source: str, name: str, expected: str) -> DataFormatError:
    return DataFormatError(source, f"missing column; found {sorted(columns)}; expected {expected}", 0, name)


# ------------------------------------------------------------------------------------------- preference
@dataclass(frozen=True)
class PreferenceRow:
    prompt: Text
    chosen: Text
    rejected: Text
    margin: float | None = None


def detect_preference_format(columns: list[str], source: str, fmt: PreferenceFormat = "auto") -> str:
    """Resolve ``fmt`` (``"auto"`` looks at the columns, see module docstring) and check its columns."""
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in columns else "explicit" if "prompt" in columns else "implicit"
    needed = {"sharegpt": ("conversations",), "explicit": ("prompt",), "implicit": ()}[fmt]
    for name in (*needed, "chosen", "rejected"):
        if name not in columns:
            raise _missing_column(columns, source, name, f"the {fmt!r} preference format")
    return fmt


def split_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two full texts into (prompt, chosen response, rejected response).

    The prompt is their longest common prefix, cut back to a boundary so that no response starts in the
    middle of a word: right after the last ``"\\n\\nAssistant:"`` in it (Anthropic HH), otherwise just
    before its last whitespace (so responses start with that whitespace, as byte-level BPE expects).
    Without either boundary the prompt is empty.
    """
    common = os.path.commonprefix([chosen, rejected])
    cut = common.rfind(IMPLICIT_PROMPT_MARKER)
    if cut >= 0:
        cut += len(IMPLICIT_PROMPT_MARKER)
    else:
        cut = max((i for i, ch in enumerate(common) if ch.isspace()), default=0)
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _parse_implicit(row: dict, ref: RowRef) -> tuple[Text, Text, Text]:
    chosen, rejected = (
        parse_text(row.get("chosen"), ref, "chosen"),
        parse_text(row.get("rejected"), ref, "rejected"),
    )
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise ref.error("rejected", "chosen and rejected must both be strings or both be chats")
    if chosen == rejected:
        raise ref.error("rejected", "identical to chosen")
    if isinstance(chosen, str):
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if not prompt.strip():
            raise ref.error(
                "chosen", "chosen and rejected share no prompt (no common prefix up to a boundary)"
            )
        for field, text in (("chosen", chosen), ("rejected", rejected)):
            parse_string(text, ref, field)
        return prompt, chosen, rejected
    n = next((i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), min(len(chosen), len(rejected)))
    if n == 0:
        raise ref.error("chosen", "chosen and rejected share no leading prompt messages")
    for field, chat in (("chosen", chosen), ("rejected", rejected)):
        if len(chat) == n:
            raise ref.error(field, "no response: all its messages are shared with the other side")
        if chat[-1]["role"] != "assistant":
            raise ref.error(f"{field}[{len(chat) - 1}].role", "a response must end with an assistant message")
    return chosen[:n], chosen[n:], rejected[n:]


def _parse_explicit(row: dict, ref: RowRef) -> tuple[Text, Text, Text]:
    """``prompt``, ``chosen``, ``rejected``; chats that repeat the prompt are cut to their responses.

    A string prompt beside full conversations (UltraFeedback-binarized: ``prompt`` the user's text,
    ``chosen``/``rejected`` the user turn and the reply) is read as TRL's ``maybe_extract_prompt`` reads it:
    the prompt is the conversations' shared leading messages. A chat prompt whose messages both
    conversations start with is cut off them.
    """
    prompt = parse_text(row.get("prompt"), ref, "prompt")
    chosen, rejected = (parse_text(row.get(f), ref, f) for f in ("chosen", "rejected"))
    if isinstance(chosen, list) and isinstance(rejected, list):
        full = any(m["role"] != "assistant" for m in chosen + rejected)
        if isinstance(prompt, str) and full:
            return _parse_implicit(row, ref)
        n = len(prompt) if isinstance(prompt, list) else 0
        if n and chosen[:n] == prompt and rejected[:n] == prompt:
            chosen, rejected = chosen[n:], rejected[n:]
            for field, chat in (("chosen", chosen), ("rejected", rejected)):
                if not chat:
                    raise ref.error(field, "no response: all its messages are the prompt's")
    return prompt, *(check_response(t, ref, f) for t, f in ((chosen, "chosen"), (rejected, "rejected")))


def _parse_sharegpt_turn(value: Any, ref: RowRef, field: str) -> Chat:
    message = _parse_message(value, ref, field, sharegpt=True)
    if message["role"] != "assistant":
        raise ref.error(f"{field}.from", "the response must come from gpt/assistant")
    return [message]


def parse_margin(value: Any, ref: RowRef) -> float:
    if isinstance(value, str):  # a CSV cell is text as written
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ref.error("margin", f"expected a finite number, got {value!r}")
    return float(value)


def parse_preference_row(row: dict, fmt: str, ref: RowRef) -> PreferenceRow:
    """Validate one preference row of resolved format ``fmt`` (see :func:`detect_preference_format`)."""
    if fmt == "sharegpt":
        prompt = parse_chat(row.get("conversations"), ref, "conversations", sharegpt=True)
        chosen = _parse_sharegpt_turn(row.get("chosen"), ref, "chosen")
        rejected = _parse_sharegpt_turn(row.get("rejected"), ref, "rejected")
    elif fmt == "explicit":
        prompt, chosen, rejected = _parse_explicit(row, ref)
    else:
        prompt, chosen, rejected = _parse_implicit(row, ref)
    if chosen == rejected:  # no preference to learn: the pair's loss gradient is zero whatever the model
        raise ref.error("rejected", "identical to chosen")
    margin = parse_margin(row["margin"], ref) if "margin" in row else None
    return PreferenceRow(prompt, chosen, rejected, margin)


# ----------------------------------------------------------------------------------------------- prompts
def detect_prompt_format(columns: list[str], source: str) -> str:
    """The column holding the prompt: ``prompt``, else ``messages``, else ``conversations``."""
    found = next((n for n in ("prompt", "messages", "conversations") if n in columns), None)
    if found is None:
        raise _missing_column(columns, source, "prompt", "'prompt', 'messages' or 'conversations'")
    return found


def _drop_final_assistant(chat: Chat, ref: RowRef, field: str) -> Chat:
    chat = chat[:-1] if chat[-1]["role"] == "assistant" else chat
    if not chat:
        raise ref.error(field, "no prompt: the only message is an assistant turn")
    return chat


def parse_prompt_row(row: dict, fmt: str, ref: RowRef) -> Text:
    """Validate one prompt row; ``fmt`` is the column from :func:`detect_prompt_format`."""
    if fmt == "prompt":
        return parse_text(row.get("prompt"), ref, "prompt")
    chat = parse_chat(row.get(fmt), ref, fmt, sharegpt=fmt == "conversations")
    return _drop_final_assistant(chat, ref, fmt)


# ------------------------------------------------------------------------------------------------- SFT
def detect_sft_format(columns: list[str], source: str) -> str:
    """The column holding the target: ``completion``/``response`` (with ``prompt``), else ``messages``/``conversations``."""
    target = next((n for n in ("completion", "response") if n in columns), None)
    if "prompt" in columns and target is not None:
        return target
    # a chat column wins over a lone ``prompt`` (ultrachat_200k has ``prompt``, ``prompt_id`` and ``messages``)
    found = next((n for n in ("messages", "conversations") if n in columns), None)
    if found is None:
        if "prompt" in columns:
            raise _missing_column(columns, source, "completion", "'prompt' with 'completion' or 'response'")
        raise _missing_column(
            columns, source, "prompt", "'prompt' + 'completion', 'messages' or 'conversations'"
        )
    return found


def parse_sft_row(row: dict, fmt: str, ref: RowRef) -> tuple[Text, Text]:
    """Validate one SFT row into (prompt, completion); ``fmt`` is the column from :func:`detect_sft_format`."""
    if fmt in ("completion", "response"):
        return parse_text(row.get("prompt"), ref, "prompt"), parse_response(row.get(fmt), ref, fmt)
    chat = parse_chat(row.get(fmt), ref, fmt, sharegpt=fmt == "conversations")
    if chat[-1]["role"] != "assistant":
        raise ref.error(f"{fmt}[{len(chat) - 1}].role", "the last message must be the assistant's response")
    first = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
    if first == 0:
        raise ref.error(fmt, "no prompt before the assistant's response")
    # the prompt ends at the first assistant turn; the completion is the rest of the conversation, trained on
    # its assistant turns (its user turns are masked out: see SFTCollator)
    return chat[:first], chat[first:]
