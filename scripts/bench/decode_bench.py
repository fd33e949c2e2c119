"""W1's generation against its limits: per-token decoding time of Hugging Face ``generate`` and of the lean
loop (``generation.decode_loop``, with and without ``generation.drop_finished``), against the matmul-bound
floor, the weight-streaming floor and the memory-read floor.

The W1 setting of ``grpo_bench.py``: the prebuilt 32,000-token actor (20.6M parameters), one prompt of
``grpo_prompts`` per rollout repeated K = 8 times, up to 64 new tokens at temperature 1, ``generate_responses``
as the online modules call it (group prefill "auto", sampler "auto" = inverse CDF, decoding head "auto" = the
oneDNN-packed LM head on x86-64, the transposed copy elsewhere). The three loops (:data:`LOOPS`) run in rotating
order with the same seed and prompt per round, after one warm-up round; each round's tokens and behaviour
log-probs are checked equal to ``generate``'s (the same head layout).

Per call: the prefill (until the end of the forwards of more than one token column) and the decoding steps
(the rest, over the forwards of one column: one per response token). Floors per decoding step, both from
figures measured in this run, one thread:

* matmul-bound (issue 28): ``2 x parameters x rows / peak``, all parameters (the input embedding included,
  as the issue counts them; the strict matmul count without it is printed too), the fp32 peak of
  ``matmul_peak.best_rate`` (1024^3 products);
* weight-streaming: the bytes of the matmul weights (layers and LM head, float32) over the rate at which
  ``x @ W`` streams weights that do not fit the cache (8 rows, (256, 32000) weights, 128 MiB of them in
  turn): at 8 rows a decoding step reads every weight once and does 8 multiply-adds per weight read, so on a
  CPU whose memory is slower than its FMAs this is the tighter bound;
* memory read: the same bytes over the rate at which one core reads weights that are not in cache with a
  plain reduction (``w.sum()``, the same 128 MiB in turn). Where this is well below the weight-streaming
  floor, the small-row product of the BLAS, not the memory, bounds the streaming (how it walks the
  weight, not how many bytes it reads).

Prints medians and min-max over the pairs of the per-step decoding milliseconds, % of each floor
(floor / measured), the prefill and whole-call seconds, the lean/generate ratio per pair, and the CPU model.

    PYTHONPATH=. .venv/bin/python scripts/bench/decode_bench.py --assets /work/bench_assets --threads 1
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import cpu_model  # noqa: E402
from matmul_peak import best_rate  # noqa: E402
from workloads import GRPO, MAX_NEW_TOKENS, load_w1_actor, w1_generation_args  # noqa: E402

from lit_rlhf.rollout import GenerationSettings, generate_responses  # noqa: E402

# the loops compared: generation settings of each (the lean loop with and without dropping finished rows)
LOOPS = {
    "generate": dict(decode_loop="generate"),
    "lean, every row": dict(decode_loop="lean", drop_finished="never"),
    "lean": dict(decode_loop="lean", drop_finished="always"),
}


def _read_rate(read, seconds: float = 1.0) -> float:
    """Bytes per second of the fastest ``read(w)`` over (256, 32000) float32 weights that are not in cache:
    4 x 32.8 MB taken in turn, more than a core's share of L3."""
    weights = [torch.randn(256, 32000) for _ in range(4)]
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for w in weights:
            start = time.perf_counter()
            read(w)
            best = min(best, time.perf_counter() - start)
    return weights[0].numel() * 4 / best


def streaming_rate(seconds: float = 1.0) -> float:
    """Bytes per second at which (8, 256) @ (256, 32000) products read weights that are not in cache."""
    x = torch.randn(8, 256)
    return _read_rate(lambda w: torch.matmul(x, w), seconds)


def read_rate(seconds: float = 1.0) -> float:
    """Bytes per second at which one core sums (256, 32000) float32 weights that are not in cache."""
    return _read_rate(torch.sum, seconds)


class Phases:
    """Wall time of a call's prefill (up to the end of its last multi-column forward) and its decoding
    steps (one-column forwards), from forward hooks on the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prefill_end, self.steps = 0.0, 0
        model.register_forward_hook(self._after, with_kwargs=True)

    def _after(self, module, args, kwargs, output) -> None:
        if kwargs["input_ids"].shape[1] > 1:
            self.prefill_end = time.perf_counter()
        else:
            self.steps += 1

    def timed(self, fn) -> tuple[float, float, int, object]:
        """(prefill s, decoding s, decoding steps, fn's result)."""
        self.prefill_end, self.steps = 0.0, 0
        start = time.perf_counter()
        out = fn()
        end = time.perf_counter()
        prefill_end = self.prefill_end or start
        return prefill_end - start, end - prefill_end, self.steps, out


def spread(values: list[float], fmt: str = ".3g") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> None:
    args = w1_generation_args(__doc__, repeats=6)
    tokenizer, actor, prompts = load_w1_actor(args.assets, args.size)
    K = GRPO["num_generations"]
    base = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS, temperature=GRPO["temperature"], num_samples=K)
    phases = Phases(actor.get_base_model() if hasattr(actor, "get_base_model") else actor)
    params = sum(p.numel() for p in actor.parameters())
    matmul_params = params - actor.get_input_embeddings().weight.numel()
    peak = best_rate(1024, torch.float32, 1.0)[0] * 1e9  # FLOP/s
    rate, read = streaming_rate(), read_rate()
    floors = {  # seconds per decoding step
        "matmul (all params)": 2 * params * K / peak,
        "matmul (no input embedding)": 2 * matmul_params * K / peak,
        "weight streaming": matmul_params * 4 / rate,
        "memory read": matmul_params * 4 / read,
    }
    figures = {loop: {"step_ms": [], "token_ms": [], "prefill_s": [], "call_s": [], "steps": []} for loop in LOOPS}
    names = list(LOOPS)
    for repeat in range(args.repeats + 1):
        ids = torch.tensor([prompts[repeat % len(prompts)]["ids"]] * K)  # (K, P), no padding
        outs = {}
        for loop in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotating order
            settings = replace(base, **LOOPS[loop])
            torch.manual_seed(repeat)
            call = partial(
                generate_responses, actor, ids, torch.ones_like(ids), settings, group_size=K,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            prefill, decode, steps, outs[loop] = phases.timed(call)
            if repeat:  # the first round warms up
                tokens = int(outs[loop].mask.sum())  # real response tokens (the group prefill's calls
                # draw every one after a one-column forward, which counts as a decoding step)
                for key, value in (("step_ms", 1e3 * decode / steps), ("token_ms", 1e3 * decode / tokens),
                                   ("prefill_s", prefill), ("call_s", prefill + decode),
                                   ("steps", steps)):  # fmt: skip
                    figures[loop][key].append(value)
        a = outs["generate"]
        for loop in names[1:]:
            b = outs[loop]
            if not (torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)):
                raise SystemExit(f"round {repeat}: {loop!r}'s tokens or log-probs differ from generate's")
    print(f"CPU: {cpu_model()}; threads {torch.get_num_threads()}; torch {torch.__version__}")
    print(f"actor {params / 1e6:.2f}M parameters ({matmul_params / 1e6:.2f}M in matmuls), {K} rows; fp32 peak "
          f"{peak / 1e9:.0f} GFLOP/s, weight streaming {rate / 1e9:.1f} GB/s, "
          f"memory read {read / 1e9:.1f} GB/s")  # fmt: skip
    for name, floor in floors.items():
        print(f"floor per decoding step, {name}: {1e3 * floor:.2f} ms")
    print(
        f"\nW1 generation, medians [min-max] over {args.repeats} rounds (same tokens and log-probs in each round)."
        f" A floor's share is floor / measured per decoding step ({K} rows); per real response token, the"
        f" floor of one row (floor / {K}) over the decoding time per token"
    )
    print(
        "| loop | decoding ms/step | ms/response token | "
        + " | ".join(f"% of {n} floor (step; token)" for n in floors)
        + " | prefill s | call s |"
    )
    print("|---" * (5 + len(floors)) + "|")
    for loop in LOOPS:
        f = figures[loop]
        shares = [
            spread([100 * 1e3 * floor / ms for ms in f["step_ms"]])
            + "; " + spread([100 * 1e3 * floor / K / ms for ms in f["token_ms"]])
            for floor in floors.values()
        ]  # fmt: skip
        print(f"| {loop} | {spread(f['step_ms'])} | {spread(f['token_ms'])} | " + " | ".join(shares)
              + f" | {spread(f['prefill_s'])} | {spread(f['call_s'])} |")  # fmt: skip
    for loop in names[1:]:
        ratio = [g / x for g, x in zip(figures["generate"]["step_ms"], figures[loop]["step_ms"])]
        calls = [g / x for g, x in zip(figures["generate"]["call_s"], figures[loop]["call_s"])]
        print(f"speed-up generate / {loop} per round: decoding step {spread(ratio)}, whole call {spread(calls)}")
    calls = [a / b for a, b in zip(figures["lean, every row"]["call_s"], figures["lean"]["call_s"])]
    print(f"speed-up of dropping finished rows per round (whole call): {spread(calls)}; decoding steps per"
          f" call {spread(figures['lean']['steps'])}")  # fmt: skip
    if args.json:
        summary = dict(cpu=cpu_model(), peak_gflops=peak / 1e9, streaming_gbs=rate / 1e9, read_gbs=read / 1e9,
                       floors_ms=floors, figures=figures, args=vars(args))  # fmt: skip
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
