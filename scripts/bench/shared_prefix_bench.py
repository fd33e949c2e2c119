"""Step time with the shared-prompt layout (lit_rlhf/models/shared_prefix.py) forced on vs off.

GRPO: G prompts x K = 8 EOS-stopped responses; one step = rollout scoring (actor and reference log-probs
and entropy, no grad) + the update's forward/backward (log-probs and entropy). Pairs: B pairs; DPO = policy
forward/backward + reference forward, RM = score forward/backward. A random-init Llama (vocab 32000,
hidden 256, 4 layers, sdpa, float32), 1 thread, off/on alternating, median and spread (min-max) of the
repeats in process CPU seconds (wall time on a shared machine measures the neighbours), and what ``auto``
decides for each shape.

    PYTHONPATH=. .venv/bin/python scripts/bench/shared_prefix_bench.py --prompts 64 128 256 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from lit_rlhf.data.collators import PreferenceCollator
from lit_rlhf.models import (
    packed_policy_forward,
    packed_response_logprobs,
    packed_sequence_scores,
    pair_layout,
    policy_forward,
    response_logprobs,
    sequence_scores,
    shared_prefix_layout,
)

PAD, EOS = 0, 2


def models(vocab: int):
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, pad_token_id=PAD, num_labels=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config), LlamaForCausalLM(config).eval(), LlamaForSequenceClassification(config)


def group_rows(g: torch.Generator, groups: int, K: int, prompt_len: int, max_response: int, vocab: int):
    """(G*K, P+T) left-padded prompts of prompt_len/2..prompt_len tokens, responses of 8..max ending in EOS."""
    p_lens = torch.randint(prompt_len // 2, prompt_len + 1, (groups,), generator=g).tolist()
    r_lens = torch.randint(8, max_response + 1, (groups * K,), generator=g).tolist()
    P, T = max(p_lens), max(r_lens)
    ids, mask = torch.full((groups * K, P + T), PAD), torch.zeros(groups * K, P + T, dtype=torch.long)
    for b in range(groups * K):
        if b % K == 0:
            prompt = torch.randint(3, vocab, (p_lens[b // K],), generator=g)
        ids[b, P - len(prompt) : P], mask[b, P - len(prompt) : P] = prompt, 1
        response = torch.randint(3, vocab, (r_lens[b],), generator=g)
        response[-1] = EOS
        ids[b, P : P + r_lens[b]], mask[b, P : P + r_lens[b]] = response, 1
    return ids, mask, T


def grpo_step(actor, reference, ids, mask, T, mode):
    P = ids.shape[1] - T
    prompt_mask, response_mask = mask.clone(), mask.clone()
    prompt_mask[:, P:], response_mask[:, :P] = 0, 0
    layout = shared_prefix_layout(actor, mode, ids, prompt_mask, response_mask, PAD, ids.shape[0] * (T + 1), T)
    rmask = mask[:, P:].bool()

    def forward(model):
        if layout is None:
            return policy_forward(model, ids, mask, T, 0.7)[:2]
        return packed_policy_forward(model, layout, 0.7)

    with torch.no_grad():  # rollout scoring
        forward(actor), forward(reference)
    logprobs, entropy = forward(actor)  # the update
    ((logprobs * rmask).sum() + 0.01 * (entropy * rmask).sum()).backward()
    actor.zero_grad(set_to_none=True)
    return layout is not None


def pair_batch(g: torch.Generator, pairs: int, prompt_len: int, max_response: int, vocab: int):
    def toks(lo, hi):
        return torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    rows = [
        {
            "prompt_input_ids": toks(prompt_len // 2, prompt_len),
            "chosen_input_ids": toks(8, max_response - 1) + [EOS],
            "rejected_input_ids": toks(8, max_response - 1) + [EOS],
        }
        for _ in range(pairs)
    ]
    return PreferenceCollator(PAD)(rows)


def dpo_step(policy, reference, batch, mode):
    args = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    layout = pair_layout(policy, mode, *args, PAD)
    run = (lambda m: response_logprobs(m, *args)) if layout is None else (lambda m: packed_response_logprobs(m, layout))
    with torch.no_grad():
        run(reference)
    run(policy)[0].sum().backward()
    policy.zero_grad(set_to_none=True)
    return layout is not None


def rm_step(model, batch, mode):
    layout = pair_layout(model, mode, batch["input_ids"], batch["attention_mask"], batch["response_mask"], PAD, lm_head=False)
    scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"]) if layout is None else packed_sequence_scores(model, layout)
    scores.sum().backward()
    model.zero_grad(set_to_none=True)
    return layout is not None


def timed(fn, repeats: int) -> dict:
    """off/on alternating; CPU seconds per step (median, min, max) for each, and the on/off speed-up."""
    times = {"off": [], "on": []}
    fn("off"), fn("on")  # warm-up
    for _ in range(repeats):
        for mode in ("off", "on"):
            start = time.process_time()  # CPU time of this 1-thread process: robust to a shared machine
            fn(mode)
            times[mode].append(time.process_time() - start)
    out = {m: (statistics.median(t), min(t), max(t)) for m, t in times.items()}
    speedups = sorted(a / b for a, b in zip(times["off"], times["on"]))
    out["speedup"] = (statistics.median(speedups), speedups[0], speedups[-1])
    out["auto"] = "on" if fn("auto") else "off"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 128, 256], help="longest prompt of each run")
    parser.add_argument("--groups", type=int, default=2, help="GRPO prompts per step (K = 8 rows each)")
    parser.add_argument("--pairs", type=int, default=4, help="pairs per DPO/RM step")
    parser.add_argument("--max-response", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    actor, reference, scorer = models(args.vocab)
    print("workload  prompt  off s (min-max)         on s (min-max)          speed-up (min-max)  auto")
    for prompt_len in args.prompts:
        g = torch.Generator().manual_seed(prompt_len)
        ids, mask, T = group_rows(g, args.groups, 8, prompt_len, args.max_response, args.vocab)
        batch = pair_batch(g, args.pairs, prompt_len, args.max_response, args.vocab)
        runs = {
            "grpo": lambda mode, ids=ids, mask=mask, T=T: grpo_step(actor, reference, ids, mask, T, mode),
            "dpo": lambda mode, batch=batch: dpo_step(actor, reference, batch, mode),
            "rm": lambda mode, batch=batch: rm_step(scorer, batch, mode),
        }
        for name, fn in runs.items():
            r = timed(fn, args.repeats)
            cells = [f"{r[m][0]:.3f} ({r[m][1]:.3f}-{r[m][2]:.3f})" for m in ("off", "on")]
            s = r["speedup"]
            print(f"{name:9s} {prompt_len:6d}  {cells[0]:22s}  {cells[1]:22s}  {s[0]:.2f}x ({s[1]:.2f}-{s[2]:.2f})    {r['auto']}")


if __name__ == "__main__":
    main()
