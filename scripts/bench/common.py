"""Shared pieces of the lit_rlhf-vs-TRL benchmarks: settings, assets, the phase timeline, results.

This module must import in both environments (lit_rlhf's ``.venv`` and the TRL venv made by
``setup.sh``), so it imports neither lit_rlhf nor trl at module level. Only :func:`build_assets` needs
lit_rlhf (its tokenizer trainer) and runs in the driver, in lit_rlhf's environment.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time
from pathlib import Path

RESULT_PREFIX = "BENCH_RESULT "

# PPO settings of issue 7, identical for both libraries.
PPO = dict(
    batch=16,  # prompts per rollout
    prompt_len=16,  # every prompt has exactly this many tokens: no padding, identical shapes for both
    response_len=32,  # no early stop: EOS and pad are made impossible for both (see build_assets)
    ppo_epochs=4,
    num_minibatches=2,
    forward_batch_size=16,  # rollout forwards and update micro-batches (TRL: local_rollout_forward_batch_size)
    temperature=0.7,  # TRL's default
    lr=3e-6,  # TRL's default; constant schedule, no weight decay for both
    kl_coef=0.05,
    clip_coef=0.2,
    clip_coef_value=0.2,
    vf_coef=0.1,  # TRL's default
    gamma=1.0,
    gae_lambda=0.95,
)
# Random-init Llama-style models: "small" is the issue's ~4.7M-parameter model, "large" (~26M) the
# >= 20M-parameter case of the FLOP-utilisation figure.
LLAMA = {
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
    "large": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8),
}
VOCAB = 1000
# Reward-model benchmark: hidden-64, 2-layer GPT-2 on fixed-length pairs (same padding in any order).
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
RM = dict(
    pairs_per_batch=8, prompt_len=16, chosen_len=24, rejected_len=20, n_pairs=1024, lr=1e-4, max_grad_norm=1.0
)


# TrainingArguments fields every TRL run of the benchmark shares: float32 on the CPU like lit_rlhf (TRL's
# configs default to bf16 autocast and gradient checkpointing, which lit_rlhf does not run here), no
# reporting, no checkpoints, seed 0.
TRL_COMMON = dict(
    bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none", disable_tqdm=True,
    save_strategy="no", seed=0,
)  # fmt: skip


# The precisions of the rollout benchmarks (--precision): float32, or Lightning's bf16-mixed (torch.autocast
# to bfloat16 on the CPU; weights, gradients and AdamW moments float32) against TRL with
# TrainingArguments.bf16=True (accelerate's autocast to bfloat16 on the CPU: the same scheme; ppo_bench.py
# also sets ACCELERATE_MIXED_PRECISION for PPOTrainer's own Accelerator).
PRECISIONS = ("32-true", "bf16-mixed")
# The driver adds the bf16 rows (W1_grpo_bf16, W3_ppo_bf16) where the measured bf16 matmul peak is at
# least this multiple of the fp32 one (an AMX Xeon measures ~7x; a CPU without bf16 instructions far
# below 1x, where bf16 would only be slower).
BF16_ROWS_MIN_SPEEDUP = 2.0


def trl_precision(precision: str) -> dict:
    """TrainingArguments fields of ``precision`` (overriding TRL_COMMON's ``bf16=False``)."""
    return dict(bf16=precision == "bf16-mixed")


def bench_parser(doc: str | None, impl: bool = True, lit_args: bool = False, precision: bool = False):
    """The argparse parser every benchmark script starts from: --impl lit|trl, --assets, --threads, and
    with ``lit_args`` --lit-args (a JSON object of lit_rlhf constructor-argument overrides, see
    :func:`with_overrides`; only for scripts that apply it), with ``precision`` --precision (PRECISIONS)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if impl:
        parser.add_argument("--impl", choices=["lit", "trl"], required=True)
    parser.add_argument("--assets", required=True)
    parser.add_argument("--threads", type=int, default=1)
    if lit_args:
        parser.add_argument(
            "--lit-args", type=json.loads, default={},
            help='lit_rlhf module arguments to override, JSON, e.g. \'{"generation": {"sampler": "multinomial"}}\'',
        )  # fmt: skip
    if precision:
        parser.add_argument(
            "--precision", choices=PRECISIONS, default="32-true",
            help="lit_rlhf: the Trainer's precision; TRL: bf16=True for bf16-mixed (autocast on the CPU)",
        )  # fmt: skip
    return parser


def with_overrides(kwargs: dict, overrides: dict) -> dict:
    """Module constructor ``kwargs`` with ``overrides`` applied: a dict given for a dataclass or dict
    argument (ModelSpec, GenerationSettings, a settings group such as ``scoring``) updates those fields,
    recursively for nested dicts (``{"scoring": {"bucketing": {"split_cost": None}}}`` keeps the other
    ``scoring`` and ``bucketing`` fields); anything else replaces it."""
    import dataclasses

    out = dict(kwargs)
    for key, value in overrides.items():
        current = out.get(key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            out[key] = dataclasses.replace(current, **value)
        elif isinstance(value, dict) and isinstance(current, dict):
            out[key] = with_overrides(current, value)
        else:
            out[key] = value
    return out


def default_optimizer(module_class: type, argument: str, **kwargs):
    """The module's own default optimiser factory with the benchmark's hyper-parameters bound, so the
    benchmark measures lit_rlhf's defaults (whatever AdamW variant the module picks)."""
    import functools
    import inspect

    factory = inspect.signature(module_class.__init__).parameters[argument].default
    return functools.partial(factory, **kwargs)


def child_env(threads: int) -> dict[str, str]:
    """Environment of every benchmark subprocess: equal thread counts, nothing online."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    return env


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (``ru_maxrss``, KiB on Linux).

    Linux carries ``ru_maxrss`` across ``execve`` from the process that spawned it, so a driver whose
    RSS exceeds a run's would hide that run's peak: the driver therefore never imports torch (the assets
    are built in a subprocess too), and ``VmHWM`` (the peak of this exec's address space) is kept as a
    cross-check.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def versions(impl: str) -> dict[str, str]:
    """Versions of the packages a run used (the driver prints them under the tables)."""
    from importlib import metadata

    names = [
        "torch",
        "transformers",
        *(("trl", "accelerate") if impl == "trl" else ("lit-rlhf", "lightning")),
    ]
    return {name: metadata.version(name) for name in names}


def footprint(impl: str) -> dict:
    """What every benchmark run reports besides its timings: peak memory and package versions."""
    return dict(peak_rss_mb=peak_rss_mb(), vm_hwm_mb=vm_hwm_mb(), versions=versions(impl))


def emit(result: dict) -> None:
    """Print the run's result as one prefixed JSON line for the driver."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


class Timeline:
    """Timestamps of one PPO run: ``start``, then per rollout ``gen_start``, ``gen_end``, ``upd_start``,
    ``iter_end``. Phases: generation = gen_start..gen_end, scoring = gen_end..upd_start (reward, value,
    reference forwards, GAE), update = upd_start..iter_end (PPO epochs and the step's logging), other = the
    rest of the rollout (data loading, loop overhead, TRL's gc.collect()); total = iter_end..iter_end.

    Each mark records wall time and this process's CPU time: on a machine shared with other jobs the
    CPU time (``cpu_*`` keys) is the contention-robust measure of the work, the wall time the one users see.
    ``optimizer`` is the part of the update spent in ``Optimizer.step`` (global torch hooks, so the same
    for both libraries).
    """

    def __init__(self) -> None:
        self.marks: list[tuple[str, float, float]] = []
        self.engine: list[dict[str, float]] = []  # lit_rlhf's RolloutEngine.stats() per rollout (sync_s, ...)
        self._update_open = False
        self._optimizer = [0.0, 0.0]  # wall, CPU spent in Optimizer.step since the last iter_end
        self._step_start = (0.0, 0.0)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(self._pre_step)
        register_optimizer_step_post_hook(self._post_step)

    def _pre_step(self, *_) -> None:
        self._step_start = (time.perf_counter(), time.process_time())

    def _post_step(self, *_) -> None:
        self._optimizer[0] += time.perf_counter() - self._step_start[0]
        self._optimizer[1] += time.process_time() - self._step_start[1]

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter(), time.process_time()))
        if name == "gen_end":
            self._update_open = True
        if name == "iter_end":
            self.marks.append(("optimizer", *self._optimizer))
            self._optimizer = [0.0, 0.0]

    def mark_update_start(self) -> None:
        """Mark ``upd_start`` at the first call after generation only (TRL's forward is called often)."""
        if self._update_open:
            self._update_open = False
            self.mark("upd_start")

    def rollouts(self) -> list[dict[str, float]]:
        out, cur, prev = [], {}, None
        for name, *now in self.marks:
            if name == "start":
                prev = now
            elif name == "iter_end":
                row = {}
                for i, prefix in enumerate(("", "cpu_")):
                    phases = dict(
                        generation=cur["gen_end"][i] - cur["gen_start"][i],
                        scoring=cur["upd_start"][i] - cur["gen_end"][i],
                        update=now[i] - cur["upd_start"][i],
                        total=now[i] - prev[i],
                    )
                    phases["other"] = (
                        phases["total"] - phases["generation"] - phases["scoring"] - phases["update"]
                    )
                    row.update({prefix + k: v for k, v in phases.items()})
                out.append(row)
                cur, prev = {}, now
            elif name == "optimizer":
                out[-1].update(optimizer=now[0], cpu_optimizer=now[1])
            else:
                cur[name] = now
        return out


class StepClock:
    """Wall and CPU time at the end of each optimiser step (reward-model benchmark)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def build_assets(folder: Path, models: tuple[str, ...] = ("small", "large")) -> None:
    """Tokenizer, initial weights and data shared by both libraries, written once with save_pretrained.

    Generation settings that make EOS and pad impossible for both libraries live in each actor's
    ``generation_config.json``: ``suppress_tokens=[pad, eos]`` (TRL takes it from the model's config;
    lit_rlhf passes its own ``suppress_tokens=[pad]``) and ``min_new_tokens=response_len`` (lit_rlhf's
    EOS stop is masked for the whole response). Every response is then exactly ``response_len`` tokens.
    """
    import torch
    from transformers import (
        GenerationConfig,
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )
    from transformers.utils import logging as hf_logging

    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    hf_logging.disable_progress_bar()

    rng = random.Random(0)
    syllables = (
        "ka lo mi ne ru ta shi po an el or us ix be do fa gu he ji ko la mo nu pa qi ra se ti vu wo ya ze"
    )
    syllables = syllables.split()
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(12, 40))) for _ in range(4000)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=VOCAB)
    assert len(tokenizer) == VOCAB, f"tokenizer has {len(tokenizer)} tokens, expected {VOCAB}"
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    tokenizer.save_pretrained(folder / "tokenizer")
    ids = [tokenizer(t)["input_ids"] for t in texts]
    ids = [row for row in ids if len(row) >= 64]
    special = dict(pad_token_id=pad, eos_token_id=eos, bos_token_id=eos, vocab_size=VOCAB)

    def save(model: torch.nn.Module, path: Path) -> None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)

    for name in models:
        fields = dict(**LLAMA[name], max_position_embeddings=128, tie_word_embeddings=False, **special)
        torch.manual_seed(0)
        actor = LlamaForCausalLM(LlamaConfig(**fields))
        actor.generation_config = GenerationConfig(
            min_new_tokens=PPO["response_len"], suppress_tokens=[pad, eos], **special
        )
        save(actor, folder / name / "actor")
        torch.manual_seed(1)
        save(LlamaForSequenceClassification(LlamaConfig(**fields, num_labels=1)), folder / name / "reward")
    prompts = [row[: PPO["prompt_len"]] for row in ids]
    (folder / "prompts.json").write_text(json.dumps(prompts))

    torch.manual_seed(2)
    gpt2 = GPT2ForSequenceClassification(GPT2Config(**GPT2, num_labels=1, **special))
    save(gpt2, folder / "rm_gpt2")
    pairs = []
    for _ in range(RM["n_pairs"]):
        row = rng.choice(ids)
        start = rng.randrange(0, len(row) - RM["prompt_len"] - RM["chosen_len"])
        prompt = row[start : start + RM["prompt_len"]]
        other = rng.choice(ids)
        pairs.append(
            dict(
                prompt=prompt,
                chosen=row[start + RM["prompt_len"] : start + RM["prompt_len"] + RM["chosen_len"]] + [eos],
                rejected=other[: RM["rejected_len"]] + [eos],
            )
        )
    (folder / "pairs.json").write_text(json.dumps(pairs))


def load_json(path: Path):
    return json.loads(Path(path).read_text())


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    # python scripts/bench/common.py DIR: build the assets once, e.g. for ppo_bench.py --profile
    build_assets(Path(sys.argv[1]))
