"""Time of the no-grad rollout scoring forward (reference log-probs) by vocabulary and head chunk floor.

W1's scoring at the scaling sweep's vocabulary points: a random-init Llama with W1's body (hidden 256,
4 layers; ``workloads.SIZES["full"]``) and an untied head of ``--vocab`` tokens scores one prompt of 256
tokens and its K = 8 responses of 64 tokens without gradients, as ``RolloutScoring.reference_logprobs``
does: ``policy_forward`` on the padded (8, 320) rows and ``packed_token_scores`` on the shared-prompt layout.

Settings, alternating within one process (each repeat runs every setting once, in turn):

- ``floor1``: the head route with chunks of ``2**21 // V`` tokens (the rule before ``_MIN_CHUNK_TOKENS``),
- ``floor64``: the head route with at least 64 tokens per chunk (``lm_head._MIN_CHUNK_TOKENS``),
- ``off``: the full logits (``logits_chunking="off"``; what TRL computes), also the reference values.

Printed per setting and layout: the median and spread (min-max) of the forward's time and the largest
difference of the log-probs from ``off``'s. Time only: peak memory is not measured here.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/scoring_vocab.py --vocab 32000 128000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import cpu_model  # noqa: E402
from workloads import SIZES  # noqa: E402

SETTINGS = ("floor1", "floor64", "off")


def _model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, **SIZES["full"]["model"], max_position_embeddings=2048, tie_word_embeddings=False
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _rows(vocab: int, k: int, prompt: int, response: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [torch.randint(2, vocab, (1, prompt), generator=gen).expand(k, -1),
         torch.randint(2, vocab, (k, response), generator=gen)], 1,
    )  # fmt: skip
    mask = torch.ones_like(ids)
    prompt_mask, response_mask = mask.clone(), mask.clone()
    prompt_mask[:, prompt:], response_mask[:, :prompt] = 0, 0
    return ids, mask, prompt_mask, response_mask


def _point(vocab: int, args: argparse.Namespace) -> None:
    import torch

    from lit_rlhf.models import (
        lm_head,
        packed_token_scores,
        policy_forward,
        set_logits_chunking,
        shared_prefix_layout,
    )

    model = _model(vocab)
    T = args.response
    ids, mask, prompt_mask, response_mask = _rows(vocab, args.k, args.prompt, T)
    layout = shared_prefix_layout(model, "on", ids, prompt_mask, response_mask, 0, 0, response_width=T)
    runs = {
        "padded": lambda: policy_forward(model, ids, mask, T, 1.0, entropy=False)[0],
        "packed": lambda: packed_token_scores(model, layout)[0],
    }
    floor = lm_head._MIN_CHUNK_TOKENS
    times: dict[tuple[str, str], list[float]] = {}
    values: dict[tuple[str, str], torch.Tensor] = {}
    with torch.no_grad():
        for repeat in range(args.repeats + 1):  # the first round is a warm-up
            for setting in SETTINGS:
                set_logits_chunking(model, "off" if setting == "off" else "on")
                lm_head._MIN_CHUNK_TOKENS = 1 if setting == "floor1" else floor
                for name, run in runs.items():
                    start = time.perf_counter()
                    out = run()
                    if repeat:
                        times.setdefault((setting, name), []).append(time.perf_counter() - start)
                    values[(setting, name)] = out
    lm_head._MIN_CHUNK_TOKENS = floor
    print(f"V = {vocab}: {2**21 // vocab} tokens per chunk by 2**21 // V, {max(floor, 2**21 // vocab)} with the floor")
    for (setting, name), ts in times.items():
        diff = (values[(setting, name)] - values[("off", name)]).abs().max().item()
        print(
            f"  {name:6s} {setting:7s} median {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f})"
            f"  max |logp - off| {diff:.1e}"
        )


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; threads {torch.get_num_threads()}; torch {torch.__version__}; repeats {args.repeats}")
    for vocab in args.vocab:
        _point(vocab, args)


if __name__ == "__main__":
    main()
