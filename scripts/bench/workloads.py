"""The realistic workloads of issue 16 (W1 group RL, W2 pairs, W3 PPO): settings, data and assets.

Pure parts (settings, the word lexicon, length-distributed rows) import nothing heavy; the asset
builder (:func:`build_workload_assets`) needs torch, transformers and lit_rlhf's tokenizer trainer and
runs in a subprocess of the driver. This module must import in both environments (like common.py).

Text is a synthetic language of syllable words. A byte-level BPE trained on 43k distinct words reaches
exactly 32,000 tokens (no padding with added tokens), and each word of a text starts with a space, so
the BPE pre-tokenizer splits texts at words: ``ids(text) = concat(ids(word) for word in text)``, and
``ids(prompt + response) = ids(prompt) + ids(response)``. Both libraries therefore see the same token
ids whether they get ids (lit_rlhf, TRL's RewardTrainer) or text (TRL's GRPOTrainer and DPOTrainer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_32K = 32000
WORKLOADS = ("W1_grpo", "W2_rm", "W2_dpo", "W3_ppo", "control_ppo", "control_rm")
# Token-length ranges (inclusive) of the issue; responses of W1/W3 are sampled and stop at EOS.
LENGTHS = dict(
    grpo_prompt=(64, 256),
    ppo_prompt=(16, 256),
    pair_prompt=(64, 512),
    pair_response=(16, 128),  # EOS included
)
MAX_NEW_TOKENS = 64  # W1 and W3 response limit
EOS_RATE = 1 / 32  # per-token EOS probability the actor is calibrated to (mean response ~27 tokens)

# Settings shared by both libraries (loss settings are the same on both sides; see the bench scripts).
GRPO = dict(num_generations=8, temperature=1.0, beta=0.04, clip=0.2, lr=1e-6, max_grad_norm=1.0)
PPO32K = dict(
    temperature=1.0, ppo_epochs=2, num_minibatches=2, lr=3e-6, kl_coef=0.05, clip_coef=0.2,
    clip_coef_value=0.2, vf_coef=0.1, gamma=1.0, gae_lambda=0.95,
)  # fmt: skip
PAIRS = dict(lr=1e-5, beta=0.1, max_grad_norm=1.0)

# Size presets: the model and how much work one run does. "full" is what run.sh measures (the whole
# run.sh --threads 1 --repeats 3 in ~20-25 min on a 2-core CPU); "smoke" proves the harness end to end
# in under a minute per workload (a tiny model, the same vocabulary and length distributions).
SIZES = {
    "full": dict(
        model=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
        grpo_groups=1,  # prompts per rollout (x K = 8 rows)
        grpo_rollouts=4,  # the first one a warm-up
        ppo_batch=8,  # prompts per rollout
        ppo_rollouts=3,
        rm_pairs_per_step=4,
        rm_steps=8,  # timed steps, after one warm-up step
        dpo_pairs_per_step=2,
        dpo_steps=5,
        control_rollouts=4,  # control PPO (common.PPO), the first one a warm-up
        # control reward model, after 5 warm-up steps: ~18 ms each, so 300 (~5 s) for a ratio that is
        # not noise (60 gave 0.96-1.40 within one run)
        control_rm_steps=300,
    ),
    "smoke": dict(
        model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2),
        grpo_groups=1,
        grpo_rollouts=2,
        ppo_batch=4,
        ppo_rollouts=2,
        rm_pairs_per_step=2,
        rm_steps=2,
        dpo_pairs_per_step=2,
        dpo_steps=1,
        control_rollouts=2,
        control_rm_steps=10,
    ),
}
N_ROWS = 64  # rows of each kind in data.json (more than any size preset uses)

_SYLLABLES = "ka lo mi ne ru ta shi po an el or us ix be do fa gu he ji ko la mo nu pa qi ra se ti vu wo ya ze"


def lexicon(seed: int = 0) -> list[str]:
    """~43k distinct words of 2-5 syllables: enough for a 32,000-token byte-level BPE."""
    rng = random.Random(seed)
    syllables = _SYLLABLES.split()
    return sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))) for _ in range(60000)})


def training_texts(words: list[str]) -> list[str]:
    """The BPE training corpus: every word twice, 50 words a line, each word after a space."""
    lines = [" " + " ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    return lines * 2


def sample_text(
    rng: random.Random, words: list[str], word_ids: dict[str, list[int]], lo: int, hi: int
) -> tuple[str, list[int]]:
    """A text of lo..hi tokens (a target drawn uniformly, then whole words): (text, token ids).

    Every word is one or two tokens, so the result lands within [lo, hi] (the word that would pass
    ``hi`` is left out).
    """
    target = rng.randint(lo, hi)
    text, ids = [], []
    while len(ids) < target:
        word = rng.choice(words)
        if len(ids) + len(word_ids[word]) > hi:
            continue
        text.append(" " + word)
        ids += word_ids[word]
    return "".join(text), ids


def workload_rows(words: list[str], word_ids: dict[str, list[int]], eos: int, n: int = N_ROWS) -> dict:
    """Prompts of W1 and W3, and the pairs of W2 (text and ids; responses end with ``eos`` in ids only)."""
    rng = random.Random(1)

    def text(kind: str) -> dict:
        t, ids = sample_text(rng, words, word_ids, *LENGTHS[kind])
        return dict(text=t, ids=ids)

    pairs = []
    for _ in range(n):
        prompt, chosen, rejected = text("pair_prompt"), text("pair_response"), text("pair_response")
        for response in (chosen, rejected):  # the EOS counts against the 16-128 range
            while len(response["ids"]) >= LENGTHS["pair_response"][1]:
                response.update(text("pair_response"))
            response["ids"] = response["ids"] + [eos]
        pairs.append(dict(prompt=prompt, chosen=chosen, rejected=rejected))
    return dict(
        grpo_prompts=[text("grpo_prompt") for _ in range(n)],
        ppo_prompts=[text("ppo_prompt") for _ in range(n)],
        pairs=pairs,
    )


def bench_reward(prompts, completions, **kwargs) -> list[float]:
    """The W1 reward, a cheap function of the completion text that both libraries call.

    lit_rlhf calls ``fn(prompts, responses)``; TRL's GRPOTrainer ``fn(prompts=..., completions=..., ...)``.
    """
    return [text.count("a") / (1.0 + len(text)) for text in completions]


def assets_dir(folder: Path, size: str) -> Path:
    return Path(folder) / f"v32k_{size}"


def build_workload_assets(folder: Path, size: str) -> None:
    """The 32k tokenizer, the Llama actor (EOS-calibrated) and sequence classifier, and data.json.

    The actor is random-init, so at a 32,000-token vocabulary it would almost never sample EOS. Two
    weight edits give every position the same EOS probability ``EOS_RATE`` (geometric response
    lengths, truncated at ``MAX_NEW_TOKENS``) for both libraries alike, see :func:`calibrate_eos`.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    from transformers.utils import logging as hf_logging

    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    hf_logging.disable_progress_bar()
    out = assets_dir(folder, size)
    words = lexicon()
    tokenizer = train_bpe_tokenizer(training_texts(words), vocab_size=VOCAB_32K)
    assert len(tokenizer) == VOCAB_32K, f"tokenizer has {len(tokenizer)} tokens, expected {VOCAB_32K}"
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    word_ids = dict(zip(words, tokenizer([" " + w for w in words])["input_ids"]))
    rows = workload_rows(words, word_ids, eos)
    for row in rows["pairs"][:4]:  # ids of concatenated text = concatenated ids (see module docstring)
        text = row["prompt"]["text"] + row["chosen"]["text"] + tokenizer.eos_token
        assert tokenizer(text)["input_ids"] == row["prompt"]["ids"] + row["chosen"]["ids"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(rows))
    special = dict(pad_token_id=pad, eos_token_id=eos, bos_token_id=eos, vocab_size=VOCAB_32K)
    fields = dict(**SIZES[size]["model"], max_position_embeddings=1024, tie_word_embeddings=False, **special)
    torch.manual_seed(0)
    actor = LlamaForCausalLM(LlamaConfig(**fields))
    calibrate_eos(actor, eos, [row["ids"] for row in rows["grpo_prompts"][:8]])
    actor.generation_config = GenerationConfig(suppress_tokens=[pad], **special)
    torch.manual_seed(1)
    reward = LlamaForSequenceClassification(LlamaConfig(**fields, num_labels=1))
    for name, model in (("actor", actor), ("reward", reward)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    tokenizer.save_pretrained(out / "tokenizer")


def calibrate_eos(actor, eos: int, prompts: list[list[int]]) -> float:
    """Edit ``actor`` so that EOS has probability ~``EOS_RATE`` at every position; returns the mean rate.

    Hidden dimension 0 of the residual stream is made a constant: every token embedding holds 0.3 there
    and no attention or MLP output writes to it, so the final RMSNorm output carries a near-constant
    positive value there (1.50 +- 0.02 at hidden 256). The LM head reads dimension 0 for EOS only,
    scaled so that EOS gets ``EOS_RATE`` of the probability mass on ``prompts``.
    """
    import math

    import torch

    emb, head = actor.get_input_embeddings().weight, actor.get_output_embeddings().weight  # (V, H) each
    with torch.no_grad():
        for layer in actor.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        emb[:, 0] = 0.3
        head[:, 0] = 0.0
        head[eos] = 0.0
        hidden = torch.cat([actor.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])  # (N, H)
        others = torch.logsumexp(hidden @ head.T, dim=-1)  # (N,) EOS logit 0 included: a 1/V error
        target = math.log(EOS_RATE / (1 - EOS_RATE)) + others.mean()
        head[eos, 0] = target / hidden[:, 0].mean()
        rate = torch.softmax(hidden @ head.T, dim=-1)[:, eos].mean().item()
    assert abs(rate - EOS_RATE) < 0.2 * EOS_RATE, f"EOS calibration failed: rate {rate:.4f}"
    return rate


def load_rows(folder: Path, size: str) -> dict:
    return json.loads((assets_dir(folder, size) / "data.json").read_text())


def w1_generation_args(doc: str, repeats: int):
    """The command line of the W1 generation benchmarks (``--assets``, ``--size``, ``--repeats``, ``--threads``,
    ``--json``), parsed, with torch set to ``--threads``."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", default="/work/bench_assets")
    parser.add_argument("--size", default="full")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed pairs after one warm-up pair")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def load_w1_actor(folder: Path, size: str):
    """W1's prebuilt actor in eval mode, its tokenizer and the GRPO prompts (the lit_rlhf side of the
    generation benchmarks: ``decode_bench.py``, ``sampler_bench.py``)."""
    from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer

    assets = assets_dir(folder, size)
    tokenizer = load_tokenizer(str(assets / "tokenizer"))
    actor = build_causal_lm(ModelSpec(name_or_path=str(assets / "actor")), tokenizer).eval()
    return tokenizer, actor, load_rows(folder, size)["grpo_prompts"]


if __name__ == "__main__":
    # python scripts/bench/workloads.py DIR SIZE: build the 32k-vocabulary assets once
    import sys

    build_workload_assets(Path(sys.argv[1]), sys.argv[2])
