"""The decoding LM head's two layouts, product against product: ``models.decoding.packed_linear`` (oneDNN's
blocked layout) and ``transposed_linear`` (an (in, out) copy for MKL), one thread, cold cache (256 MiB of
weights used in turn), at 1-64 rows and three head shapes (32,000 x 256: the W1 actor's; 50,257 x 768: GPT-2's;
151,936 x 896: Qwen2.5-0.5B's). Prints the median milliseconds of 9 alternating calls per point and the CPU.
With ``--assets`` (the folder of ``workloads.py ASSETS full``) also W1's decoding step with each layout: the
lean loop over all 8 rows (``drop_finished: never``, so both layouts run the same number of steps), 12 rounds
after a warm-up, the two layouts alternating with the same seed and prompt, per-step milliseconds of each and
the median [min-max] of the per-round ratio.

    PYTHONPATH=. .venv/bin/python scripts/bench/head_layout_bench.py [--assets ASSETS]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import cpu_model  # noqa: E402

from lit_rlhf.models.decoding import packed_linear, transposed_linear  # noqa: E402
from lit_rlhf.rollout import GenerationSettings, generate_responses  # noqa: E402

SHAPES = ((32000, 256), (50257, 768), (151936, 896))  # (V, H) of the head
ROWS = (1, 2, 4, 8, 16, 64)
CALLS = 9
COLD_BYTES = 256 << 20  # weights cycled through per point, well beyond the last-level cache


def products() -> None:
    print(f"CPU: {cpu_model()} ({platform.machine()}); threads 1; torch {torch.__version__}")
    for vocab, hidden in SHAPES:
        copies = max(1, COLD_BYTES // (vocab * hidden * 4))
        weights = [torch.randn(vocab, hidden) for _ in range(copies)]
        by_layout = {
            "packed": [packed_linear(w) for w in weights],
            "transposed": [transposed_linear(w) for w in weights],
        }
        for rows in ROWS:
            x = torch.randn(rows, hidden)  # (rows, H)
            times: dict[str, list[float]] = {layout: [] for layout in by_layout}
            for call in range(CALLS):
                for layout, each in by_layout.items():
                    start = time.perf_counter()
                    each[call % copies](x)  # (rows, V)
                    times[layout].append(time.perf_counter() - start)
            ms = {layout: 1e3 * statistics.median(t) for layout, t in times.items()}
            print(
                f"{vocab} x {hidden}, {rows} rows: packed {ms['packed']:.2f} ms, transposed "
                f"{ms['transposed']:.2f} ms, transposed / packed {ms['transposed'] / ms['packed']:.2f}",
                flush=True,
            )
        del weights, by_layout


def w1_steps(assets: str, rounds: int = 12) -> None:
    """W1's decoding step with each layout (see the module docstring); its harness is decode_bench's."""
    from decode_bench import Phases
    from workloads import GRPO, MAX_NEW_TOKENS, load_w1_actor

    tokenizer, actor, prompts = load_w1_actor(assets, "full")
    K = GRPO["num_generations"]
    base = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS, temperature=GRPO["temperature"], num_samples=K,
                              decode_loop="lean", drop_finished="never")  # fmt: skip
    phases, layouts = Phases(actor), ("packed", "transposed")
    step_ms: dict[str, list[float]] = {layout: [] for layout in layouts}
    for round_ in range(rounds + 1):
        ids = torch.tensor([prompts[round_ % len(prompts)]["ids"]] * K)  # (K, P)
        for layout in layouts if round_ % 2 else layouts[::-1]:
            torch.manual_seed(round_)
            call = partial(
                generate_responses, actor, ids, torch.ones_like(ids), replace(base, decoding_head=layout),
                group_size=K, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            _, decode, steps, _ = phases.timed(call)
            if round_:  # the first round warms up
                step_ms[layout].append(1e3 * decode / steps)
    ratios = [t / p for p, t in zip(step_ms["packed"], step_ms["transposed"])]
    print(
        f"W1 lean loop, 8 rows, ms per decoding step: packed {statistics.median(step_ms['packed']):.2f}, "
        f"transposed {statistics.median(step_ms['transposed']):.2f}; transposed / packed per round "
        f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", help="the benchmark assets (workloads.py ASSETS full): adds W1's steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    products()
    if args.assets:
        w1_steps(args.assets)


if __name__ == "__main__":
    main()
