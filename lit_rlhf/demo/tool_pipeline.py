"""The tool world's demo, end to end: assets -> SFT -> GRPO with and without the calculator -> evaluation -> report.

    python -m lit_rlhf.demo.tool_pipeline --out runs/demo/tool [--seeds N|S1,S2,...] [--reuse] [--small]
        [--threads N]

1. builds the assets into ``OUT/assets`` (:mod:`lit_rlhf.demo.tool_assets`; reused when built before with the
   same arguments);
2. runs the fits through the CLI (``lit-rlhf fit --config OUT/configs/<run>.yaml``, each config being
   ``configs/demo/tool_<stage>.yaml`` with its ``runs/demo/tool/`` paths moved under ``OUT``): SFT from
   scratch, then per training seed of ``--seeds`` GRPO with the calculator environment (``grpo_tool``) and
   GRPO without it (``grpo_no_tool``), both from the SFT policy with the same exact-match reward;
3. evaluates the SFT policy and every GRPO policy on the held-out problems, with the tool and without
   (:mod:`lit_rlhf.demo.tool_evaluate`);
4. writes ``OUT/report.json``, ``OUT/report.md``, ``OUT/samples.md`` and ``OUT/tool_world.png``
   (:mod:`lit_rlhf.demo.tool_report`).

The target (issue 25): over the seeds, the mean accuracy of GRPO with the tool (evaluated with the tool) is
at least twice the SFT policy's (also evaluated with the tool) and above GRPO without the tool's (evaluated
without it, as it was trained). Seed 0's runs are named ``grpo_tool`` and ``grpo_no_tool``, seed s > 0's
``<name>_seed<s>``. ``make demo`` runs one seed; ``--seeds 3`` the comparison of the README.
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before the heavy imports below: they are part of the wall time

import argparse  # noqa: E402
import json  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

from lit_rlhf.callbacks import check_output_folder  # noqa: E402
from lit_rlhf.demo import tool_assets, tool_evaluate, tool_report  # noqa: E402
from lit_rlhf.demo.pipeline import parse_seeds, parse_threads  # noqa: E402
from lit_rlhf.demo.stages import CONFIG_DIR, StageRecord, StageRunner, merge  # noqa: E402

ROOT = "runs/demo/tool/"  # the prefix of every path in configs/demo/tool_*.yaml
ALGORITHMS = {"grpo_tool": "tool_grpo", "grpo_no_tool": "tool_grpo_no_tool"}  # run name -> config name
_TINY_GRPO = {"model": {"init_args": {"max_rollouts": 2, "generation": {"num_samples": 2}}},
              "data": {"init_args": {"batch_size": 4}}}  # fmt: skip
SMALL_OVERRIDES: dict[str, dict[str, Any]] = {  # --small: a miniature of every stage (tests)
    "tool_sft": {
        "trainer": {"max_steps": 4, "val_check_interval": 2, "log_every_n_steps": 1, "enable_model_summary": False},
        "model": {"init_args": {"num_samples": 2, "model": {"config": {"num_hidden_layers": 1, "hidden_size": 32,
                                                                         "intermediate_size": 64}}}},
        "data": {"init_args": {"batch_size": 16, "val_batch_size": 16}},
    },  # fmt: skip
    "tool_grpo": _TINY_GRPO,
    "tool_grpo_no_tool": _TINY_GRPO,
}


def move_paths(node: Any, out: Path) -> Any:
    """Every string ``runs/demo/tool/X`` of a config becomes ``OUT/X``."""
    if isinstance(node, dict):
        return {k: move_paths(v, out) for k, v in node.items()}
    if isinstance(node, list):
        return [move_paths(v, out) for v in node]
    if isinstance(node, str) and node.startswith(ROOT):
        return str(out / node[len(ROOT) :])
    return node


def load_config(name: str, out: Path, small: bool) -> dict:
    """``configs/demo/<name>.yaml`` with its paths under ``out`` (and tiny sizes if ``small``)."""
    config = move_paths(yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text()), out)
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"].endswith("HFExport"):  # a rerun of the pipeline replaces its own exports
            callback["init_args"]["overwrite"] = True
    return merge(config, SMALL_OVERRIDES.get(name, {})) if small else config


def grpo_config(name: str, seed: int, out: Path, small: bool) -> tuple[str, dict]:
    """Run name and config of ``name`` (a key of :data:`ALGORITHMS`) with training seed ``seed``."""
    config = load_config(ALGORITHMS[name], out, small)
    run = name if seed == 0 else f"{name}_seed{seed}"
    config["seed_everything"] = seed
    config["model"]["init_args"]["rng_seed"] = seed
    config["trainer"]["logger"]["init_args"]["name"] = run
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("HFExport"):
            callback["init_args"]["dirpath"] = str(out / run)
    return run, config


def check_configs(configs: dict[str, dict]) -> None:
    """The GRPO configs sample as the evaluation does (:mod:`lit_rlhf.demo.tool_evaluate`): its temperature,
    its turn length and, with the tool, its episode settings; both runs sample as many responses."""
    for name, config in configs.items():
        init, where = config["model"]["init_args"], f"configs/demo/{ALGORITHMS[name]}.yaml"
        tool = name == "grpo_tool"
        episode, turn = tool_evaluate.episode_settings(tool)
        generation = init.get("generation", {})
        if generation.get("temperature") != turn.temperature or generation.get("max_new_tokens") != turn.max_new_tokens:
            raise ValueError(
                f"{where}: generation {generation} must sample at temperature {turn.temperature} with max_new_tokens"
                f" {turn.max_new_tokens}, as the evaluation does (tool_evaluate.episode_settings)"
            )
        env = init.get("environment")
        expected = {k: v for k, v in episode.as_dict().items() if k != "kwargs"} if tool else None
        if (None if env is None else {k: v for k, v in env.items() if k != "kwargs"}) != expected:
            raise ValueError(f"{where}: environment {env} differs from the evaluation's {expected}")
    counts = {name: c["model"]["init_args"]["max_rollouts"] * c["data"]["init_args"]["batch_size"] for name, c in configs.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"the GRPO runs must see as many prompts (max_rollouts x batch_size); they see {counts}")


def build_or_reuse_assets(folder: Path, small: bool, seed: int) -> dict:
    """The assets in ``folder``, built unless a manifest with the same arguments is there."""
    sizes = dict(tool_assets.SMALL) if small else {}
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        defaults = tool_assets.build_tool_assets.__kwdefaults__
        if manifest["args"] == {**defaults, **sizes, "seed": seed}:
            print(f"=== assets: reusing {folder}", flush=True)
            return manifest
    print(f"=== assets: building {folder}", flush=True)
    manifest_path.unlink(missing_ok=True)  # an interrupted build must leave no manifest to reuse
    tool_assets.build_tool_assets(folder, seed=seed, **sizes)
    return json.loads(manifest_path.read_text())


def run_stages(runner: StageRunner, out: Path, small: bool, seeds: list[int], manifest: dict) -> dict[str, list[StageRecord]]:
    """SFT, then both GRPO runs per seed (in seed order); returns the records of each GRPO run name."""
    runner.fit("sft", load_config("tool_sft", out, small), salt=json.dumps(manifest["args"], sort_keys=True))
    configs = {(name, seed): grpo_config(name, seed, out, small) for seed in seeds for name in ALGORITHMS}
    check_configs({name: config for (name, _), (_, config) in configs.items()})
    runs: dict[str, list[StageRecord]] = {name: [] for name in ALGORITHMS}
    for (name, _), (run, config) in configs.items():
        runs[name].append(runner.fit(run, config, ("sft",)))
    return runs


def evaluate_all(out: Path, runs: dict[str, list[StageRecord]], small: bool) -> dict[str, dict]:
    """Every policy's episodes and summary on the held-out problems, with the tool and without."""
    problems = tool_evaluate.read_problems(out / "assets" / "prompts_eval.jsonl")
    policies = {"sft": out / "sft"}
    policies.update({record.run: out / record.run / "actor" for records in runs.values() for record in records})
    results: dict[str, dict] = {}
    for key, folder in policies.items():
        results[key] = {}
        for setting in tool_evaluate.SETTINGS:
            rows = tool_evaluate.evaluate_policy(folder, problems, tool=setting == "tool", batch_size=64 if small else 256)
            results[key][setting] = {"summary": tool_evaluate.summarize(rows), "rows": rows}
    return results


def run(out: Path, *, small: bool = False, seed: int = 0, seeds: Sequence[int] = (0,), reuse: bool = False,
        process_start: float | None = None) -> dict:  # fmt: skip
    """The whole tool-world demo into ``out``; returns the report dictionary (also ``out/report.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    wall: dict[str, float] = {}
    if process_start is not None:  # python start-up and imports, when run as a command
        wall["startup"], start = start - process_start, process_start
    stage_start = time.perf_counter()
    manifest = build_or_reuse_assets(out / "assets", small, seed)
    wall["assets"] = time.perf_counter() - stage_start
    runner = StageRunner(out, reuse=reuse)
    runs = run_stages(runner, out, small, list(seeds), manifest)
    wall.update({name: record.wall_s for name, record in runner.records.items()})
    stage_start = time.perf_counter()
    results = evaluate_all(out, runs, small)
    wall["evaluate"] = time.perf_counter() - stage_start
    summary = tool_report.write_report(out, results=results, runs=runs, records=runner.records, manifest=manifest,
                                       stage_wall_s=wall, start_time=start)  # fmt: skip
    print(tool_report.console_summary(summary), flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo/tool", help="output folder (default runs/demo/tool)")
    parser.add_argument("--small", action="store_true", help="a miniature of every stage (tests)")
    parser.add_argument("--seeds", type=parse_seeds, default=[0],
                        help="training seeds of both GRPO runs: a count N (seeds 0..N-1) or a list 0,3,7 (default 1)")
    parser.add_argument("--reuse", action="store_true",
                        help="skip fits recorded in OUT/stages.json with the same config and inputs (e.g. SFT)")
    parser.add_argument("--threads", type=parse_threads, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the assets")
    args = parser.parse_args(argv)  # fmt: skip
    try:  # an output folder that cannot be written fails now, not after the first stage
        check_output_folder(args.out, "--out")
    except OSError as err:
        parser.error(str(err))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    process_start = _PROCESS_START if __name__ == "__main__" else None
    return run(Path(args.out), small=args.small, seed=args.seed, seeds=args.seeds, reuse=args.reuse,
               process_start=process_start)  # fmt: skip


if __name__ == "__main__":
    main()
