"""Generation time with the prompt prefilled once per group (``group_prefill="always"``) vs unshared.

G prompts of random lengths in [min-prompt, max-prompt] tokens (left-padded), K samples each, up to
``max-new-tokens`` new tokens, a random-init Llama (hidden 256, 4 layers, vocab 32,000 by default), float32.
The two paths alternate (on, off, off, on, ...) with the same seed per pair; each pair's responses are
checked to be identical. Prints medians, min-max spreads and the off/on speed-up per pair, of wall
and of CPU time (the process's: robust to other processes on a shared machine).

    PYTHONPATH=. .venv/bin/python scripts/bench/prefill_bench.py --threads 1 --repeats 5
    PYTHONPATH=. .venv/bin/python scripts/bench/prefill_bench.py --min-prompt 16 --max-prompt 16  # short
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from lit_rlhf.rollout import GenerationSettings, generate_responses

PAD, EOS = 0, 1


def build(args) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model and (G*K, P) left-padded prompts, each prompt's K copies contiguous."""
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=1024, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.groups,)).tolist()
    width = max(lengths)
    ids = torch.full((args.groups, width), PAD)
    mask = torch.zeros(args.groups, width, dtype=torch.long)
    for g, length in enumerate(lengths):
        ids[g, width - length :] = torch.randint(2, args.vocab, (length,))
        mask[g, width - length :] = 1
    print(f"prompt lengths {lengths} (padded to {width}), K={args.samples}, rows={args.groups * args.samples}")
    return model, ids.repeat_interleave(args.samples, 0), mask.repeat_interleave(args.samples, 0)


def timed(model, ids, mask, settings: GenerationSettings, seed: int):
    """(wall seconds, CPU seconds, outputs) of one generation."""
    torch.manual_seed(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    out = generate_responses(
        model, ids, mask, settings, eos_token_id=EOS, pad_token_id=PAD, group_size=settings.num_samples
    )
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of (on, off) runs after one warm-up pair")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, ids, mask = build(args)
    base = GenerationSettings(max_new_tokens=args.max_new_tokens, num_samples=args.samples)
    settings = {mode: GenerationSettings(**{**base.as_dict(), "group_prefill": mode}) for mode in ("always", "never")}
    times = {"always": [], "never": []}  # wall seconds
    cpu = {"always": [], "never": []}  # CPU seconds (robust to other processes on a shared machine)
    for repeat in range(args.repeats + 1):
        order = ("always", "never") if repeat % 2 == 0 else ("never", "always")
        outs = {}
        for mode in order:
            seconds, cpu_seconds, outs[mode] = timed(model, ids, mask, settings[mode], seed=args.seed + repeat)
            if repeat:  # the first pair warms up
                times[mode].append(seconds)
                cpu[mode].append(cpu_seconds)
        # ids, mask, truncated (the behaviour log-probs agree only up to float rounding)
        same = all(torch.equal(a, b) for a, b in zip(outs["always"][:3], outs["never"][:3]))
        if not same:
            raise SystemExit(f"repeat {repeat}: the shared prefill generated other responses than the unshared one")
    length = outs["always"].mask.sum(dim=1).float().mean().item()
    summary = {"mean_response_tokens": length, "args": vars(args)}
    print(f"mean response length {length:.1f} tokens; responses identical on vs off in every pair")
    for clock, values in (("wall", times), ("cpu", cpu)):
        ratios = [off / on for on, off in zip(values["always"], values["never"])]
        summary[clock] = {
            "on_s": statistics.median(values["always"]),
            "off_s": statistics.median(values["never"]),
            "on_spread_s": [min(values["always"]), max(values["always"])],
            "off_spread_s": [min(values["never"]), max(values["never"])],
            "speedup_median": statistics.median(ratios),
            "speedup_spread": [min(ratios), max(ratios)],
        }
        for mode, label in (("always", "shared prefill"), ("never", "unshared")):
            print(f"{clock:>4} {label:>15}: median {statistics.median(values[mode]):.3f} s  "
                  f"(min {min(values[mode]):.3f}, max {max(values[mode]):.3f})")  # fmt: skip
        print(f"{clock:>4} speed-up (unshared / shared): median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.repeats} pairs")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
