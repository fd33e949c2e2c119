"""Length-bucketed micro-batches on vs off: a GRPO update (rollout scoring + one pass of micro-batched
forward/backward) and a reward-model step, on prompts of 16-256 tokens and EOS-stopped responses.

Same random-init Llama, same rows for both settings; the two settings alternate, ``--repeats`` times,
and the script prints the median and spread (min-max) of each and their ratio. The rows are synthetic
token ids (timing does not depend on their values): lengths are drawn uniformly.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench/bucketing_bench.py --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from lit_rlhf.functional import aggregation_weight
from lit_rlhf.models import ModelSpec, train_bpe_tokenizer
from lit_rlhf.modules import CriticFreeModule, RewardModelModule
from lit_rlhf.rollout import Rollout

LLAMA = dict(
    model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=512, vocab_size=1000,
)  # fmt: skip


def ragged(n: int, low: int, high: int, g: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(3, 900, (k,), generator=g).tolist() for k in lengths]


def rollout(prompts: int, k: int, max_new: int, g: torch.Generator) -> Rollout:
    """Left-padded prompts of 16-256 tokens, K responses each stopping at EOS after 1-max_new tokens."""
    rows = [p for p in ragged(prompts, 16, 256, g) for _ in range(k)]
    responses = ragged(len(rows), 1, max_new, g)
    P, T, B = max(map(len, rows)), max(map(len, responses)), len(rows)
    ids, mask = torch.zeros(B, P + T, dtype=torch.long), torch.zeros(B, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(rows, responses)):
        ids[i, P - len(p) : P], ids[i, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p) : P + len(r)] = 1
    response_mask = mask[:, P:].bool()
    zeros = torch.zeros(B, T)
    return Rollout(ids, mask, response_mask, zeros, zeros, None, None, torch.randn(B, T, generator=g), None,
                   torch.zeros(B))  # fmt: skip


def preference_batch(pairs: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    from lit_rlhf.data.collators import PreferenceCollator

    prompts, chosen, rejected = ragged(pairs, 16, 256, g), ragged(pairs, 16, 128, g), ragged(pairs, 16, 128, g)
    rows = [{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
            for p, c, r in zip(prompts, chosen, rejected)]  # fmt: skip
    return PreferenceCollator(pad_token_id=0)(rows)


def grpo_update(module: CriticFreeModule, data: Rollout) -> None:
    """What one rollout of CriticFreeModule computes besides generation: old/ref log-probs, then the
    micro-batch loop of ``run_update_epochs`` (one epoch, one minibatch, no optimiser step)."""
    T = data.response_mask.shape[1]
    module.score_rollout(data.input_ids, data.attention_mask, T)
    for rows, columns, t in module.micro_batches(data.attention_mask, T):
        part = data.select(rows).crop(columns, t)
        weight = aggregation_weight(part.response_mask, data.response_mask, "token_mean")
        loss, _ = module.policy_loss(part)
        (loss * weight).backward()
    module.zero_grad(set_to_none=True)


def rm_step(module: RewardModelModule, batch: dict[str, torch.Tensor]) -> None:
    from lit_rlhf.modules.reward_model import PairMetrics

    loss, _, _ = module._step(batch, PairMetrics())  # (loss, chosen scores, rejected scores)
    loss.backward()
    module.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="GRPO prompts per rollout (K = 4 each)")
    parser.add_argument("--pairs", type=int, default=16, help="RM pairs per step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tokenizer = tempfile.mkdtemp()
    words = "the a food service movie plot staff room was is good bad great it".split()
    train_bpe_tokenizer([" ".join(words[i:] + words[:i]) for i in range(len(words))], 300).save_pretrained(tokenizer)
    spec = ModelSpec(config=LLAMA, tokenizer=tokenizer, seed=0)
    data, batch = rollout(args.prompts, 4, 64, g), preference_batch(args.pairs, g)
    real = int(data.attention_mask.sum())
    print(f"GRPO rollout: {data.batch_size} rows, width {data.input_ids.shape[1]}, "
          f"real tokens {real / data.attention_mask.numel():.0%} of the padded batch")  # fmt: skip
    print(f"RM batch: {batch['input_ids'].shape[0]} rows, width {batch['input_ids'].shape[1]}, "
          f"real tokens {batch['attention_mask'].float().mean():.0%}")  # fmt: skip
    cases = {}
    for name, bucketing in (("on", None), ("off", {"enabled": False})):
        grpo = CriticFreeModule(actor=spec, reward_fn="lit_rlhf.demo.world:gold_reward_fn", rng_seed=0,
                                scoring={"forward_batch_size": 16, "bucketing": bucketing})  # fmt: skip
        rm = RewardModelModule(spec, bucketing=bucketing)
        cases[name] = (grpo, rm)
    T = data.response_mask.shape[1]
    for task, batches in (("GRPO", [(r, c) for r, c, _ in cases["on"][0].micro_batches(data.attention_mask, T)]),
                          ("RM", cases["on"][1].micro_batches(batch["attention_mask"]))):
        shapes = [(len(range(10**9)[r]) if isinstance(r, slice) else len(r), c.stop - c.start) for r, c in batches]
        print(f"{task} micro-batches with bucketing on (rows, width):", shapes)  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name in ("on", "off") if repeat % 2 else ("off", "on"):
            grpo, rm = cases[name]
            for task in ("grpo_update", "rm_step"):
                start = time.perf_counter()
                grpo_update(grpo, data) if task == "grpo_update" else rm_step(rm, batch)
                if repeat:
                    times.setdefault((task, name), []).append(time.perf_counter() - start)
    for task in ("grpo_update", "rm_step"):
        on, off = times[(task, "on")], times[(task, "off")]
        ratios = sorted(b / a for a, b in zip(on, off))
        print(f"{task}: off {statistics.median(off):.2f}s [{min(off):.2f}-{max(off):.2f}]  "
              f"on {statistics.median(on):.2f}s [{min(on):.2f}-{max(on):.2f}]  "
              f"speed-up {statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
