"""The demo's stage bookkeeping (``--reuse``), asset manifests, seed lists and machine records, with the fits
replaced by a stand-in that only creates the export folder (no training: each test takes well under a second)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from lit_rlhf.demo import (
    assets,
    ensemble_runs,
    kl_sweep,
    overoptimization,
    pipeline,
    report,
    stages,
    tool_assets,
    tool_pipeline,
    tool_report,
)
from lit_rlhf.demo.stages import StageRecord, StageRunner


def _stand_in_posterior(out: Path, small: bool = False, covariance: torch.Tensor | None = None) -> None:
    """A posterior folder read_posterior accepts (its reward model: the folder itself), of ``covariance``."""
    from safetensors.torch import save_file

    folder = out / ensemble_runs.POSTERIOR
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"format": "lit_rlhf.last_layer_posterior", "reward_model": ".", "score_std": 1.0, "width_mean": 1.0}
    (folder / "posterior.json").write_text(json.dumps(manifest))
    save_file({"covariance": torch.eye(3, dtype=torch.float64) if covariance is None else covariance},
              str(folder / "covariance.safetensors"))  # fmt: skip


@pytest.fixture
def fits(monkeypatch) -> list[str]:
    """Fits replaced by a stand-in that creates the export folder; returns the runs fitted, in order."""
    fitted: list[str] = []

    def fake_fit(path: Path) -> float:
        config = yaml.safe_load(Path(path).read_text())
        Path(stages.export_dir(config)).mkdir(parents=True, exist_ok=True)
        fitted.append(Path(path).stem)
        return 1.0

    monkeypatch.setattr(stages, "fit_here", fake_fit)
    monkeypatch.setattr(stages, "fit_in_child", fake_fit)
    # the disagreement ensemble's texts are sampled from the SFT export, which a stand-in fit does not write
    monkeypatch.setattr(ensemble_runs, "write_disagreement_texts", lambda out, n: None)
    monkeypatch.setattr(ensemble_runs, "write_posterior", _stand_in_posterior)  # nor the weak RM's
    return fitted


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _book(out: Path) -> dict:
    return json.loads((out / "stages.json").read_text())


# 1. an interrupted re-run leaves nothing that --reuse could take for the stage's outputs


def test_a_stage_that_starts_again_loses_its_record_logs_curve_and_memory_first(tmp_path, fits, monkeypatch):
    out = tmp_path / "demo"
    config = stages.load_config("sft", out, small=True)
    StageRunner(out).fit("sft", config)
    log_dir = Path(config["trainer"]["logger"]["init_args"]["save_dir"]) / "sft"
    for path in (out / "curves" / "sft.json", out / "memory" / "sft.json", log_dir / "events"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    (out / "curves" / "ppo.json").write_text("{}")  # another run's: kept

    def interrupted(path):
        # what the fit sees when it starts: no record of the stage, none of its old outputs
        assert "sft" not in _book(out)
        assert not (out / "curves" / "sft.json").exists() and not (out / "memory" / "sft.json").exists()
        assert not log_dir.exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "fit_here", interrupted)
    with pytest.raises(KeyboardInterrupt):
        StageRunner(out).fit("sft", config)
    assert "sft" not in _book(out) and (out / "curves" / "ppo.json").exists()
    assert (out / "sft").is_dir()  # the old export is still there, but nothing says it is the stage's

    fitted = []
    monkeypatch.setattr(stages, "fit_here", lambda path: fitted.append(path))
    record = StageRunner(out, reuse=True).fit("sft", config)
    assert not record.reused and len(fitted) == 1


# 2. an interrupted asset build leaves no manifest


def test_an_interrupted_asset_build_leaves_no_manifest_to_reuse(tmp_path, monkeypatch):
    folder = tmp_path / "assets"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"args": {"seed": 0}}))

    def interrupted(*args, **kwargs):
        assert not (folder / "manifest.json").exists()  # gone before the first file is written
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        assets.build_assets(folder, seed=1, **assets.SMALL)
    assert not (folder / "manifest.json").exists()

    (folder / "manifest.json").write_text(json.dumps({"args": {"seed": 0}}))
    monkeypatch.setattr(tool_assets, "_write_jsonl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tool_assets.build_tool_assets(folder, seed=1, **tool_assets.SMALL)
    assert not (folder / "manifest.json").exists()


@pytest.mark.parametrize("module, builder", [(pipeline, (assets, "build_assets")),
                                             (tool_pipeline, (tool_assets, "build_tool_assets"))])  # fmt: skip
def test_the_pipelines_drop_an_old_manifest_before_building(module, builder, tmp_path, monkeypatch):
    folder = tmp_path / "assets"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"args": {"seed": 7}}))  # other arguments: a rebuild

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    interrupted.__kwdefaults__ = getattr(*builder).__kwdefaults__  # the tool pipeline compares with them
    monkeypatch.setattr(*builder, interrupted)
    with pytest.raises(KeyboardInterrupt):
        module.build_or_reuse_assets(folder, small=True, seed=0)
    assert not (folder / "manifest.json").exists()


# 3. the first seed: in increasing order, and every ppo_* key from the same run


def test_seeds_are_sorted_so_the_first_seed_is_the_smallest():
    assert pipeline.parse_seeds("1,0") == [0, 1]
    assert pipeline.parse_seeds("7,0,5") == [0, 5, 7]
    with pytest.raises(argparse.ArgumentTypeError, match="distinct"):
        pipeline.parse_seeds("1,0,1")


def test_the_ppo_keys_all_come_from_ppo_first_run():
    def record(run, seed):
        init = {"kl": {"target": 1.0}, "generation": {"max_new_tokens": 30 + seed}}
        return StageRecord(run, "k", {"seed_everything": seed, "model": {"init_args": init}}, "", 0.0)

    runs = {"ppo": [record("ppo_seed1", 1), record("ppo", 0)]}  # whatever the order, the first one
    results = {"ppo_seed1": {"summary": {"gold_mean": 1.0, "kl_ref": 5.0}}, "ppo": {"summary": {"gold_mean": 2.0, "kl_ref": 3.0}}}
    algorithms = {"ppo": {"seeds": [{"run": "ppo", "gold_lift_sft_std": 0.2}, {"run": "ppo_seed1", "gold_lift_sft_std": 0.1}]}}
    fields = report.ppo_fields(results, runs, algorithms)
    assert fields["ppo_run"] == "ppo_seed1" and fields["ppo_gold_mean"] == 1.0 and fields["gold_lift_sft_std"] == 0.1
    assert fields["max_new_tokens"] == 31 and fields["ppo_within_kl_budget"] is (5.0 <= report.KL_BUDGET)
    assert report.ppo_fields(results, {"grpo": runs["ppo"]}, algorithms) == {}


# 4. --ensemble: every reward source over the requested seeds, and seed 0 among them


def test_sources_summary_keeps_the_requested_seeds_only():
    def record(run, seed):
        return StageRecord(run, "k", {"seed_everything": seed}, "", 0.0)

    names = ["ppo_overoptimize", "ppo_overoptimize_seed1", "ppo_overoptimize_ensemble_seed1"]
    runs = {run: record(run, int(run.endswith("seed1"))) for run in names}
    results = {"sft": {"summary": {"gold_mean": 0.0, "gold_std": 2.0}}}
    results.update({run: {"summary": {"gold_mean": 1.0, "kl_ref": 1.0, "grammatical_rate": 1.0}} for run in names})
    sources = overoptimization.sources_summary(results, runs, seeds=[1])["overoptimize_sources"]
    assert [r["seed"] for r in sources["single"]["seeds"]] == [1] == [r["seed"] for r in sources["finetune_ensemble"]["seeds"]]
    assert [r["seed"] for r in overoptimization.sources_summary(results, runs)["overoptimize_sources"]["single"]["seeds"]] == [0, 1]


def test_ensemble_without_seed_0_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline, "run", lambda *args, **kwargs: pytest.fail("the demo must not start"))
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["--out", str(tmp_path / "demo"), "--small", "--ensemble", "--seeds", "1,2"])
    assert exit_info.value.code == 2
    assert "--ensemble needs seed 0 among --seeds" in capsys.readouterr().err


# 5. the threads and CPU of every stage, reused ones included


def test_records_keep_threads_and_cpu_and_the_report_flags_a_mixture(tmp_path, fits, threads):
    out = tmp_path / "demo"
    torch.set_num_threads(2)
    StageRunner(out).fit("sft", stages.load_config("sft", out, small=True))
    assert _book(out)["sft"]["threads"] == 2 and _book(out)["sft"]["cpu"] == stages.cpu_model()
    torch.set_num_threads(1)
    runner = StageRunner(out, reuse=True)
    sft = runner.fit("sft", stages.load_config("sft", out, small=True))
    rm = runner.fit("rm", stages.load_config("rm", out, small=True), ("sft",))
    assert (sft.reused, sft.threads, rm.reused, rm.threads) == (True, 2, False, 1)

    current = {**report.machine(), "threads": 1}
    record = report.stage_machine(runner.records, current)
    assert record["threads_per_stage"] == {"sft": 2, "rm": 1} and record["cpu_per_stage"]["rm"] == current["cpu"]
    assert record["note"] == "stages ran with different thread counts (this run: 1): 2: sft; 1: rm"
    assert any("Mixed machine settings" in line for line in report.machine_line({**current, **record}))
    summary = {"reused_stages": ["sft"], "wall_s_per_stage": {"assets": 1.0, "sft": 2.0, "rm": 3.0}, "wall_s": 6.0,
               "machine": {**current, **record}}  # fmt: skip
    assert report.wall_table(summary)[2:5] == ["| assets | 1.0 |  |", "| sft | 2.0 (reused) | 2 |", "| rm | 3.0 | 1 |"]
    assert report.stage_machine({"rm": rm}, current)["note"] is None  # all as this run: nothing to flag
    old = StageRecord("x", "k", {}, "", 0.0)  # a record from before threads were kept
    assert "unknown: x" in report.stage_machine({"x": old}, current)["note"]
    assert _book(out)["rm"]["float_path"] == "" and rm.float_path == ""  # no variable forces a code path here


def test_a_forced_math_code_path_is_recorded_and_a_mixture_flagged(monkeypatch):
    from lit_rlhf.demo.machine import FLOAT_PATH_VARIABLES

    for name in FLOAT_PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = report.machine()
    assert plain["float_path"] == "" and "forced" not in report.machine_line(plain)[0]
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("MKL_CBWR", "")  # set but empty: not forced
    forced = report.machine()
    assert forced["float_path"] == "MKL_ENABLE_INSTRUCTIONS=AVX2"
    assert ", code path forced by MKL_ENABLE_INSTRUCTIONS=AVX2, with " in report.machine_line(forced)[0]

    def record(run: str, path: str | None) -> StageRecord:
        return StageRecord(run, "k", {}, "", 0.0, threads=forced["threads"], cpu=forced["cpu"], float_path=path)

    same = report.stage_machine({"sft": record("sft", "MKL_ENABLE_INSTRUCTIONS=AVX2")}, forced)
    assert same["note"] is None and same["float_path_per_stage"] == {"sft": "MKL_ENABLE_INSTRUCTIONS=AVX2"}
    mixed = report.stage_machine({"sft": record("sft", ""), "rm": record("rm", "MKL_ENABLE_INSTRUCTIONS=AVX2")}, forced)
    assert mixed["note"] == (
        "stages ran on different forced code paths (this run: MKL_ENABLE_INSTRUCTIONS=AVX2):"
        " none forced: sft; MKL_ENABLE_INSTRUCTIONS=AVX2: rm"
    )
    assert report.stage_machine({"sft": record("sft", "")}, plain)["note"] is None
    old = report.stage_machine({"sft": record("sft", None)}, plain)["note"]  # a record from before the path was kept
    assert old == "stages ran on different forced code paths (this run: none forced): unknown: sft"


# 6. the key does not depend on how --out is spelt


def test_reuse_across_spellings_of_out(tmp_path, fits, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def run_sft_and_rm(out: Path) -> list[bool]:
        runner = StageRunner(out, reuse=True)
        sft = runner.fit("sft", stages.load_config("sft", out, small=True), salt="assets")
        rm = runner.fit("rm", stages.load_config("rm", out, small=True), ("sft",))
        return [sft.reused, rm.reused]

    assert run_sft_and_rm(Path("demo")) == [False, False]
    for spelling in ("demo", "./demo", "demo/", str(tmp_path / "demo"), str(tmp_path / "demo") + "/"):
        assert run_sft_and_rm(Path(spelling)) == [True, True], spelling
    assert fits == ["sft", "rm"]


def test_keys_recorded_before_the_placeholder_are_still_reused(tmp_path, fits, monkeypatch):
    """A stages.json of an older version (keys hash --out as spelt, e.g. make demo's runs/demo) is reused."""
    monkeypatch.chdir(tmp_path)
    out = Path("demo")
    sft, rm = stages.load_config("sft", out, small=True), stages.load_config("rm", out, small=True)

    def old_key(config, salt=""):
        return hashlib.sha256((yaml.safe_dump(config, sort_keys=True) + salt).encode()).hexdigest()[:16]

    sft_key = old_key(sft, "assets")
    book = {"sft": {"run": "sft", "key": sft_key, "config": sft, "log_dir": "tb/sft", "wall_s": 1.0},
            "rm": {"run": "rm", "key": old_key(rm, sft_key), "config": rm, "log_dir": "tb/rm", "wall_s": 1.0}}  # fmt: skip
    out.mkdir()
    (out / "stages.json").write_text(json.dumps(book))
    (out / "sft").mkdir()
    (out / "rm").mkdir()
    runner = StageRunner(out, reuse=True)
    assert runner.fit("sft", sft, salt="assets").reused and runner.fit("rm", rm, ("sft",)).reused
    assert fits == []
    assert StageRunner(out, reuse=True).fit("sft", sft, salt="other assets").reused is False


# 7. --ensemble's extra SFT backbones re-run when the assets change


def test_ensemble_sft_backbones_rerun_when_the_assets_change(tmp_path, fits):
    out = tmp_path / "demo"

    def run(seed: int) -> set[str]:
        """The pipeline's stages (no algorithm) with assets of ``seed``; returns the runs reused."""
        manifest = {"args": {**assets.SMALL, "seed": seed}, "max_response_tokens": 1}
        runner = StageRunner(out, reuse=True)
        pipeline.run_stages(runner, out, True, [], [0], True, manifest, ensemble=tuple(ensemble_runs.SOURCES))
        return {name for name, record in runner.records.items() if record.reused}

    assert run(0) == set()
    assert "sft_seed1" in run(0) and "rm_weak_sft2" in run(0)
    assert run(1) == set()  # new assets: every stage again, the extra backbones included


def test_posterior_runs_refit_when_the_posterior_changes(tmp_path, fits, monkeypatch):
    """The posterior's PPO runs have the same inputs (SFT, weak RM) whatever the posterior holds: its covariance's
    digest is in their key, so a posterior written another way refits them on --reuse (and only them); rounded to 6
    digits, so one refit with another thread count (1e-12 apart) does not."""
    out, covariance = tmp_path / "demo", torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)

    def write(out: Path, small: bool = False) -> None:
        _stand_in_posterior(out, small, covariance)

    monkeypatch.setattr(ensemble_runs, "write_posterior", write)

    def refitted() -> set[str]:
        manifest = {"args": {**assets.SMALL, "seed": 0}, "max_response_tokens": 1}
        runner = StageRunner(out, reuse=True)
        pipeline.run_stages(runner, out, True, [], [0], True, manifest, ensemble=tuple(ensemble_runs.SOURCES))
        return {name for name, record in runner.records.items() if not record.reused}

    assert "ppo_overoptimize_posterior" in refitted()
    assert refitted() == set()
    covariance = covariance * (1 + 1e-12)  # fit again with another thread count: float rounding only
    assert refitted() == set()
    covariance = covariance * torch.tensor([[1.0, 1.001], [1.001, 1.0]], dtype=torch.float64)  # another posterior
    assert refitted() == {"ppo_overoptimize_posterior"}


def test_ensemble_sources_pick_what_is_fit(tmp_path, fits):
    """--ensemble posterior fits the posterior's runs beside the single weak RM's on every seed, and none of the
    ensembles' members or runs; a second call adding a source fits that source's stages only."""
    out = tmp_path / "demo"
    manifest = {"args": {**assets.SMALL, "seed": 0}, "max_response_tokens": 1}
    sources = pipeline.parse_ensemble("posterior")
    assert sources == ("single", "posterior")
    pipeline.run_stages(StageRunner(out, reuse=True), out, True, [], [0, 1], True, manifest, ensemble=sources)
    assert fits == ["sft", "rm", "rm_weak", "ppo_overoptimize", "ppo_overoptimize_posterior",
                    "ppo_overoptimize_seed1", "ppo_overoptimize_posterior_seed1"]  # fmt: skip
    fits.clear()
    sources = pipeline.parse_ensemble("finetune_ensemble,posterior")
    pipeline.run_stages(StageRunner(out, reuse=True), out, True, [], [0, 1], True, manifest, ensemble=sources)
    assert fits == ["rm_weak_ensemble", "ppo_overoptimize_ensemble", "ppo_overoptimize_ensemble_seed1"]


@pytest.mark.parametrize(
    "text, message",
    [("posterior,nope", "unknown reward source\\(s\\) \\['nope'\\]"), ("", "unknown"), (",", "unknown"),
     ("single,all", "`all` is every source and stands alone")],
)  # fmt: skip
def test_unknown_ensemble_sources_are_refused(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"--ensemble: {message}"):
        pipeline.parse_ensemble(text)


def test_ensemble_sources_on_the_command_line(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(pipeline, "run", lambda out, **kwargs: seen.update(kwargs))
    pipeline.main(["--out", str(tmp_path), "--ensemble", "posterior,single", "--seeds", "2"])
    assert seen["ensemble"] == ("single", "posterior")
    pipeline.main(["--out", str(tmp_path), "--ensemble", "--seeds", "2"])
    assert seen["ensemble"] == tuple(ensemble_runs.SOURCES)
    pipeline.main(["--out", str(tmp_path)])
    assert seen["ensemble"] == ()
    with pytest.raises(SystemExit):
        pipeline.main(["--out", str(tmp_path), "--ensemble", "disagreement"])


# 8. --kl-sweep coefficients must give distinct run names


def test_kl_sweep_coefficients_sharing_a_run_name_are_refused():
    with pytest.raises(ValueError, match=r"0\.1 and 0\.1000001 would both be run 'ppo_overoptimize_kl0\.1'"):
        kl_sweep.parse_coefs("0.1,0.1000001")
    assert kl_sweep.parse_coefs("0.1,0.100001") == [0.1, 0.100001]  # 6 significant digits tell them apart
    with pytest.raises(argparse.ArgumentTypeError, match="would both be run"):
        pipeline.parse_kl_sweep("0.01,0.0100000001")


# 9. the tool world's report: the machine, and the per-seed wall time named as such


def test_tool_report_records_the_machine_and_names_the_wall_time(tmp_path):
    def rows(correct: bool) -> list[dict]:
        return [{"kind": kind, "correct": correct, "tool_calls": 1, "tool_errors": 0, "turns": 2, "calls_written": True,
                 "prompt": "1+2=", "answer": 3, "response": "3"} for kind in ("sum", "product")]  # fmt: skip

    def result(correct: bool) -> dict:
        from lit_rlhf.demo import tool_evaluate

        return {s: {"summary": tool_evaluate.summarize(rows(correct)), "rows": rows(correct)} for s in tool_evaluate.SETTINGS}

    log_dir = tmp_path / "tb"  # no events: empty curves
    log_dir.mkdir()
    records = {run: StageRecord(run, "k", {"seed_everything": 0}, log_dir, 12.0) for run in ("sft", "grpo_tool", "grpo_no_tool")}
    records["sft"].threads = 1
    runs = {"grpo_tool": [records["grpo_tool"]], "grpo_no_tool": [records["grpo_no_tool"]]}
    results = {"sft": result(False), "grpo_tool": result(True), "grpo_no_tool": result(False)}
    summary = tool_report.write_report(tmp_path, results=results, runs=runs, records=records, manifest={"args": {}},
                                       stage_wall_s={"sft": 12.0}, start_time=0.0)  # fmt: skip
    machine = summary["machine"]
    assert machine["cpu"] and machine["threads"] == torch.get_num_threads() and machine["torch"] == torch.__version__
    assert machine["threads_per_stage"] == {"sft": 1, "grpo_tool": None, "grpo_no_tool": None}
    assert json.loads((tmp_path / "report.json").read_text())["machine"] == machine
    assert summary["algorithms"]["grpo_tool"]["seeds"][0]["wall_s"] == 12.0
    report_md = (tmp_path / "report.md").read_text()
    assert "| run | seed | with the tool | without | wall s |" in report_md and "train s" not in report_md
    assert "- Measured on " in report_md
