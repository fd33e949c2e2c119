"""Data modules end to end: every format from every file type, chat templates, length policies, errors."""

from __future__ import annotations

import json
import logging

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lit_rlhf.data import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule

datasets.disable_progress_bars()

ITEMS = [
    ("the food was", "good", "bad"),
    ("the movie was", "great", "awful"),
    ("the staff were", "friendly", "rude"),
]
EOS = "<|endoftext|>"
FILE_TYPES = ["json", "jsonl", "parquet", "csv", "disk"]


def write_rows(rows: list[dict], folder, file_type: str) -> str:
    """Write rows as a json array, jsonl, parquet, csv (strings only) or a save_to_disk folder."""
    path = folder / ("data" if file_type == "disk" else f"data.{file_type}")
    if file_type == "json":
        path.write_text(json.dumps(rows))
    elif file_type == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif file_type == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif file_type == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def chat_text(prompt: str, responses: list[str], templated: bool) -> tuple[str, list[str]]:
    """Expected rendering of a one-turn chat: SIMPLE_CHAT_TEMPLATE, or the plain fallback."""
    if templated:
        return f"<|user|>{prompt}<|end|><|assistant|>", [f"{r}<|end|>" for r in responses]
    return f"User: {prompt}\n\nAssistant:", [f" {r}" for r in responses]


def verbatim(prompt: str, responses: list[str], templated: bool) -> tuple[str, list[str]]:
    return prompt, [f" {r}" for r in responses]


def hh(prompt: str, responses: list[str], templated: bool) -> tuple[str, list[str]]:
    return f"\n\nHuman: {prompt}\n\nAssistant:", [f" {r}" for r in responses]


# (module class, case name, row builder (p, c, r) -> row, expected texts, representable in csv)
CASES = [
    (PreferenceDataModule, "explicit-str", lambda p, c, r: {"prompt": p, "chosen": f" {c}", "rejected": f" {r}"}, verbatim, True),
    (PreferenceDataModule, "explicit-chat", lambda p, c, r: {"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]}, chat_text, False),
    (PreferenceDataModule, "implicit", lambda p, c, r: {"chosen": f"{p} {c}", "rejected": f"{p} {r}"}, verbatim, True),
    (PreferenceDataModule, "implicit-hh", lambda p, c, r: {"chosen": f"\n\nHuman: {p}\n\nAssistant: {c}", "rejected": f"\n\nHuman: {p}\n\nAssistant: {r}"}, hh, True),
    (PreferenceDataModule, "sharegpt", lambda p, c, r: {"conversations": [{"from": "human", "value": p}], "chosen": {"from": "gpt", "value": c}, "rejected": {"from": "gpt", "value": r}}, chat_text, False),
    (PromptDataModule, "prompt-str", lambda p, c, r: {"prompt": p}, verbatim, True),
    (PromptDataModule, "prompt-chat", lambda p, c, r: {"prompt": [user(p)]}, chat_text, False),
    (PromptDataModule, "messages", lambda p, c, r: {"messages": [user(p), assistant(c)]}, chat_text, False),
    (PromptDataModule, "conversations", lambda p, c, r: {"conversations": [{"from": "human", "value": p}]}, chat_text, False),
    (SFTDataModule, "prompt-completion", lambda p, c, r: {"prompt": p, "completion": f" {c}"}, verbatim, True),
    (SFTDataModule, "prompt-response", lambda p, c, r: {"prompt": p, "response": f" {c}"}, verbatim, True),
    (SFTDataModule, "messages", lambda p, c, r: {"messages": [user(p), assistant(c)]}, chat_text, False),
    (SFTDataModule, "conversations", lambda p, c, r: {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": c}]}, chat_text, False),
]  # fmt: skip
SLOTS = {PreferenceDataModule: ("chosen", "rejected"), PromptDataModule: (), SFTDataModule: ("completion",)}


def check_rows(dm, expected_fn, templated: bool) -> None:
    """Every stored row decodes to the expected prompt and responses (+ EOS), in file order."""
    slots = SLOTS[type(dm)]
    assert len(dm.train_dataset) == len(ITEMS)
    for row, (p, c, r) in zip(dm.train_dataset, ITEMS):
        prompt, responses = expected_fn(p, [c, r][: len(slots)], templated)
        assert dm.tokenizer.decode(row["prompt_input_ids"]) == prompt
        for slot, response in zip(slots, responses):
            assert dm.tokenizer.decode(row[f"{slot}_input_ids"]) == response + EOS


def make(cls, tokenizer_dir, path, tmp_path, **kwargs):
    return cls(tokenizer_dir, path, val_fraction=0.0, cache_dir=str(tmp_path / "cache"), **kwargs)


CASE_IDS = [f"{c[0].__name__.removesuffix('DataModule')}-{c[1]}" for c in CASES]
# csv cannot hold lists of chat messages: only the string formats are supported (and tested) there
FILE_CASES = [
    pytest.param(*case, file_type, id=f"{case_id}-{file_type}")
    for case, case_id in zip(CASES, CASE_IDS)
    for file_type in FILE_TYPES
    if file_type != "csv" or case[4]
]


@pytest.mark.parametrize("cls, name, build, expected, csv_ok, file_type", FILE_CASES)
def test_every_format_from_every_file_type(
    cls, name, build, expected, csv_ok, file_type, tokenizer_dir, tmp_path
):
    path = write_rows([build(*item) for item in ITEMS], tmp_path, file_type)
    dm = make(cls, tokenizer_dir, path, tmp_path)
    dm.setup("fit")
    check_rows(dm, expected, templated=False)


@pytest.mark.parametrize("cls, name, build, expected, csv_ok", CASES, ids=CASE_IDS)
def test_every_format_with_a_chat_template(cls, name, build, expected, csv_ok, chat_tokenizer_dir, tmp_path):
    # string rows stay verbatim; chats go through the tokenizer's template
    dm = make(
        cls, chat_tokenizer_dir, write_rows([build(*item) for item in ITEMS], tmp_path, "jsonl"), tmp_path
    )
    dm.setup("fit")
    check_rows(dm, expected, templated=True)


def test_forced_format_overrides_detection(tokenizer_dir, tmp_path):
    # rows with a prompt column read as implicit: the prompt column is ignored, the split recovers it
    rows = [{"prompt": "ignored", "chosen": f"{p} {c}", "rejected": f"{p} {r}"} for p, c, r in ITEMS]
    dm = make(
        PreferenceDataModule, tokenizer_dir, write_rows(rows, tmp_path, "jsonl"), tmp_path, format="implicit"
    )
    dm.setup()
    check_rows(dm, verbatim, templated=False)


def test_preference_batches(tokenizer_dir, tmp_path):
    rows = [
        {"prompt": p, "chosen": f" {c}", "rejected": f" {r}", "margin": i}
        for i, (p, c, r) in enumerate(ITEMS)
    ]
    dm = make(
        PreferenceDataModule, tokenizer_dir, write_rows(rows, tmp_path, "jsonl"), tmp_path, batch_size=2
    )
    dm.setup()
    batch = dm.collator([dm.train_dataset[i] for i in range(3)])
    tok = dm.tokenizer
    assert batch["input_ids"].shape[0] == 6 and batch["margin"].tolist() == [0.0, 1.0, 2.0]
    for i, (p, c, r) in enumerate(ITEMS):  # rows 0..2 chosen, 3..5 rejected of the same pairs
        for row, response in ((i, c), (i + 3, r)):
            ids, mask = batch["input_ids"][row], batch["attention_mask"][row].bool()
            assert tok.decode(ids[mask]) == f"{p} {response}{EOS}"
            assert tok.decode(ids[batch["response_mask"][row].bool()]) == f" {response}{EOS}"
            assert mask[: int(mask.sum())].all()  # right padding: real tokens first
    sizes = [b["input_ids"].shape[0] for b in dm.train_dataloader()]
    assert sizes == [4, 2]  # 3 pairs at batch_size 2 -> 2 + 1 pairs, doubled
    assert dm.val_dataloader() == []


def test_sft_labels_and_prompt_batches(tokenizer_dir, tmp_path):
    sft_rows = [{"prompt": p, "completion": f" {c}"} for p, c, _ in ITEMS]
    sft = make(SFTDataModule, tokenizer_dir, write_rows(sft_rows, tmp_path, "jsonl"), tmp_path, batch_size=3)
    sft.setup()
    batch = next(iter(sft.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "response_mask"}
    for labels in batch["labels"]:
        decoded = sft.tokenizer.decode(labels[labels != -100])
        assert decoded in {f" {c}{EOS}" for _, c, _ in ITEMS}  # only completion + EOS carries a label
    prompt_path = write_rows([{"prompt": p} for p, _, _ in ITEMS], tmp_path, "json")
    prompts = make(PromptDataModule, tokenizer_dir, prompt_path, tmp_path, batch_size=2)
    prompts.setup()
    batches = list(prompts.train_dataloader())
    assert len(batches) == 1  # drop_last: 3 prompts at batch_size 2 -> one full batch
    mask = batches[0]["attention_mask"]
    assert mask[:, -1].all() and set(batches[0]) == {"input_ids", "attention_mask"}  # left padding


def test_saved_dataset_dict_split(tokenizer_dir, tmp_path):
    rows = [{"prompt": p} for p, _, _ in ITEMS]
    ds = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    )
    ds.save_to_disk(str(tmp_path / "dd"))
    dm = PromptDataModule(
        tokenizer_dir, str(tmp_path / "dd"), val_path=str(tmp_path / "dd"), val_split="test"
    )
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (3, 1)
    with pytest.raises(DataFormatError, match="no split 'dev'"):
        PromptDataModule(tokenizer_dir, str(tmp_path / "dd"), split="dev").setup()


@pytest.mark.parametrize("file_type", ["jsonl", "parquet", "csv"])
def test_a_slice_of_a_local_file(file_type, tokenizer_dir, tmp_path):
    rows = [{"prompt": f"{p} {i}"} for i, (p, _, _) in enumerate(ITEMS * 4)]  # 12 distinct prompts
    path = write_rows(rows, tmp_path, file_type)
    dm = PromptDataModule(tokenizer_dir, path, split="train[:5]", val_path=path, val_split="train[-2:]")
    dm.setup()
    decoded = [dm.tokenizer.decode(r["prompt_input_ids"], skip_special_tokens=True) for r in dm.train_dataset]
    assert decoded == [r["prompt"] for r in rows[:5]]
    assert len(dm.val_dataset) == 2
    with pytest.raises(DataFormatError, match=r"data\.\w+.*cannot read the data.*test"):
        PromptDataModule(tokenizer_dir, path, split="test").setup()


# ----------------------------------------------------------------------------------------- length limits
@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_length_policies_and_counts(policy, tokenizer, tokenizer_dir, tmp_path):
    long_prompt = "the food was good and the movie was bad"
    long_answer = " we loved it and the staff were really very friendly"
    rows = [
        {"prompt": long_prompt, "chosen": " good", "rejected": " bad"},  # prompt over the limit
        {"prompt": "the", "chosen": long_answer, "rejected": " bad"},  # chosen over the limit
        {"prompt": "the", "chosen": " good", "rejected": " bad"},  # fits
    ]
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert len(ids(long_prompt)) > 4 and len(ids("the")) + len(ids(long_answer)) + 1 > 8
    records = logging.getLogger("lightning.pytorch")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    records.addHandler(handler)
    try:
        path = write_rows(rows, tmp_path, "jsonl")
        limits = dict(max_prompt_length=4, max_length=8, length_policy=policy)
        dm = make(PreferenceDataModule, tokenizer_dir, path, tmp_path, **limits)
        dm.setup()
    finally:
        records.removeHandler(handler)
    over = 2
    assert dm.stats["train"] == {
        "rows": 3,
        "truncated": over * (policy == "truncate"),
        "dropped": over * (policy == "drop"),
        "identical": 0,
    }
    assert any(
        f"{over * (policy == 'truncate')} truncated, {over * (policy == 'drop')} dropped" in m for m in seen
    )
    eos = tokenizer.eos_token_id
    if policy == "drop":
        assert len(dm.train_dataset) == 1 and dm.train_dataset[0]["chosen_input_ids"] == [*ids(" good"), eos]
        return
    first, second = dm.train_dataset[0], dm.train_dataset[1]
    assert first["prompt_input_ids"] == ids(long_prompt)[-4:]  # the END of the prompt is kept
    budget = 8 - len(ids("the"))
    assert second["chosen_input_ids"] == ids(long_answer)[:budget]  # the START of the response, no EOS
    assert second["rejected_input_ids"] == [*ids(" bad"), eos]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_pairs_identical_after_truncation_are_dropped_and_counted(policy, tokenizer, tokenizer_dir, tmp_path):
    # chosen and rejected differ only past max_length: once cut they are the same tokens (zero gradient)
    long_answer = " we loved it and the staff were really very friendly"
    rows = [
        {"prompt": "the", "chosen": long_answer + " good", "rejected": long_answer + " bad"},
        {"prompt": "the", "chosen": " good", "rejected": " bad"},
        {"prompt": "the", "chosen": long_answer + " and clean", "rejected": " bad"},  # cut, still different
    ]
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        path = write_rows(rows, tmp_path, "jsonl")
        dm = make(PreferenceDataModule, tokenizer_dir, path, tmp_path, max_prompt_length=4, max_length=8,
                  length_policy=policy)  # fmt: skip
        dm.setup()
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if policy == "drop":  # over-length rows go first: nothing is left to be identical
        assert dm.stats["train"] == {"rows": 3, "truncated": 0, "dropped": 2, "identical": 0}
        assert len(dm.train_dataset) == 1
        return
    assert dm.stats["train"] == {"rows": 3, "truncated": 2, "dropped": 0, "identical": 1}
    assert any("2 truncated, 0 dropped; 1 dropped as identical after truncation" in m for m in seen), seen
    assert len(dm.train_dataset) == 2
    kept = [(r["chosen_input_ids"], r["rejected_input_ids"]) for r in dm.train_dataset]
    assert all(chosen != rejected for chosen, rejected in kept)
    assert kept[0][0] == [*ids(" good"), dm.tokenizer.eos_token_id]
    assert list(dm.train_dataset["row_index"]) == [0, 1], "row_index numbers the kept pairs"


def test_all_pairs_identical_after_truncation_is_an_error(tokenizer_dir, tmp_path):
    long_answer = " we loved it and the staff were really very friendly"
    path = write_rows([{"prompt": "the", "chosen": long_answer + " good", "rejected": long_answer + " bad"}],
                      tmp_path, "jsonl")  # fmt: skip
    with pytest.raises(DataFormatError, match="all 1 rows .* identical after truncation"):
        make(PreferenceDataModule, tokenizer_dir, path, tmp_path, max_prompt_length=4, max_length=8).setup()


def test_all_rows_dropped_is_an_error(tokenizer_dir, tmp_path):
    path = write_rows([{"prompt": "the food was good and bad"}], tmp_path, "jsonl")
    with pytest.raises(DataFormatError, match="all 1 rows"):
        make(
            PromptDataModule, tokenizer_dir, path, tmp_path, max_prompt_length=1, length_policy="drop"
        ).setup()


@pytest.mark.parametrize(
    ("cls", "row", "example"),
    [
        (PromptDataModule, {"prompt": "the food"}, "prompts_test.jsonl"),
        (SFTDataModule, {"prompt": "the food", "completion": " was good"}, "sft_test.jsonl"),
        (PreferenceDataModule, {"prompt": "the food", "chosen": " good", "rejected": " bad"}, "prefs_test.jsonl"),
    ],
)
def test_testing_without_a_test_split_names_test_path_with_a_file_of_its_rows(cls, row, example, tokenizer_dir, tmp_path):
    data = make(cls, tokenizer_dir, write_rows([row] * 4, tmp_path, "jsonl"), tmp_path)
    data.setup("test")
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: testing needs held-out rows: set `test_path`.*{example}"):
        data.test_dataloader()


# ------------------------------------------------------------------------------------------- bad input
GOOD = {"prompt": "the food", "chosen": " good", "rejected": " bad"}
BAD_ROWS = [
    ("missing column", {"prompt": "the food", "chosen": " good"}, "rejected", "missing"),
    ("wrong type", {**GOOD, "chosen": 5}, "chosen", "got int"),
    ("empty prompt", {**GOOD, "prompt": " "}, "prompt", "empty text"),
    ("empty response", {**GOOD, "rejected": ""}, "rejected", "empty text"),
    (
        "non-string content",
        {**GOOD, "prompt": [{"role": "user", "content": 3}]},
        "prompt[0].content",
        "got int",
    ),
    (
        "unknown role",
        {**GOOD, "prompt": [{"role": "robot", "content": "hi"}]},
        "prompt[0].role",
        "unknown role",
    ),
]


@pytest.mark.parametrize("kind, bad, field, problem", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_names_file_row_and_field(kind, bad, field, problem, tokenizer_dir, tmp_path):
    path = write_rows([GOOD, GOOD, bad, GOOD], tmp_path, "jsonl")
    dm = make(PreferenceDataModule, tokenizer_dir, path, tmp_path)
    with pytest.raises(DataFormatError, match=problem) as err:
        dm.setup("fit")
    assert str(err.value).startswith(f"{path}, row 2 (0-based), field '{field}': ")
    assert (err.value.source, err.value.row, err.value.field) == (path, 2, field)


def test_column_missing_from_every_row(tokenizer_dir, tmp_path):
    path = write_rows([{"prompt": "the", "chosen": " a"}] * 2, tmp_path, "csv")
    with pytest.raises(DataFormatError, match=r"row 0 \(0-based\), field 'rejected': missing column") as err:
        make(PreferenceDataModule, tokenizer_dir, path, tmp_path).setup()
    assert str(err.value).startswith(path)


def test_bad_row_after_the_first_map_batch_keeps_its_number(tokenizer_dir, tmp_path):
    rows = [{"prompt": "the"}] * 1200
    rows[1103] = {"prompt": ""}
    path = write_rows(rows, tmp_path, "parquet")
    with pytest.raises(DataFormatError, match=r"row 1103 \(0-based\), field 'prompt': empty"):
        make(PromptDataModule, tokenizer_dir, path, tmp_path).setup()


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("data.json", "{not json", "cannot read the data"),
        ("data.parquet", "not parquet", "cannot read the data"),
        ("absent.jsonl", None, "file not found"),
        ("data.txt", "prompt", "unknown file type '.txt'"),
    ],
)
def test_unreadable_or_missing_file(name, content, problem, tokenizer_dir, tmp_path):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataFormatError, match=problem) as err:
        make(PromptDataModule, tokenizer_dir, str(path), tmp_path).setup()
    assert str(err.value).startswith(str(path))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"max_length": 8, "max_prompt_length": 8}, "max_length"),
        ({"max_length": 32}, r"max_length must be > max_prompt_length \(256: lower it too\), got 32"),
        ({"length_policy": "cut"}, "length_policy"),
        ({"batch_size": 0}, "batch_size"),
        ({"format": "hh"}, "format"),
        ({"train_path": ""}, "train_path must be a non-empty path or name, got ''"),
        ({"val_path": " "}, "val_path must be None or a non-empty path"),
        ({"test_path": ""}, "test_path must be None or a non-empty path"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, name, tokenizer_dir):
    kwargs = {"train_path": "never-read.jsonl", **kwargs}
    with pytest.raises(ValueError, match=name):
        PreferenceDataModule(tokenizer_dir, **kwargs)


# ------------------------------------------------------------------------------------------ splitting
def test_validation_carving_is_seeded_and_disjoint(tokenizer_dir, tmp_path):
    path = write_rows([{"prompt": f"row {i}"} for i in range(40)], tmp_path, "jsonl")

    def split(seed):
        dm = PromptDataModule(
            tokenizer_dir, path, val_fraction=0.25, seed=seed, cache_dir=str(tmp_path / "c")
        )
        dm.setup()
        decode = lambda ds: {dm.tokenizer.decode(r["prompt_input_ids"]) for r in ds}  # noqa: E731
        return decode(dm.train_dataset), decode(dm.val_dataset)

    train, val = split(seed=0)
    assert len(val) == 10 and len(train) == 30  # round(40 * 0.25)
    assert not train & val and train | val == {f"row {i}" for i in range(40)}
    assert split(seed=0) == (train, val)
    assert split(seed=1)[1] != val


def test_val_path_is_used_instead_of_carving(tokenizer_dir, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "v").mkdir()
    train = write_rows([{"prompt": p} for p, _, _ in ITEMS], tmp_path / "t", "jsonl")
    val = write_rows([{"prompt": "the movie"}], tmp_path / "v", "csv")
    dm = PromptDataModule(tokenizer_dir, train, val_path=val, val_fraction=0.5)  # val_path wins
    dm.setup()
    assert (
        len(dm.train_dataset) == 3
        and dm.tokenizer.decode(dm.val_dataset[0]["prompt_input_ids"]) == "the movie"
    )
    assert set(dm.stats) == {"train", "val"}


def test_chat_template_failure_names_the_row(tokenizer, tmp_path):
    # a template that rejects system messages, as some model templates do
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    tokenizer.save_pretrained(tmp_path / "tok")
    rows = [
        {"messages": [user("the food")]},
        {"messages": [{"role": "system", "content": "be nice"}, user("a")]},
    ]
    path = write_rows(rows, tmp_path, "jsonl")
    with pytest.raises(
        DataFormatError, match=r"row 1 \(0-based\): the tokenizer's chat template failed: no system"
    ):
        make(PromptDataModule, str(tmp_path / "tok"), path, tmp_path).setup()


def test_too_few_prompts_for_one_batch(tokenizer_dir, tmp_path):
    dm = make(
        PromptDataModule, tokenizer_dir, write_rows([{"prompt": "the"}] * 3, tmp_path, "jsonl"), tmp_path
    )
    dm.setup()  # batch_size 8 > 3 rows, and drop_last would leave no batch
    with pytest.raises(ValueError, match="fewer than batch_size=8"):
        dm.train_dataloader()


def test_cli_can_read_the_signatures():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(PreferenceDataModule, "data")
    cfg = parser.parse_args(["--data.tokenizer=t", "--data.train_path=x.jsonl", "--data.format=implicit"])
    assert cfg.data.format == "implicit" and cfg.data.max_length == 512
    with pytest.raises(SystemExit):
        parser.parse_args(["--data.tokenizer=t", "--data.train_path=x.jsonl", "--data.length_policy=cut"])
    assert "prompt + response" in parser.format_help()  # the one-line docs reach --help


def test_training_modules_import_datasets_only_when_a_source_is_read(tokenizer_dir, tmp_path):
    """``datasets`` (with pyarrow and pandas, ~100 MB resident) is imported by ``load_source``, not by
    ``import lit_rlhf.modules`` (the modules use the data package's batch contract only)."""
    import subprocess
    import sys

    path = write_rows([{"prompt": "the food was"}], tmp_path, "jsonl")
    code = (
        "import sys, lit_rlhf.modules, lit_rlhf.data\n"
        "from lit_rlhf.data.base import resolve_seed\n"
        "print(sorted(m for m in ('datasets', 'pandas', 'pyarrow') if m in sys.modules))\n"
        "from lit_rlhf.data import load_source\n"
        f"print(len(load_source({path!r})), 'datasets' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "1 True"]


def test_csv_cells_are_read_as_the_text_written(tokenizer_dir, tmp_path):
    # pandas would read a column of numbers as numbers and "None" / "NA" as missing
    (tmp_path / "sft").mkdir()
    sft = tmp_path / "sft" / "data.csv"
    sft.write_text("prompt,completion\nWhat is 2+2?,4\nSay None,None\nSay NA,NA\n")
    data = make(SFTDataModule, tokenizer_dir, str(sft), tmp_path)
    data.setup("fit")
    assert len(data.train_dataset) == 3
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt,answer\nq1,4\nq2,0\nq3,NA\n")
    data = make(PromptDataModule, tokenizer_dir, str(prompts), tmp_path, batch_size=3)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert sorted(batch["columns"]["answer"]) == ["0", "4", "NA"]  # what a reward function compares with
    pairs = tmp_path / "pairs.csv"
    pairs.write_text('prompt,chosen,rejected,margin\nthe food, good, bad,0.5\nthe movie, great, awful,2\n')
    data = make(PreferenceDataModule, tokenizer_dir, str(pairs), tmp_path, batch_size=2)
    data.setup("fit")
    assert sorted(next(iter(data.train_dataloader()))["margin"].tolist()) == [0.5, 2.0]  # numbers where they must be


def test_a_saved_dataset_takes_a_slice_and_refuses_another_split(tokenizer_dir, tmp_path):
    path = write_rows([{"prompt": f"the food {i}", "completion": " was good"} for i in range(10)], tmp_path, "disk")
    data = make(SFTDataModule, tokenizer_dir, path, tmp_path, split="train[:4]")
    data.setup("fit")
    assert len(data.train_dataset) == 4
    with pytest.raises(DataFormatError, match=r"bad split 'test' for a local file or saved Dataset \('train' or a slice"):
        make(SFTDataModule, tokenizer_dir, path, tmp_path, split="test").setup("fit")


@pytest.fixture(scope="module")
def add_eos_tokenizer(tmp_path_factory):
    """A tokenizer that appends EOS to every encoding (Llama or Mistral saved with add_eos_token=True)."""
    from conftest import make_corpus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(make_corpus(), trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    path = tmp_path_factory.mktemp("add_eos_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("completion", [" very good", " very good</s>"])
def test_a_tokenizer_that_appends_eos_leaves_none_inside_the_row(add_eos_tokenizer, tmp_path, completion):
    """Before, its EOS ended every plain prompt (<s>prompt</s> response</s>): the model learnt to go on
    after an end of sequence; a response whose text ended in EOS got two."""
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "the food was", "completion": completion}) + "\n")
    dm = SFTDataModule(add_eos_tokenizer, str(path), val_fraction=0.0, max_length=32, max_prompt_length=16)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    eos = dm.tokenizer.eos_token_id
    assert ids[0] == dm.tokenizer.bos_token_id and ids.count(eos) == 1 and ids[-1] == eos, dm.tokenizer.decode(ids)


def test_a_tokenizer_that_appends_eos_does_not_end_prompts_with_it(add_eos_tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "the food was"}) + "\n")
    dm = PromptDataModule(add_eos_tokenizer, str(path), val_fraction=0.0, max_prompt_length=16, batch_size=1)
    dm.setup("fit")
    ids = next(iter(dm.train_dataloader()))["input_ids"][0].tolist()
    assert ids[-1] != dm.tokenizer.eos_token_id and dm.tokenizer.eos_token_id not in ids, dm.tokenizer.decode(ids)
