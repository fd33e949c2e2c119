"""Optimiser steps with the input embeddings' gradients dense per micro-batch vs accumulated row by row in place
(``lit_rlhf.models.embedding_grads``), alternating in one process.

One step is what the online update does for one minibatch: ``--micro-batches`` forwards and backwards of the
W1/W3 32,000-token actor (20.6M parameters; ``policy_forward``, the fused LM head) on rows of
``--rows`` x ``--length`` random tokens, the last ``--response`` of them scored, then gradient clipping and
fused AdamW, then ``zero_grad``. The two ways alternate step by step (dense, row-wise, row-wise, dense, ...)
after one warm-up pair, with the same rows in each pair; the gradients of each pair are checked equal to float
rounding before the step.

Prints the CPU model, medians [min-max] of the step seconds of each way and of the per-pair ratio.

    PYTHONPATH=. .venv/bin/python scripts/bench/embedding_grads_bench.py --assets /work/bench_assets --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import cpu_model  # noqa: E402
from workloads import assets_dir  # noqa: E402

from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, policy_forward  # noqa: E402
from lit_rlhf.models.embedding_grads import EmbeddingGradAccumulator  # noqa: E402
from lit_rlhf.modules.optim import AdamW  # noqa: E402


def step(actor, optimizer, batches, response: int, rowwise: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one optimiser step over ``batches``, and the embedding's gradient before the step."""
    start = time.perf_counter()
    with EmbeddingGradAccumulator([actor], enabled=rowwise):
        for ids in batches:
            logprobs, _, _ = policy_forward(actor, ids, torch.ones_like(ids), response, 1.0, entropy=False)
            (-logprobs.mean() / len(batches)).backward()
        before_clone = time.perf_counter()
        grad = actor.get_input_embeddings().weight.grad.clone()  # for the check, not timed
        after_clone = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    return (before_clone - start) + (end - after_clone), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", default="/work/bench_assets")
    parser.add_argument("--size", default="full")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8, help="timed pairs after one warm-up pair")
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--response", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = assets_dir(args.assets, args.size)
    actor = build_causal_lm(ModelSpec(name_or_path=str(folder / "actor")), load_tokenizer(str(folder / "tokenizer")))
    actor.train()
    vocab = actor.get_input_embeddings().weight.shape[0]
    # lr 0: the weights (and so every step's work) stay the same from step to step
    optimizer = AdamW(actor.parameters(), lr=0.0)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats + 1):
        gen = torch.Generator().manual_seed(repeat)
        batches = [torch.randint(2, vocab, (args.rows, args.length), generator=gen) for _ in range(args.micro_batches)]
        grads = {}
        for rowwise in (False, True) if repeat % 2 == 0 else (True, False):
            took, grads[rowwise] = step(actor, optimizer, batches, args.response, rowwise)
            if repeat:
                seconds[rowwise].append(took)
        torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-7)
    ratios = [d / r for d, r in zip(seconds[False], seconds[True])]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

    print(f"CPU: {cpu_model()}; threads {torch.get_num_threads()}; torch {torch.__version__}")
    print(
        f"actor {sum(p.numel() for p in actor.parameters()) / 1e6:.1f}M parameters, vocabulary {vocab}; "
        f"{args.micro_batches} micro-batches x {args.rows} rows x {args.length} tokens ({args.response} scored)"
    )
    print(f"optimiser step s, dense embedding gradients:   {spread(seconds[False])}")
    print(f"optimiser step s, row-wise in-place (default): {spread(seconds[True])}")
    print(f"dense / row-wise per pair: {spread(ratios)} over {args.repeats} pairs (same gradients in each pair)")


if __name__ == "__main__":
    main()
