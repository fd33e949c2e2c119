"""Tokenizers: loading with the project's pad-token policy, and training a small byte-level BPE.

Pad-token policy: a tokenizer without a pad token, or whose pad token is its EOS, gets a *dedicated* one
(``<|pad|>``) instead of reusing EOS. With pad = EOS an attention mask built from ``input_ids != pad_token_id`` hides every real
EOS, so reward models would score the wrong token and responses would never be seen to end. The model
builders in :mod:`lit_rlhf.models.loading` resize the embeddings to match.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"

# A minimal role-tagged chat template for locally trained tokenizers (tests, demo).
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a dedicated pad token if it has none, or if its pad token is its EOS (as many
    tokenizers ship, Qwen2.5's base models among them): never EOS, see the module docstring."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return tokenizer


def load_tokenizer(
    name_or_path: str, *, padding_side: str = "right", trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a hub id or local folder and apply the pad-token policy.

    Args:
        name_or_path: hub id or folder written by ``save_pretrained``.
        padding_side: default padding side; collators pad explicitly, so this only matters to
            callers that use ``tokenizer.pad`` themselves.
        trust_remote_code: forwarded to ``AutoTokenizer.from_pretrained``.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not os.path.exists(os.path.expanduser(name_or_path)):  # say first what a local path lacks
            reason = f"no such folder ({os.path.abspath(name_or_path)}), nor a hub model ({reason})"
        raise OSError(f"could not load a tokenizer from {name_or_path!r}: {reason}") from err
    tokenizer.padding_side = padding_side
    if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
        # e.g. a model folder without tokenizer files (an export killed after its weights were written):
        # transformers builds a tokenizer of special tokens only from config.json, which encodes text to nothing
        raise OSError(
            f"could not load a tokenizer from {name_or_path!r}: it has no vocabulary besides its special tokens;"
            " does the folder hold the tokenizer files (tokenizer.json, vocab.json, ...)? A half-written export?"
            " Re-run the fit that writes it"
        )
    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no eos_token: responses could never end; set one and save it"
        )
    return ensure_pad_token(tokenizer)


def tokenizer_difference(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> str | None:
    """What makes token ids of ``a`` mean something else under ``b`` (None when they mean the same): the
    vocabulary, or which ids are the EOS and pad tokens."""
    if a is b:
        return None
    if a.get_vocab() != b.get_vocab():
        return f"another vocabulary ({len(a)} against {len(b)} tokens)"
    for role in ("eos_token_id", "pad_token_id"):
        if getattr(a, role) != getattr(b, role):
            name = role.removesuffix("_id").replace("_", " ")
            return f"another {name} ({getattr(a, role)} against {getattr(b, role)})"
    return None


def check_shared_tokenizer(
    own: str | None,
    role: str,
    tokenizer: PreTrainedTokenizerBase,
    source: str,
    *,
    owner: str = "",
    trust_remote_code: bool = False,
) -> None:
    """Refuse a model that reads the actor's token ids (reference, critic) whose own tokenizer is another one.

    Such a model is built for ``tokenizer`` (the actor's, loaded from ``source``), so a different vocabulary
    would be read silently: token ids it has other embeddings for, rows added at random for ids it lacks.

    Args:
        own: the model's ``tokenizer`` or ``name_or_path`` (None for an inline config without a tokenizer:
            it takes the actor's). A folder holding no tokenizer passes (the model takes the actor's).
        role: the model's argument name, for the message; ``owner`` (the module's name) starts it.
        tokenizer: the actor's tokenizer; ``source`` where it was loaded from.
    """
    if own is None or os.path.abspath(os.path.expanduser(own)) == os.path.abspath(os.path.expanduser(source)):
        return
    try:
        other = load_tokenizer(own, trust_remote_code=trust_remote_code)
    except OSError:
        return  # a model folder without tokenizer files
    difference = tokenizer_difference(other, tokenizer)
    if difference is not None:
        raise ValueError(
            f"{owner + ': ' if owner else ''}{role}: its tokenizer ({own!r}, {len(other)} tokens) is not the "
            f"actor's ({source!r}, {len(tokenizer)} tokens): {difference}; the {role} reads the actor's token ids, "
            "so give it a model trained with the actor's tokenizer"
        )


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    *,
    chat_template: str | None = None,
    extra_special_tokens: tuple[str, ...] = (),
    split_digits: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``texts`` with the ``tokenizers`` library.

    The result has ``<|endoftext|>`` as EOS/BOS and a dedicated ``<|pad|>``; it round-trips through
    ``save_pretrained`` / ``AutoTokenizer.from_pretrained``. Used by tests and the offline demo, where
    nothing can be downloaded. ``split_digits`` makes every digit a token of its own (no merge spans two
    digits, as in LLaMA's tokenizer), so a number of n digits is n tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [EOS_TOKEN, PAD_TOKEN, *extra_special_tokens]
    if chat_template is not None:
        specials += ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
