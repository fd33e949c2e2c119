"""The prompt rows' other columns reach the reward functions: PromptDataModule and its collator keep them
(as read, not tensors), the online modules repeat them for the K responses of each prompt."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import tiny_critic_free

from lit_rlhf.data import PreferenceDataModule, PromptCollator, PromptDataModule
from lit_rlhf.data.collators import ROW_COLUMN_PREFIX

datasets.disable_progress_bars()

ROWS = [
    {"prompt": "the food was", "answer": "1/2", "level": 1, "tags": ["a", "b"], "over_length": "x"},
    {"prompt": "the movie was", "answer": "3", "level": 2, "tags": [], "over_length": "y"},
    {"prompt": "the staff were", "answer": "\\frac{1}{3}", "level": 3, "tags": ["c"], "over_length": "z"},
    {"prompt": "it was", "answer": "0.25", "level": 4, "tags": ["d"], "over_length": "w"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_collator_passes_the_kept_columns_through():
    rows = [{"prompt_input_ids": [5, 6], f"{ROW_COLUMN_PREFIX}answer": "1", f"{ROW_COLUMN_PREFIX}meta": {"k": 1}},
            {"prompt_input_ids": [7], f"{ROW_COLUMN_PREFIX}answer": "2", f"{ROW_COLUMN_PREFIX}meta": {"k": 2}}]  # fmt: skip
    batch = PromptCollator(0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6], [0, 7]]
    assert batch["columns"] == {"answer": ["1", "2"], "meta": [{"k": 1}, {"k": 2}]}
    assert set(PromptCollator(0)([{"prompt_input_ids": [1]}])) == {"input_ids", "attention_mask"}  # none: no key


def test_prompt_rows_keep_their_other_columns_in_order(tokenizer_dir, tmp_path):
    dm = PromptDataModule(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", ROWS), batch_size=4,
                          cache_dir=str(tmp_path / "cache"), seed=0)  # fmt: skip
    dm.setup()
    (batch,) = list(dm.train_dataloader())
    columns = batch["columns"]
    # a source column named like an encoded one ('over_length') is kept apart and passed on unchanged
    assert set(columns) == {"answer", "level", "tags", "over_length"} and "prompt" not in columns
    prompts = dm.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    by_prompt = {r["prompt"]: r for r in ROWS}
    for i, prompt in enumerate(prompts):  # shuffled order: every column follows its prompt
        row = by_prompt[prompt.strip()]
        assert [columns[k][i] for k in ("answer", "level", "tags", "over_length")] == [
            row["answer"], row["level"], row["tags"], row["over_length"]
        ]  # fmt: skip
    assert isinstance(columns["level"][0], int) and not isinstance(columns["answer"], torch.Tensor)


def test_carved_validation_rows_and_chat_prompts_keep_their_columns(tokenizer_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS * 2]
    dm = PromptDataModule(tokenizer_dir, write_jsonl(tmp_path / "chat.jsonl", rows), val_fraction=0.25,
                          batch_size=2, val_batch_size=2, cache_dir=str(tmp_path / "cache"), seed=0)  # fmt: skip
    dm.setup()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for batch in loader:
            assert set(batch["columns"]) == {"answer", "prompt"} and len(batch["columns"]["answer"]) == 2
            for text, answer in zip(dm.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True),
                                    batch["columns"]["answer"]):  # fmt: skip
                assert answer == next(r["answer"] for r in ROWS if r["prompt"] in text)


def test_preference_rows_are_unchanged(tokenizer_dir, tmp_path):
    rows = [{"prompt": "the food was", "chosen": " good", "rejected": " bad", "source": "x"}] * 2
    dm = PreferenceDataModule(tokenizer_dir, write_jsonl(tmp_path / "prefs.jsonl", rows), batch_size=2,
                              cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup()
    assert not any(c.startswith(ROW_COLUMN_PREFIX) for c in dm.train_dataset.column_names)
    assert "columns" not in next(iter(dm.train_dataloader()))


def test_the_rollout_repeats_each_prompts_columns_for_its_k_responses(tokenizer_dir):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), generation={"num_samples": 3})
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
             "columns": {"answer": ["1", "2"], "tags": [["a"], []]}}  # fmt: skip
    assert module.expand_columns(batch) == {"answer": ["1"] * 3 + ["2"] * 3, "tags": [["a"]] * 3 + [[]] * 3}
    assert module.expand_columns(batch, 1) == batch["columns"]
    assert module.expand_columns({"input_ids": batch["input_ids"]}) is None


@pytest.mark.parametrize("file_type", ["parquet", "disk"])
def test_columns_of_other_sources(file_type, tokenizer_dir, tmp_path):
    path = tmp_path / ("data" if file_type == "disk" else "data.parquet")
    data = datasets.Dataset.from_list(ROWS)
    data.save_to_disk(str(path)) if file_type == "disk" else data.to_parquet(str(path))
    dm = PromptDataModule(tokenizer_dir, str(path), batch_size=4, cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert sorted(next(iter(dm.train_dataloader()))["columns"]["level"]) == [1, 2, 3, 4]
