"""The offline demo, end to end: assets -> SFT -> reward model -> PPO -> evaluation -> report.

    python -m lit_rlhf.demo.pipeline --out runs/demo [--small] [--no-overoptimize] [--threads N]

1. builds the demo assets into ``OUT/assets`` (skipped when built before with the same settings);
2. runs the fits through the CLI, ``lit-rlhf fit --config OUT/configs/<stage>.yaml``, where each
   config is ``configs/demo/<stage>.yaml`` with its ``runs/demo/`` paths moved under ``OUT`` (and, with
   ``--small``, tiny sizes): SFT from scratch; the reward model from the SFT export; PPO with the SFT
   export as actor and reference and the reward model as proxy reward and critic initialisation
   (then the weak reward model and the over-optimisation PPO run, see below);
3. evaluates the SFT and PPO policies on the held-out evaluation prompts and the reward model on the
   held-out pairs, against the gold reward (:mod:`lit_rlhf.demo.evaluate`);
4. writes ``OUT/report.md``, ``OUT/report.json``, ``OUT/samples.md`` and PNG plots
   (:mod:`lit_rlhf.demo.report`); TensorBoard logs stay in ``OUT/tb``.

The reward over-optimisation run (Gao et al. 2022; skipped with ``--no-overoptimize``) adds a weaker
proxy reward model (``rm_weak.yaml``: a tenth of the pairs) optimised with a weak, fixed KL penalty
(``ppo_overoptimize.yaml``), whose gold and proxy rewards are plotted against the KL to the reference.
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before the heavy imports below: they are part of the demo's wall time

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

from lit_rlhf.demo import assets, evaluate, report  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "demo"
DEFAULT_ROOT = "runs/demo/"  # the prefix of every path in configs/demo/*.yaml

# Asset sizes of the full demo (see assets.build_assets); --small uses assets.SMALL.
FULL_ASSETS = dict(n_sft=80_000, n_prompts=16_384, n_pref_prompts=4_000, completions_per_prompt=4, n_eval_prompts=1_024)

_TINY_MODEL = {"model_type": "gpt2", "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2}
_TINY_TRAINER = {"max_steps": 4, "val_check_interval": 2, "log_every_n_steps": 1, "enable_model_summary": False}
# --small: a miniature of every stage (tests), merged into the configs.
SMALL_OVERRIDES: dict[str, dict[str, Any]] = {
    "sft": {
        "trainer": _TINY_TRAINER,
        "model": {"init_args": {"model": {"config": _TINY_MODEL}, "num_samples": 2}},
        "data": {"init_args": {"batch_size": 16, "val_batch_size": 16}},
    },
    "rm": {"trainer": _TINY_TRAINER, "data": {"init_args": {"batch_size": 8, "val_batch_size": 16}}},
    "ppo": {
        "trainer": {"enable_model_summary": False},
        "model": {"init_args": {"max_rollouts": 2, "forward_batch_size": 8, "ppo_epochs": 1}},
        "data": {"init_args": {"batch_size": 8}},
    },
}
SMALL_OVERRIDES["rm_weak"] = SMALL_OVERRIDES["rm"]
SMALL_OVERRIDES["ppo_overoptimize"] = SMALL_OVERRIDES["ppo"]


def _merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _move_paths(node: Any, out: Path) -> Any:
    """Every string ``runs/demo/X`` of a config becomes ``OUT/X``."""
    if isinstance(node, dict):
        return {k: _move_paths(v, out) for k, v in node.items()}
    if isinstance(node, list):
        return [_move_paths(v, out) for v in node]
    if isinstance(node, str) and node.startswith(DEFAULT_ROOT):
        return str(out / node[len(DEFAULT_ROOT) :])
    return node


def stage_config(stage: str, out: Path, small: bool) -> Path:
    """Write ``OUT/configs/<stage>.yaml``: the demo config with its paths under ``out`` (tiny if small)."""
    config = yaml.safe_load((CONFIG_DIR / f"{stage}.yaml").read_text())
    config = _move_paths(config, out)
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"].endswith("HFExport"):  # a rerun of the pipeline replaces its own exports
            callback["init_args"]["overwrite"] = True
    if small:
        config = _merge(config, SMALL_OVERRIDES[stage])
    path = out / "configs" / f"{stage}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def fit(stage: str, out: Path, small: bool) -> dict:
    """``lit-rlhf fit --config OUT/configs/<stage>.yaml`` in this process; returns its config and log dir."""
    from lit_rlhf.cli import run_cli

    config_path = stage_config(stage, out, small)
    config = yaml.safe_load(config_path.read_text())
    shutil.rmtree(config["trainer"]["logger"]["init_args"]["save_dir"] + f"/{stage}", ignore_errors=True)
    print(f"\n=== {stage}: lit-rlhf fit --config {config_path}", flush=True)
    with warnings.catch_warnings():  # the pipeline's own argv is not meant for the CLI: no need to say so
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        cli = run_cli(["fit", "--config", str(config_path)])
    return {"config": config, "log_dir": cli.trainer.logger.log_dir}


def build_or_reuse_assets(folder: Path, small: bool, seed: int) -> dict:
    """The demo assets in ``folder``, built unless a manifest with the same arguments is there."""
    sizes = dict(assets.SMALL) if small else dict(FULL_ASSETS)
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        wanted = {**manifest["args"], **sizes, "seed": seed}
        if manifest["args"] == wanted:
            print(f"=== assets: reusing {folder}", flush=True)
            return manifest
    print(f"=== assets: building {folder}", flush=True)
    assets.build_assets(folder, seed=seed, **sizes)
    return json.loads(manifest_path.read_text())


class Clock:
    """Wall time per stage, in the order run."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    def run(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.stages[name] = time.perf_counter() - start
        return result


def evaluate_policies(out: Path, ppo_configs: dict[str, dict], eval_prompts: list[str], small: bool) -> dict:
    """Samples and summaries of the SFT policy and of each PPO run's actor, on the evaluation prompts."""
    from lit_rlhf.rollout import GenerationSettings

    results = {}
    for name, config in ppo_configs.items():
        init = config["model"]["init_args"]
        generation = GenerationSettings(**init.get("generation", {}))
        policies = {"ppo": f"{config['trainer']['callbacks'][0]['init_args']['dirpath']}/actor"}
        if name == "ppo":
            policies = {"sft": init["actor"]["name_or_path"], **policies}
        for policy, folder in policies.items():
            key = policy if name == "ppo" else name
            rows = evaluate.sample_policy(
                folder,
                eval_prompts,
                generation,
                reference_dir=init["actor"]["name_or_path"],
                reward_model_dir=init["reward_model"]["name_or_path"],
                batch_size=64 if small else 256,
            )
            results[key] = {"summary": evaluate.summarize(rows), "rows": rows}
    return results


def run(
    out: Path, *, small: bool = False, overoptimize: bool = True, seed: int = 0, process_start: float | None = None
) -> dict:
    """The whole demo into ``out``; returns the report dictionary (also written to ``out/report.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    start = time.perf_counter()
    if process_start is not None:  # python start-up and imports, when run as a command
        clock.stages["startup"] = start - process_start
        start = process_start
    manifest = clock.run("assets", build_or_reuse_assets, out / "assets", small, seed)
    runs = {stage: clock.run(stage, fit, stage, out, small) for stage in ("sft", "rm", "ppo")}
    if overoptimize:
        runs.update({stage: clock.run(stage, fit, stage, out, small) for stage in ("rm_weak", "ppo_overoptimize")})
    for name in [n for n in runs if n.startswith("ppo")]:
        max_new = runs[name]["config"]["model"]["init_args"]["generation"]["max_new_tokens"]
        if max_new < manifest["max_response_tokens"]:
            raise ValueError(
                f"configs/demo/{name}.yaml: generation.max_new_tokens={max_new} is below the longest "
                f"grammatical response ({manifest['max_response_tokens']} tokens with its EOS)"
            )

    def evaluate_all() -> dict:
        prompts = [r["prompt"] for r in evaluate.read_jsonl(out / "assets" / "prompts_eval.jsonl")]
        ppo_configs = {n: r["config"] for n, r in runs.items() if n.startswith("ppo")}
        results = evaluate_policies(out, ppo_configs, prompts, small)
        for name in [n for n in runs if n.startswith("rm")]:
            rm_dir = runs[name]["config"]["trainer"]["callbacks"][0]["init_args"]["dirpath"]
            results[name] = evaluate.evaluate_reward_model(rm_dir, out / "assets" / "prefs_val.jsonl")
        return results

    results = clock.run("evaluate", evaluate_all)
    summary = report.write_report(
        out,
        results=results,
        runs={name: {"log_dir": r["log_dir"], "config": r["config"]} for name, r in runs.items()},
        manifest=manifest,
        stage_wall_s=clock.stages,
        start_time=start,
    )
    print(report.console_summary(summary), flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument("--small", action="store_true", help="a miniature of every stage (tests)")
    parser.add_argument(
        "--overoptimize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the weak-RM, weak-KL over-optimisation demo (default: on; ~1.5 of the ~8 minutes)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the demo assets")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    process_start = _PROCESS_START if __name__ == "__main__" else None
    return run(
        Path(args.out), small=args.small, overoptimize=args.overoptimize, seed=args.seed, process_start=process_start
    )


if __name__ == "__main__":
    main()
