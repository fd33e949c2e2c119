"""The algorithms the demo runs side by side: the registry, each run's config and the online ones' checks.

Adding an algorithm to the side-by-side is writing ``configs/demo/<name>.yaml`` (a fit from ``runs/demo/sft``
against ``runs/demo/rm``, with an HFExport callback) and one :data:`ALGORITHMS` entry. The run of seed 0 is
named after the algorithm (``OUT/ppo``, ``tb/ppo``), seed s > 0 ``<name>_seed<s>``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from lit_rlhf.demo import assets
from lit_rlhf.demo.evaluate import EVAL_MAX_NEW_TOKENS, EVAL_TEMPERATURE
from lit_rlhf.demo.stages import load_config, name_run

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHMS", "Algorithm", "algorithm_config", "check_online_configs", "parse_algorithms"]

CURVE_PROMPTS = 256  # held-out prompts per gold-curve point (the first ones of prompts_eval.jsonl)


@dataclass(frozen=True)
class Algorithm:
    """How the pipeline runs and reads one algorithm of ``configs/demo/<name>.yaml``.

    Attributes:
        policy_subdir: folder of the trained policy inside the config's HFExport ``dirpath`` ("" = itself).
        policy_attribute: attribute of the LightningModule holding the trained policy (for the gold curve).
        online: samples its training responses; the online algorithms of one run must sample as many
            (``max_rollouts`` x prompts per rollout x ``generation.num_samples``) at the evaluation's temperature.
        seed_args: ``model.init_args`` set to the training seed, besides ``seed_everything``.
        curve_every: training steps between two points of the gold curve.
        config: name of its config in ``configs/demo`` when it is not the algorithm's name.
    """

    policy_subdir: str = ""
    policy_attribute: str = "policy"
    online: bool = True
    seed_args: tuple[str, ...] = ()
    curve_every: int = 4
    config: str | None = None


# One entry per configs/demo/<name>.yaml run side by side. An online algorithm sets `online`, its policy
# attribute and its seed arguments; an offline one (a DPO fit on the RM's preference pairs) `online=False`
# and a `curve_every` in its own optimiser steps.
ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(policy_subdir="actor", policy_attribute="actor", seed_args=("rng_seed",), curve_every=4),
    "grpo": Algorithm(policy_subdir="actor", policy_attribute="actor", seed_args=("rng_seed",), curve_every=4),
    "rloo": Algorithm(policy_subdir="actor", policy_attribute="actor", seed_args=("rng_seed",), curve_every=4),
    "reinforce_pp": Algorithm(policy_subdir="actor", policy_attribute="actor", seed_args=("rng_seed",), curve_every=4),
    "dpo": Algorithm(policy_subdir="", policy_attribute="model", online=False, curve_every=10),
    "online_dpo": Algorithm(policy_subdir="actor", policy_attribute="actor", seed_args=("rng_seed",), curve_every=4),
}
# `make demo` (under 15 min from a fresh clone on an idle 2-core CPU): PPO, GRPO and DPO; the rest by flag.
DEFAULT_ALGORITHMS = ("ppo", "grpo", "dpo")


def parse_algorithms(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--algorithms: unknown {unknown or text!r}; registered: {', '.join(ALGORITHMS)}"
        )
    return list(dict.fromkeys(names))


def algorithm_config(name: str, seed: int, out: Path, small: bool) -> tuple[str, dict]:
    """Run name and config of algorithm ``name`` with training seed ``seed``, with its gold curve."""
    algorithm = ALGORITHMS[name]
    config = load_config(algorithm.config or name, out, small)
    run = name if seed == 0 else f"{name}_seed{seed}"
    name_run(config, run, seed, algorithm.seed_args, out)
    callbacks = config["trainer"]["callbacks"]
    curve = {
        "prompts_path": str(out / "assets" / "prompts_eval.jsonl"),
        "reference": str(out / "sft"),
        "output": str(out / "curves" / f"{run}.json"),
        "every_n_steps": 1 if small else algorithm.curve_every,
        "num_prompts": assets.SMALL["n_eval_prompts"] if small else CURVE_PROMPTS,
        "policy_attribute": algorithm.policy_attribute,
        "max_new_tokens": EVAL_MAX_NEW_TOKENS,
        "temperature": EVAL_TEMPERATURE,
    }
    callbacks.append({"class_path": "lit_rlhf.demo.curves.GoldCurve", "init_args": curve})
    # After GoldCurve: its evaluation models are loaded before the training peak is measured from.
    memory = {"output": str(out / "memory" / f"{run}.json")}
    callbacks.append({"class_path": "lit_rlhf.callbacks.PeakMemory", "init_args": memory})
    return run, config


def check_online_configs(configs: dict[str, dict], max_response_tokens: int) -> None:
    """Online algorithms sample as many responses, at the evaluation's temperature, long enough.

    ``configs`` maps the name of each config in ``configs/demo`` (as the error messages say) to its content.
    """
    counts = {}
    for name, config in configs.items():
        init = config["model"]["init_args"]
        generation = init.get("generation", {})
        where = f"configs/demo/{name}.yaml"
        if generation.get("max_new_tokens", 0) < max_response_tokens:
            raise ValueError(
                f"{where}: generation.max_new_tokens={generation.get('max_new_tokens')} is below the longest"
                f" grammatical response ({max_response_tokens} tokens with its EOS)"
            )
        if generation.get("temperature") != EVAL_TEMPERATURE:
            raise ValueError(
                f"{where}: generation.temperature={generation.get('temperature')}: the demo samples and"
                f" measures KL at {EVAL_TEMPERATURE} (evaluate.EVAL_TEMPERATURE)"
            )
        if not init.get("max_rollouts"):
            raise ValueError(f"{where}: an online algorithm of the demo sets model.init_args.max_rollouts")
        per_prompt = generation.get("num_samples", 1)
        counts[name] = init["max_rollouts"] * config["data"]["init_args"]["batch_size"] * per_prompt
    if len(set(counts.values())) > 1:
        raise ValueError(f"the online algorithms must sample as many responses; they sample {counts}")
