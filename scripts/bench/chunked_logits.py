"""Peak memory and time of one training step with the full logits vs the chunked LM head.

Each measurement runs in a fresh subprocess (peak RSS, ``ru_maxrss``, is per process and never goes
down), the two settings alternating, so both see the same machine state. A Llama-style random-init
model (vocabulary 32,000) scores a batch of rows with gradients:

- ``sft``: ``next_token_logprobs`` over every position (SFT's loss and token accuracy),
- ``policy``: ``policy_forward`` on the last ``response`` tokens (PPO/GRPO's log-probs and entropy).

Printed per setting: the median and spread (min-max) over the repeats of the step's time, the peak RSS
of the process and its growth during the step (on CUDA: ``torch.cuda.max_memory_allocated``).

    PYTHONPATH=. .venv/bin/python scripts/bench/chunked_logits.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

MODES = ("off", "on")


def _worker(args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_rlhf.models import next_token_logprobs, policy_forward, set_logits_chunking

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.length,
    )
    model = LlamaForCausalLM(config).to(device)
    set_logits_chunking(model, args.mode)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), device=device)
    mask = torch.ones_like(ids)

    def step() -> None:
        if args.workload == "sft":
            score_mask = torch.ones(args.batch, args.length - 1, dtype=torch.bool, device=device)
            logprobs, _ = next_token_logprobs(model, ids, mask, score_mask, argmax=True)
            loss = -logprobs.mean()
        else:
            logprobs, entropy, _ = policy_forward(model, ids, mask, args.response, temperature=0.7)
            loss = -(logprobs.mean() + 0.01 * entropy.mean())
        loss.backward()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated, as in training

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for param in model.parameters():  # the gradients exist before the step, as in training
        param.grad = torch.zeros_like(param)
    sync()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated() / 2**20
    times = []
    for _ in range(args.steps + 1):  # the first step warms up (the fastest counts)
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    result = {"time_s": min(times[1:]), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    result["rss_before_mib"] = base_rss
    if device.type == "cuda":
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_step_mib"] = result["cuda_peak_mib"] - base_cuda
    return result


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("sft", "policy", "both"), default="both")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512, help="tokens per row")
    parser.add_argument("--response", type=int, default=256, help="response tokens (policy workload)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process after a warm-up one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # set in the worker processes
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(_worker(args)))
        return
    workloads = ("sft", "policy") if args.workload == "both" else (args.workload,)
    print(
        f"Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, {args.batch} x {args.length} "
        f"tokens (policy: last {args.response} scored), {args.threads} thread(s), {args.device}; "
        f"median (min-max) of {args.repeats} alternating fresh processes"
    )
    for workload in workloads:
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                argv = [a for a in sys.argv[1:] if not a.startswith("--workload")]
                command = [sys.executable, __file__, *argv, "--workload", workload, "--mode", mode]
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                results[mode].append(json.loads(out.strip().splitlines()[-1]))
        print(f"\n{workload}: logits_chunking  step time s       peak RSS MiB           RSS growth in step MiB")
        for mode in MODES:
            runs = results[mode]
            growth = [r["peak_rss_mib"] - r["rss_before_mib"] for r in runs]
            line = (
                f"  {mode:>3}             {_spread([r['time_s'] for r in runs])}  "
                f"{_spread([r['peak_rss_mib'] for r in runs])}  {_spread(growth)}"
            )
            if "cuda_peak_mib" in runs[0]:
                line += f"  cuda peak {_spread([r['cuda_peak_mib'] for r in runs])}"
                line += f" step {_spread([r['cuda_step_mib'] for r in runs])}"
            print(line)
        off, on = (statistics.median(r["peak_rss_mib"] for r in results[m]) for m in MODES)
        t_off, t_on = (statistics.median(r["time_s"] for r in results[m]) for m in MODES)
        print(f"  chunked / full: peak RSS {on / off:.2f}x, step time {t_on / t_off:.2f}x")


if __name__ == "__main__":
    main()
