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


Span = tuple[int, int]  # [start, end) characters of a response text


@dataclass(frozen=True)
class Rendered:
    prompt: str
    responses: tuple[str, ...]
    # True when the prompt text came from a chat template, which already holds its special tokens (BOS).
    templated: bool
    # per response: the spans of its text the model learns to write (the assistant turns of a multi-turn
    # response); None (or no entry) when that is the whole response
    trained: tuple[tuple[Span, ...] | None, ...] = ()


def render(
    tokenizer: PreTrainedTokenizerBase, prompt: Text, responses: Sequence[Text] = (), spans: bool = False
) -> Rendered:
    """Prompt and response texts of one row (see module docstring); with ``spans``, where the assistant turns
    of each multi-turn response lie (:func:`assistant_spans`)."""
    if isinstance(prompt, str) and all(isinstance(r, str) for r in responses):
        return Rendered(prompt, tuple(responses), templated=False)
    chat = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    prompt_text = render_chat(tokenizer, chat, add_generation_prompt=True)
    texts, trained = [], []
    for response in responses:
        reply = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        full = render_chat(tokenizer, chat + reply, add_generation_prompt=False)
        text = full[len(os.path.commonprefix([prompt_text, full])) :]
        texts.append(text)
        multi_turn = spans and any(m["role"] != "assistant" for m in reply)
        if multi_turn:  # the generation prompt is the header the template opens an assistant turn with
            bare = render_chat(tokenizer, chat, add_generation_prompt=False)
            header = prompt_text[len(bare) :] if prompt_text.startswith(bare) else ""
        trained.append(assistant_spans(text, reply, header) if multi_turn else None)
    return Rendered(prompt_text, tuple(texts), tokenizer.chat_template is not None, tuple(trained))


def assistant_spans(text: str, reply: Chat, header: str) -> tuple[Span, ...]:
    """Where the assistant turns of a multi-turn response lie in its rendered ``text``.

    Each assistant message is found by its content, in order. Its span runs from the start of the text (the
    first message) or the end of the nearest turn ``header`` before its content (the template's generation
    prompt, e.g. ``<|im_start|>assistant\n``; what the template writes between the two, such as reasoning,
    is the model's to write too) to the end of its content plus the template's end-of-turn marker (what the
    last turn's rendering puts after its content, e.g. ``<|im_end|>``) where that follows. Found by content
    rather than by rendering each prefix of the conversation, since templates render earlier turns otherwise
    than the last (Qwen3 drops their reasoning).
    """
    found, at = [], 0
    for i, message in enumerate(reply):
        if message["role"] != "assistant":
            continue
        content = message["content"].strip()
        start = text.find(content, at)
        if start < 0:
            raise ValueError(
                f"the chat template's rendering of the response does not contain the content of its message {i}"
                " (the template rewrites it), so its assistant turns cannot be told from the others"
            )
        opened = text.rfind(header, at, start) if header else -1
        found.append((0 if i == 0 else start if opened < 0 else opened + len(header), start + len(content)))
        at = start + len(content)
    marker = text[found[-1][1] :].rstrip()  # what the template writes after the last turn's content
    return tuple((s, e + len(marker) if marker and text.startswith(marker, e) else e) for s, e in found)


def tokenize_rendered(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[Rendered]
) -> tuple[list[list[int]], list[list[list[int]]], list[list[list[int]]]]:
    """Token ids of prompts and responses and the responses' loss masks; returns (prompts[row],
    responses[row][slot], masks[row][slot]), a mask empty when every response token is trained.

    Plain prompts get the tokenizer's own special tokens (e.g. Llama's BOS); templated ones do not, as the
    template wrote them. A response's ids are those that follow the prompt's in prompt + response tokenised
    together, as the model sees them when it generates (SentencePiece would start a response tokenised alone
    with a lone "▁" no generation writes); alone only where the two do not split at the prompt's end.
    Responses get no special tokens but EOS, appended unless the text already ends with it; whitespace a
    template writes after a closing EOS (e.g. ``"<|im_end|>\n"``) is dropped, since a response ends at its EOS
    (the project's convention) and a second EOS would be learnt otherwise. The mask of a response with trained
    spans is 1 on the tokens that start inside one, and on the EOS.
    """
    prompts: list[list[int]] = [[] for _ in rows]
    appended_eos = appends_eos(tokenizer)
    for templated in (False, True):
        index = [i for i, r in enumerate(rows) if r.templated == templated]
        if index:
            texts = [rows[i].prompt for i in index]
            encoded = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
            encoded = _without_eos(encoded, tokenizer.eos_token_id) if appended_eos and not templated else encoded
            for i, ids in zip(index, encoded):
                prompts[i] = ids
    eos, eos_text = tokenizer.eos_token_id, tokenizer.eos_token
    responses: list[list[list[int]]] = [[] for _ in rows]
    masks: list[list[list[int]]] = [[] for _ in rows]
    for slot in range(len(rows[0].responses) if rows else 0):
        texts = [r.responses[slot] for r in rows]
        texts = [t.rstrip() if t.rstrip().endswith(eos_text) else t for t in texts]
        spans = [r.trained[slot] if slot < len(r.trained) else None for r in rows]
        ids, starts = _response_ids(tokenizer, rows, texts, prompts, any(s is not None for s in spans), appended_eos)
        for i, (row_ids, row_starts, row_spans) in enumerate(zip(ids, starts, spans)):
            mask = [] if row_spans is None else [int(any(a <= c < b for a, b in row_spans)) for c in row_starts]
            if row_ids[-1:] != [eos]:
                row_ids, mask = [*row_ids, eos], mask and [*mask, 1]
            responses[i].append(row_ids)
            masks[i].append(mask)
    return prompts, responses, masks


def _response_ids(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Rendered],
    texts: list[str],
    prompts: list[list[int]],
    offsets: bool,
    appended_eos: bool,
) -> tuple[list[list[int]], list[list[int]]]:
    """The responses' ids (see :func:`tokenize_rendered`) and, with ``offsets``, where in its text each
    token starts; one batched call per kind of prompt, and one for the responses tokenised alone."""
    ids: list[list[int]] = [[] for _ in rows]
    starts: list[list[int]] = [[] for _ in rows]
    alone = []
    for templated in (False, True):
        index = [i for i, r in enumerate(rows) if r.templated == templated]
        if not index:
            continue
        joint = tokenizer(
            [rows[i].prompt + texts[i] for i in index],
            add_special_tokens=not templated,
            return_offsets_mapping=offsets,
        )
        joint_ids = _without_eos(joint["input_ids"], tokenizer.eos_token_id) if appended_eos and not templated else joint["input_ids"]
        for j, i in enumerate(index):
            n, row_ids = len(prompts[i]), joint_ids[j]
            if row_ids[:n] != prompts[i]:  # a token straddles the prompt's end
                alone.append(i)
                continue
            ids[i] = row_ids[n:]
            if offsets:
                starts[i] = [a - len(rows[i].prompt) for a, _ in joint["offset_mapping"][j][n:]]
    if alone:
        separate = tokenizer([texts[i] for i in alone], add_special_tokens=False, return_offsets_mapping=offsets)
        for j, i in enumerate(alone):
            ids[i] = separate["input_ids"][j]
            if offsets:
                starts[i] = [a for a, _ in separate["offset_mapping"][j]]
    return ids, starts


def appends_eos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer appends EOS to every encoding with its special tokens (Llama or Mistral saved with
    ``add_eos_token=True``, a ``<s> $A </s>`` post-processor): a plain prompt must not end in it (the model would
    generate after an end of sequence), and a response ends in the one EOS :func:`tokenize_rendered` appends."""
    eos = tokenizer.eos_token_id
    return eos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][-1:] == [eos]


def _without_eos(encoded: list[list[int]], eos: int) -> list[list[int]]:
    """Each encoding less its last token where that is ``eos`` (the one :func:`appends_eos` tokenizers add)."""
    return [ids[:-1] if ids[-1:] == [eos] else ids for ids in encoded]


def clip_lengths(
    prompt: list[int],
    responses: list[list[int]],
    max_prompt_length: int,
    max_length: int | None,
    bos_token_id: int | None = None,
) -> tuple[list[int], list[list[int]], bool]:
    """Apply the length limits; returns (prompt, responses, over_limit).

    The prompt keeps its *last* ``max_prompt_length`` tokens (the text nearest the response matters
    most) after its leading ``bos_token_id``, which stays where the prompt starts with one (as a Hugging
    Face tokenizer truncating from the left keeps the special tokens it adds): a model trained with BOS never
    sees a long prompt without it. Each response keeps its *first* ``max_length - len(prompt)`` tokens (it
    then lacks EOS, i.e. it is truncated). ``over_limit`` says whether anything was cut.
    """
    over = len(prompt) > max_prompt_length
    if over:
        keep_bos = bos_token_id is not None and max_prompt_length > 1 and prompt[0] == bos_token_id
        prompt = [prompt[0], *prompt[len(prompt) - max_prompt_length + 1 :]] if keep_bos else prompt[-max_prompt_length:]
    if max_length is not None:
        budget = max_length - len(prompt)
        over = over or any(len(r) > budget for r in responses)
        responses = [r[:budget] for r in responses]
    return prompt, responses, over
