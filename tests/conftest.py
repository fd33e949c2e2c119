"""Shared fixtures: a locally trained tokenizer and tiny model configs (nothing is downloaded)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

# CI (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples on every run, so its result does not depend
# on the draw; a run elsewhere explores new examples each time.
settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

WORDS = (
    "the a food service movie plot staff room was is were not very really quite good bad great "
    "awful fine okay tasty slow fast friendly rude clean dirty and but i we loved hated it"
).split()


def make_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Short pseudo-sentences over a fixed word list (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """Folder with a byte-level BPE tokenizer (no chat template), saved with save_pretrained."""
    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(make_corpus(), vocab_size=320).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> str:
    """Same as ``tokenizer_dir`` but with a simple role-tagged chat template."""
    from lit_rlhf.models.tokenizer import SIMPLE_CHAT_TEMPLATE, train_bpe_tokenizer

    path = tmp_path_factory.mktemp("chat_tok")
    train_bpe_tokenizer(make_corpus(), vocab_size=320, chat_template=SIMPLE_CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


@pytest.fixture
def tokenizer(tokenizer_dir):
    from lit_rlhf.models.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def gpt2_config(vocab_size: int = 322) -> dict:
    return dict(model_type="gpt2", vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=2)


def llama_config(vocab_size: int = 322) -> dict:
    return dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


@pytest.fixture(params=["gpt2", "llama"])
def tiny_config(request) -> dict:
    """Inline transformers config of a tiny GPT-2 or Llama model (random init)."""
    return gpt2_config() if request.param == "gpt2" else llama_config()


@pytest.fixture
def prompt_file(tmp_path) -> str:
    """A jsonl file of 40 short prompts."""
    import json

    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:
        for i, text in enumerate(make_corpus(40, seed=5)):
            f.write(json.dumps({"prompt": " ".join(text.split()[:3]) + f" {i % 7}"}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """scripts/make_tiny_data.py's tokenizer, SFT rows, preference pairs and prompts (160 rows)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("tiny_data_session")
    script = Path(__file__).resolve().parents[1] / "scripts/make_tiny_data.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--rows", "160"], check=True)
    return out
