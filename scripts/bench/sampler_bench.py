"""Generation time of one W1 rollout with each token sampler (``GenerationSettings.sampler``).

The W1 setting of ``grpo_bench.py``: the prebuilt 32,000-token actor, one prompt of ``grpo_prompts`` per
rollout repeated K = 8 times, up to 64 new tokens at temperature 1, ``generate_responses`` as the online
modules call it (group prefill "auto"). The samplers alternate (inverse_cdf, multinomial, multinomial,
inverse_cdf, ...) with the same seed and prompt per pair, after one warm-up pair. Prints medians and
min-max spreads of CPU time (the process's: robust to other processes on a shared machine) and of wall
time per rollout, the per-pair speed-up, the mean response length and decoding steps of each sampler
(the same distribution, so close but not equal: the draws differ) and CPU milliseconds per decoding step.

    PYTHONPATH=. .venv/bin/python scripts/bench/sampler_bench.py --assets /work/bench_assets --threads 1
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import GRPO, MAX_NEW_TOKENS, load_w1_actor, w1_generation_args  # noqa: E402

from lit_rlhf.rollout import GenerationSettings, generate_responses  # noqa: E402

SAMPLERS = ("inverse_cdf", "multinomial")


def main() -> None:
    args = w1_generation_args(__doc__, repeats=10)
    tokenizer, actor, prompts = load_w1_actor(args.assets, args.size)
    K = GRPO["num_generations"]
    settings = {
        name: GenerationSettings(
            max_new_tokens=MAX_NEW_TOKENS, temperature=GRPO["temperature"], num_samples=K, sampler=name
        )
        for name in SAMPLERS
    }
    cpu, wall, tokens, steps = ({name: [] for name in SAMPLERS} for _ in range(4))
    for repeat in range(args.repeats + 1):
        ids = torch.tensor([prompts[repeat % len(prompts)]["ids"]] * K)  # (K, P), no padding
        mask = torch.ones_like(ids)
        for name in SAMPLERS if repeat % 2 == 0 else SAMPLERS[::-1]:
            torch.manual_seed(repeat)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            responses, response_mask, *_ = generate_responses(
                actor, ids, mask, settings[name], eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, group_size=K,
            )  # fmt: skip
            if repeat:  # the first pair warms up
                cpu[name].append(time.process_time() - start_cpu)
                wall[name].append(time.perf_counter() - start_wall)
                tokens[name].append(response_mask.sum().item() / K)
                steps[name].append(responses.shape[1])  # decoding steps (the longest response)
    summary = {"args": vars(args)}
    for clock, values in (("cpu", cpu), ("wall", wall)):
        ratios = [m / i for i, m in zip(values["inverse_cdf"], values["multinomial"])]
        summary[clock] = {name: statistics.median(values[name]) for name in SAMPLERS}
        summary[clock]["speedup_median"] = statistics.median(ratios)
        for name in SAMPLERS:
            print(f"{clock:>4} {name:>11}: median {statistics.median(values[name]):.3f} s per rollout "
                  f"(min {min(values[name]):.3f}, max {max(values[name]):.3f})")  # fmt: skip
        print(f"{clock:>4} speed-up (multinomial / inverse_cdf): median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.repeats} pairs")  # fmt: skip
    for name in SAMPLERS:
        per_step = 1e3 * sum(cpu[name]) / sum(steps[name])
        summary[name] = {"mean_response_tokens": statistics.mean(tokens[name]), "cpu_ms_per_step": per_step}
        print(f"{name}: mean response length {statistics.mean(tokens[name]):.1f} tokens, "
              f"{statistics.mean(steps[name]):.1f} decoding steps, {per_step:.1f} ms CPU per step")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
