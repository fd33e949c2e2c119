"""Conversational data as other projects' users bring it: UltraFeedback-style full conversations beside a
prompt, multi-turn SFT trained on every assistant turn, SentencePiece responses, extra message keys,
ultrachat's columns, held-out splits of the training source, and Excel's CSV byte-order mark."""

from __future__ import annotations

import json

import pytest
from conftest import make_corpus

from lit_rlhf.data import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_rlhf.data.formats import DataFormatError, RowRef, detect_sft_format, parse_preference_row
from lit_rlhf.models.tokenizer import load_tokenizer, train_bpe_tokenizer

REF = RowRef("data.jsonl", 3)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's way with reasoning, cut down: only an assistant turn after the last user message shows it
THINK = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last and m.get('reasoning_content') %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    tok = train_bpe_tokenizer(make_corpus(), vocab_size=320, extra_special_tokens=("<|im_start|>", "<|im_end|>"))
    tok.chat_template, tok.eos_token = CHATML, "<|im_end|>"
    path = tmp_path_factory.mktemp("chatml")
    tok.save_pretrained(path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def first_batch(module):
    module.setup("fit")
    return module.collator([module.train_dataset[i] for i in range(len(module.train_dataset))])


def trained_text(module, batch, row=0):
    ids = batch["input_ids"][row][batch["response_mask"][row].bool()]
    return module.tokenizer.decode(ids)


# ------------------------------------------------------------------------------ full conversations
def test_string_prompt_beside_full_conversations_reads_the_prompt_from_them():
    """UltraFeedback-binarized: ``prompt`` the user's text, chosen/rejected [user, assistant] (TRL's
    maybe_extract_prompt). Before, the user turn was rendered a second time inside each response."""
    row = {
        "prompt": "is it good?",
        "chosen": [user("is it good?"), assistant("very good")],
        "rejected": [user("is it good?"), assistant("bad")],
    }
    parsed = parse_preference_row(row, "explicit", REF)
    assert (parsed.prompt, parsed.chosen, parsed.rejected) == (
        [user("is it good?")], [assistant("very good")], [assistant("bad")]
    )


def test_chat_prompt_repeated_by_the_conversations_is_cut_off_them():
    row = {"prompt": [user("hi")], "chosen": [user("hi"), assistant("a")], "rejected": [user("hi"), assistant("b")]}
    parsed = parse_preference_row(row, "explicit", REF)
    assert (parsed.prompt, parsed.chosen, parsed.rejected) == ([user("hi")], [assistant("a")], [assistant("b")])


def test_a_response_with_another_role_is_refused():
    row = {"prompt": [user("hi")], "chosen": [user("other"), assistant("a")], "rejected": [assistant("b")]}
    with pytest.raises(DataFormatError, match=r"row 3 .*field 'chosen\[0\].role': a response holds assistant"):
        parse_preference_row(row, "explicit", REF)


def test_ultrafeedback_rows_train_each_reply_once(tmp_path, chatml_dir):
    rows = [
        {"prompt": "the food?", "chosen": [user("the food?"), assistant("it was good")],
         "rejected": [user("the food?"), assistant("it was bad")]},
    ] * 2
    module = PreferenceDataModule(chatml_dir, write_jsonl(tmp_path / "uf.jsonl", rows), val_fraction=0, batch_size=2)
    batch = first_batch(module)
    text = module.tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert text == "<|im_start|>user\nthe food?<|im_end|>\n<|im_start|>assistant\nit was good<|im_end|>"
    assert trained_text(module, batch) == "it was good<|im_end|>"


# --------------------------------------------------------------------------------- multi-turn SFT
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    user("hi"),
    assistant("hello there"),
    user("the food?"),
    assistant("it was good"),
    user("and the staff?"),
    assistant("very friendly"),
]


def test_multi_turn_sft_trains_every_assistant_turn_and_no_user_turn(tmp_path, chatml_dir):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    module = SFTDataModule(chatml_dir, path, val_fraction=0, batch_size=2)
    batch = first_batch(module)
    tok = module.tokenizer
    full = tok.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert full == tok.apply_chat_template(CONVERSATION, tokenize=False).rstrip()
    mask, ids = batch["response_mask"][0].bool(), batch["input_ids"][0]
    # the trained tokens, run by run: each assistant reply with its end-of-turn token, nothing else
    runs, current = [], []
    for token, trained in zip(ids.tolist(), mask.tolist()):
        if trained:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs += [current] if current else []
    assert [tok.decode(r) for r in runs] == ["hello there<|im_end|>", "it was good<|im_end|>", "very friendly<|im_end|>"]
    assert (batch["labels"][0][~mask] == -100).all() and (batch["labels"][0][mask] == ids[mask]).all()


def test_multi_turn_sft_with_a_template_that_drops_earlier_reasoning(tmp_path, chatml_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatml_dir)
    tok.chat_template = THINK
    tok.save_pretrained(tmp_path / "think")
    messages = [user("hi"), assistant("hello", reasoning_content="greet"), user("food?"),
                assistant("good", reasoning_content="recall")]
    path = write_jsonl(tmp_path / "think.jsonl", [{"messages": messages}] * 2)
    module = SFTDataModule(str(tmp_path / "think"), path, val_fraction=0, batch_size=2)
    batch = first_batch(module)
    # the extra message key reaches the template (the last turn shows its reasoning), the earlier turn is
    # found by its content although the template renders it otherwise when it is last
    assert trained_text(module, batch) == "hello<|im_end|><think>recall</think>good<|im_end|>"


def test_multi_turn_sft_without_a_chat_template(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"messages": CONVERSATION[1:5]}] * 2)
    module = SFTDataModule(tokenizer_dir, path, val_fraction=0, batch_size=2)
    batch = first_batch(module)
    assert trained_text(module, batch) == " hello there it was good<|endoftext|>"


def test_prompt_and_messages_columns_read_the_messages():
    """ultrachat_200k: ``prompt``, ``prompt_id`` and ``messages``."""
    assert detect_sft_format(["messages", "prompt", "prompt_id"], "d") == "messages"
    with pytest.raises(DataFormatError, match="'prompt' with 'completion' or 'response'"):
        detect_sft_format(["prompt", "prompt_id"], "d")


# ------------------------------------------------------------------------------------ tokenisation
def test_sentencepiece_response_has_no_lone_word_marker(tmp_path):
    """Llama-2/Mistral tokenizers prepend "▁": a response tokenised alone started with a lone "▁" that
    generation after the prompt never writes. It is now the ids that follow the prompt's, tokenised together."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    bpe.train_from_iterator(make_corpus(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        tmp_path / "spm"
    )
    path = write_jsonl(tmp_path / "spm.jsonl", [{"prompt": "the food:", "completion": " was good"}] * 2)
    module = SFTDataModule(str(tmp_path / "spm"), path, val_fraction=0, batch_size=2)
    batch = first_batch(module)
    tok = module.tokenizer
    together = tok("the food: was good")["input_ids"] + [tok.eos_token_id]
    assert batch["input_ids"][0].tolist() == together
    assert tok.convert_ids_to_tokens(batch["input_ids"][0][batch["response_mask"][0].bool()])[0] == "▁was"


def test_a_truncated_prompt_keeps_the_bos_its_tokenizer_adds(tmp_path, tokenizer_dir):
    """A BOS-adding tokenizer (Llama, Mistral, Gemma): a prompt over max_prompt_length kept its last tokens
    and lost the BOS, so long prompts were generated from and trained on without it, short ones with it."""
    from tokenizers.processors import TemplateProcessing

    tok = load_tokenizer(tokenizer_dir)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save_pretrained(tmp_path / "bos")
    long = "the food was really good and the staff was very friendly and the room was clean"
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": long}, {"prompt": "we hated it"}])
    module = PromptDataModule(str(tmp_path / "bos"), path, max_prompt_length=8, val_fraction=0, batch_size=2)
    module.setup("fit")
    prompts = {len(ids): ids for ids in module.train_dataset["prompt_input_ids"]}
    full = tok(long)["input_ids"]
    assert len(full) > 8 and full[0] == bos
    assert prompts[8] == [bos, *full[-7:]]  # as a tokenizer truncating from the left cuts it
    assert all(ids[0] == bos for ids in prompts.values())


@pytest.mark.parametrize("strings_from", [1, 3])
def test_prompts_that_mix_chats_and_strings_are_refused_by_row(tmp_path, chat_tokenizer_dir, strings_from):
    """A chat prompt carries a conversational `prompt` column for reward functions, a string one none: a file
    mixing the two crashed inside pyarrow (in one map batch or across two), naming no row."""
    chat = {"prompt": [{"role": "user", "content": "the food was good"}]}
    rows = [chat] * strings_from + [{"prompt": "we hated it"}] * 2
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    module = PromptDataModule(chat_tokenizer_dir, path, val_fraction=0, batch_size=2)
    module.prepare_data_kwargs = None
    with pytest.raises(DataFormatError, match=rf"row {strings_from} \(0-based\), field 'prompt': the prompt is a"
                       r" string here and a chat \(a list of messages\) in row 0"):  # fmt: skip
        module.setup("fit")


def test_csv_with_a_byte_order_mark(tmp_path, tokenizer_dir):
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeffprompt,completion\nthe food, was good\nthe staff, was rude\n".encode())
    module = SFTDataModule(tokenizer_dir, str(path), val_fraction=0, batch_size=2)
    module.setup("fit")
    assert len(module.train_dataset) == 2


# ------------------------------------------------------------------------------------ held-out splits
def saved_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = lambda tag, n: [{"prompt": f"{tag} {i}", "completion": " good"} for i in range(n)]  # noqa: E731
    DatasetDict(train=Dataset.from_list(rows("the", 20)), test=Dataset.from_list(rows("food", 5))).save_to_disk(
        tmp_path / "dd"
    )
    return str(tmp_path / "dd")


def test_val_and_test_split_without_a_path_read_the_training_source(tmp_path, tokenizer_dir):
    module = SFTDataModule(tokenizer_dir, saved_dict(tmp_path), val_split="test", test_split="test", batch_size=2)
    module.setup("fit")
    module.setup("test")
    decode = module.tokenizer.decode
    assert len(module.train_dataset) == 20, "nothing carved from the training split"
    assert [decode(r) for r in module.val_dataset["prompt_input_ids"]] == [f"food {i}" for i in range(5)]
    assert len(module.test_dataset) == 5


def test_held_out_split_equal_to_the_training_split_is_refused(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="val_split='train' without val_path reads the training split"):
        SFTDataModule(tokenizer_dir, saved_dict(tmp_path), val_split="train")


# ------------------------------------------------------------------------------ chat prompts to rewards
@pytest.mark.parametrize("column", ["messages", "prompt"])
def test_chat_prompts_reach_the_reward_columns_as_message_lists(tmp_path, chatml_dir, column):
    """TRL-form reward functions take a conversational batch's prompts as message lists (TRL's format)."""
    from lit_rlhf.data import PromptDataModule

    chat = [user("the food?")]
    source = chat + [assistant("good")] if column == "messages" else chat  # a final assistant turn is dropped
    path = write_jsonl(tmp_path / "p.jsonl", [{column: source, "answer": "4"}] * 2)
    module = PromptDataModule(chatml_dir, path, batch_size=2)
    batch = first_batch(module)
    assert [[{"role": m["role"], "content": m["content"]} for m in p] for p in batch["columns"]["prompt"]] == [chat] * 2
    assert batch["columns"]["answer"] == ["4", "4"]


def test_string_prompts_are_not_passed_as_a_column(tmp_path, tokenizer_dir):
    from lit_rlhf.data import PromptDataModule

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the food", "answer": "4"}] * 2)
    batch = first_batch(PromptDataModule(tokenizer_dir, path, batch_size=2))
    assert batch["columns"] == {"answer": ["4", "4"]}
