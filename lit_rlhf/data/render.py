"""From validated texts to token ids: chat templates (or a plain fallback), EOS, length limits.

A row is *conversational* when its prompt or any response is a chat; then a string prompt becomes one
user message and a string response one assistant message. Conversational rows are rendered with the
tokenizer's chat template when it has one (the prompt with ``add_generation_prompt=True``), otherwise
with :func:`plain_chat`. String-only rows are used verbatim, as in TRL's "standard" format: a template
is never forced onto raw text (it would mangle e.g. Anthropic HH transcripts).

A response's text is the rendering of prompt + response minus the longest prefix it shares with the
rendered prompt, so it carries whatever the template puts around an assistant turn (e.g. an
end-of-turn token), exactly what the model must learn to emit (TRL ``apply_chat_template`` does the same).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from lit_rlhf.data.formats import Chat, Text

PLAIN_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def plain_chat(chat: Chat, add_generation_prompt: bool) -> str:
    """Fallback without a chat template: ``"User: hi\\n\\nAssistant: hello"``.

    Turns are ``"<Role>: <content>"`` joined by a blank line; the generation prompt is
    ``"\\n\\nAssistant:"``, so responses start with a space (the Anthropic HH layout).
    """
    text = "\n\n".join(f"{PLAIN_ROLE_NAMES[m['role']]}: {m['content']}" for m in chat)
    return text + "\n\nAssistant:" if add_generation_prompt else text


def render_chat(tokenizer: PreTrainedTokenizerBase, chat: Chat, add_generation_prompt: bool) -> str:
    """The chat as text: the tokenizer's chat template when it has one, else :func:`plain_chat`."""
    if tokenizer.chat_template is None:
        return plain_chat(chat, add_generation_prompt)
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)


@dataclass(frozen=True)
class Rendered:
    prompt: str
    responses: tuple[str, ...]
    # True when the prompt text came from a chat template, which already holds its special tokens (BOS).
    templated: bool


def render(tokenizer: PreTrainedTokenizerBase, prompt: Text, responses: Sequence[Text] = ()) -> Rendered:
    """Prompt and response texts of one row (see module docstring)."""
    if isinstance(prompt, str) and all(isinstance(r, str) for r in responses):
        return Rendered(prompt, tuple(responses), templated=False)
    chat = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    prompt_text = render_chat(tokenizer, chat, add_generation_prompt=True)
    texts = []
    for response in responses:
        reply = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        full = render_chat(tokenizer, chat + reply, add_generation_prompt=False)
        texts.append(full[len(os.path.commonprefix([prompt_text, full])) :])
    return Rendered(prompt_text, tuple(texts), templated=tokenizer.chat_template is not None)


def tokenize_rendered(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[Rendered]
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Token ids of prompts and responses; returns (prompts[row], responses[row][slot]).

    Plain prompts get the tokenizer's own special tokens (e.g. Llama's BOS); templated ones do not, as the
    template wrote them. Responses get none but EOS, appended unless the text already ends with it;
    whitespace a template writes after a closing EOS (e.g. ``"<|im_end|>\n"``) is dropped, since a
    response ends at its EOS (the project's convention) and a second EOS would be learnt otherwise.
    """
    prompts: list[list[int]] = [[] for _ in rows]
    for templated in (False, True):
        index = [i for i, r in enumerate(rows) if r.templated == templated]
        if index:
            texts = [rows[i].prompt for i in index]
            for i, ids in zip(index, tokenizer(texts, add_special_tokens=not templated)["input_ids"]):
                prompts[i] = ids
    eos, eos_text = tokenizer.eos_token_id, tokenizer.eos_token
    responses: list[list[list[int]]] = [[] for _ in rows]
    for slot in range(len(rows[0].responses) if rows else 0):
        texts = [r.responses[slot] for r in rows]
        texts = [t.rstrip() if t.rstrip().endswith(eos_text) else t for t in texts]
        for row, ids in zip(responses, tokenizer(texts, add_special_tokens=False)["input_ids"]):
            row.append(ids if ids[-1:] == [eos] else [*ids, eos])
    return prompts, responses


def clip_lengths(
    prompt: list[int], responses: list[list[int]], max_prompt_length: int, max_length: int | None
) -> tuple[list[int], list[list[int]], bool]:
    """Apply the length limits; returns (prompt, responses, over_limit).

    The prompt keeps its *last* ``max_prompt_length`` tokens (the text nearest the response matters
    most); each response keeps its *first* ``max_length - len(prompt)`` tokens (it then lacks EOS, i.e.
    it is truncated). ``over_limit`` says whether anything was cut.
    """
    over = len(prompt) > max_prompt_length
    prompt = prompt[-max_prompt_length:]
    if max_length is not None:
        budget = max_length - len(prompt)
        over = over or any(len(r) > budget for r in responses)
        responses = [r[:budget] for r in responses]
    return prompt, responses, over
