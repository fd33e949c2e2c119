"""The demo's over-optimisation sweep over fixed KL coefficients (lit_rlhf.demo.kl_sweep): its configs, the
shape read from its points (by hand), its report fields and plot, the pipeline's flag. The miniature pipeline
run with the flag is in tests/test_demo_pipeline.py."""

from __future__ import annotations

import pytest

from lit_rlhf.demo import kl_sweep, pipeline, stages
from lit_rlhf.demo.stages import StageRecord


def test_parse_coefs_takes_distinct_positive_numbers():
    assert kl_sweep.parse_coefs("0.1, 0.01,0.001") == [0.1, 0.01, 0.001]
    for text, message in (("0.1", "at least two"), ("0.1,0.1", "at least two distinct"), ("0.1,x", "'x' is not"),
                          ("0.1,0", "> 0, got '0'"), ("0.1,-1", "> 0"), ("0.1,nan", "finite")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            kl_sweep.parse_coefs(text)


def test_sweep_config_fixes_the_coefficient_and_names_the_run_by_coef_and_seed(tmp_path):
    base = stages.load_config(kl_sweep.BASE, tmp_path, small=False)
    base["model"]["init_args"]["kl"].update(target=3.0, horizon=100)  # an adaptive base: the sweep fixes it
    run, config = kl_sweep.sweep_config(base, 0.03, 2, tmp_path)
    assert run == "ppo_overoptimize_kl0.03_seed2" and kl_sweep.is_sweep_run(run)
    assert kl_sweep.run_name(0.003, 0) == "ppo_overoptimize_kl0.003"
    assert config["model"]["init_args"]["kl"] == {"coef": 0.03}
    assert config["seed_everything"] == 2 and config["model"]["init_args"]["rng_seed"] == 2
    assert config["trainer"]["logger"]["init_args"]["name"] == run
    assert stages.export_dir(config) == str(tmp_path / run)
    # everything else is the over-optimisation run's, and the base is left alone
    assert config["model"]["init_args"]["reward_model"] == base["model"]["init_args"]["reward_model"]
    assert config["model"]["init_args"]["actor_optimizer"] == base["model"]["init_args"]["actor_optimizer"]
    assert base["model"]["init_args"]["kl"]["target"] == 3.0


def _point(kl: float, gold: float, proxy: float) -> dict:
    return {"kl_ref": kl, "gold_mean": gold, "proxy_mean": proxy}


def test_sweep_shape_by_hand():
    sft = _point(0.0, -1.0, 0.5)
    # relative to SFT, in order of KL: gold 0, 4, 6, 2; proxy 0, 1, 2, 2.5; given out of order
    points = [_point(20.0, 1.0, 3.0), _point(2.0, 3.0, 1.5), _point(8.0, 5.0, 2.5)]
    assert kl_sweep.sweep_shape(points, sft) == {
        "proxy_rise": 2.5, "proxy_largest_drop": 0.0, "proxy_falls": False, "gold_peak": 6.0, "gold_peak_kl": 8.0,
        "gold_at_largest_kl": 2.0, "gold_drop_from_peak": 4.0, "peaks_and_falls": True,
    }  # fmt: skip
    # the proxy falls from KL 8 to KL 20 by 0.5: not the picture, whatever the gold does
    falling = [_point(20.0, 1.0, 2.5), _point(2.0, 3.0, 1.5), _point(8.0, 5.0, 3.0)]
    shape = kl_sweep.sweep_shape(falling, sft)
    assert shape["proxy_largest_drop"] == pytest.approx(0.5) and shape["proxy_falls"] is True
    assert shape["peaks_and_falls"] is False
    # the gold still rising at the largest KL, or below SFT everywhere (peak at KL 0): no peak and fall
    rising = [_point(2.0, 0.0, 1.0), _point(8.0, 2.0, 2.0)]
    assert kl_sweep.sweep_shape(rising, sft)["peaks_and_falls"] is False
    below = [_point(2.0, -2.0, 1.0), _point(8.0, -3.0, 2.0)]
    shape = kl_sweep.sweep_shape(below, sft)
    assert shape["gold_peak"] == 0.0 and shape["gold_peak_kl"] == 0.0 and shape["peaks_and_falls"] is False


def _noisy(point: dict) -> dict:
    return {**point, "gold_std": 2.0, "proxy_std": 1.0, "n_prompts": 100}


def test_sweep_shape_counts_a_fall_beyond_two_standard_errors_only():
    # proxy std 1 over 100 prompts at each point: a fall counts beyond 2 sqrt(1/100 + 1/100) = 0.283;
    # gold std 2: beyond 2 sqrt(4/100 + 4/100) = 0.566
    sft = _noisy(_point(0.0, 0.0, 0.0))
    within = [_noisy(_point(2.0, 3.0, 1.0)), _noisy(_point(8.0, 5.0, 2.0)), _noisy(_point(20.0, 1.0, 1.8))]
    shape = kl_sweep.sweep_shape(within, sft)
    assert shape["proxy_largest_drop"] == pytest.approx(0.2) and shape["proxy_falls"] is False
    assert shape["peaks_and_falls"] is True
    beyond = [*within[:2], _noisy(_point(20.0, 1.0, 1.6))]  # a fall of 0.4
    assert kl_sweep.sweep_shape(beyond, sft)["proxy_falls"] is True
    assert kl_sweep.sweep_shape(beyond, sft)["peaks_and_falls"] is False
    flat_gold = [*within[:2], _noisy(_point(20.0, 4.5, 2.5))]  # gold 0.5 under its peak: noise
    assert kl_sweep.sweep_shape(flat_gold, sft)["peaks_and_falls"] is False


def test_runs_at_the_same_kl_within_its_noise_have_no_order():
    """Two runs whose KLs differ by less than two standard errors lie at one KL: a proxy lower in the one with
    the (slightly) larger KL is no fall. Separated beyond the KL's noise, the same proxies are one."""
    sft = _noisy(_point(0.0, 0.0, 0.0))

    def at(kl, gold, proxy, kl_std):
        return {**_noisy(_point(kl, gold, proxy)), "kl_ref_std": kl_std}

    # KL std 5 over 100 prompts: two KLs differ beyond 2 sqrt(25/100 + 25/100) = 1.41 nats
    tied = [at(2.0, 3.0, 1.0, 5.0), at(13.0, 6.0, 2.4, 5.0), at(13.5, 5.0, 2.0, 5.0), at(20.0, 1.0, 2.5, 5.0)]
    shape = kl_sweep.sweep_shape(tied, {**sft, "kl_ref_std": 0.0})
    assert shape["proxy_falls"] is False and shape["proxy_largest_drop"] == 0.0
    assert shape["peaks_and_falls"] is True
    apart = [*tied[:2], at(16.0, 5.0, 2.0, 5.0), tied[3]]  # 3 nats apart: a fall of 0.4 > 0.283
    shape = kl_sweep.sweep_shape(apart, {**sft, "kl_ref_std": 0.0})
    assert shape["proxy_falls"] is True and shape["proxy_largest_drop"] == pytest.approx(0.4)


def test_a_decline_in_steps_within_noise_is_a_fall_beyond_it():
    """The proxy compared between every two points apart in KL, not only neighbours: a decline by steps of
    0.15 (each within 0.283) falls 0.45 from the first to the last point."""
    sft = _noisy(_point(0.0, 0.0, 0.0))
    steps = [_noisy(_point(kl, 4.0, proxy)) for kl, proxy in ((8.0, 2.0), (12.0, 1.85), (16.0, 1.7), (20.0, 1.55))]
    shape = kl_sweep.sweep_shape(steps, sft)
    assert shape["proxy_largest_drop"] == pytest.approx(0.45) and shape["proxy_falls"] is True


def _run(coef: float, seed: int, proxy: float, gold: float = 0.0) -> dict:
    return {**_noisy(_point(1.0, gold, proxy)), "coef": coef, "seed": seed}


def test_run_variance_by_hand():
    """Pooled across-seed variance of one coefficient's runs, less the mean evaluation variance."""
    points = [_run(0.1, 0, 1.0), _run(0.1, 1, 1.2), _run(0.01, 0, 2.0), _run(0.01, 1, 2.3), _run(0.01, 2, 2.6),
              _run(0.001, 0, 5.0)]  # fmt: skip
    # squares 0.02 (dof 1) + 0.18 (dof 2) = 0.2 / 3; each evaluation 1^2 / 100; the lone 0.001 run is no replicate
    assert kl_sweep.run_variance(points, "proxy_mean") == pytest.approx(0.2 / 3 - 0.01)
    bare = [{k: v for k, v in p.items() if k not in ("proxy_std", "gold_std")} for p in points]
    assert kl_sweep.run_variance(bare, "proxy_mean") == pytest.approx(0.2 / 3)
    assert kl_sweep.run_variance(points, "gold_mean") == 0.0  # no scatter beyond the evaluations': not below 0
    assert kl_sweep.run_variance([_run(0.1, 0, 1.0), _run(0.01, 0, 2.0)], "proxy_mean") == 0.0  # one seed


def test_run_variance_widens_the_noise_of_two_runs_and_of_a_run_against_sft():
    """Each trained point adds the run variance to a difference's variance; the SFT policy adds none."""
    sft = _noisy(_point(0.0, 0.0, 0.0))
    within = [_noisy(_point(2.0, 3.0, 1.0)), _noisy(_point(8.0, 5.0, 2.0))]
    beyond = [*within, _noisy(_point(20.0, 1.0, 1.6))]  # a fall of 0.4 > 0.283 between two runs
    assert kl_sweep.sweep_shape(beyond, sft)["proxy_falls"] is True
    # 2 sqrt(0.01 + 0.01 + 2 * 0.02) = 0.49 > 0.4
    assert kl_sweep.sweep_shape(beyond, sft, {"proxy": 0.02})["proxy_falls"] is False
    assert kl_sweep.sweep_shape(beyond, sft, {"proxy": 0.02})["peaks_and_falls"] is True
    # a first run 0.45 under SFT's proxy: the noise is 2 sqrt(0.01 + 0.01 + 0.02) = 0.4 (SFT is no run)
    under = [_noisy(_point(2.0, 3.0, -0.45)), _noisy(_point(8.0, 5.0, 2.0)), _noisy(_point(20.0, 1.0, 2.1))]
    shape = kl_sweep.sweep_shape(under, sft, {"proxy": 0.02})
    assert shape["proxy_falls"] is True and shape["proxy_largest_drop"] == pytest.approx(0.45)
    # the gold's fall from its peak: 4.0 against 2 sqrt(0.04 + 0.04 + 2 * 1.5) = 3.51, then 2 sqrt(0.08 + 2 * 2.5)
    rising = [*within, _noisy(_point(20.0, 1.0, 2.1))]
    assert kl_sweep.sweep_shape(rising, sft, {"gold": 1.5})["peaks_and_falls"] is True
    assert kl_sweep.sweep_shape(rising, sft, {"gold": 2.5})["peaks_and_falls"] is False


def test_the_evaluation_summary_has_the_kls_spread():
    from lit_rlhf.demo.evaluate import summarize

    rows = [
        {"gold": g, "proxy": None, "kl_ref": kl, "grammatical": True, "length": 3, "truncated": False}
        for g, kl in ((1.0, 2.0), (3.0, 6.0))
    ]
    summary = summarize(rows)
    assert summary["kl_ref"] == 4.0 and summary["kl_ref_std"] == 2.0 and "proxy_mean" not in summary


def _record(run: str, coef: float, seed: int) -> StageRecord:
    config = {"seed_everything": seed, "model": {"init_args": {"kl": {"coef": coef}}}}
    return StageRecord(run=run, key="k", config=config, log_dir="", wall_s=1.0)


def _summary(kl: float, gold: float, proxy: float) -> dict:
    summary = {"kl_ref": kl, "gold_mean": gold, "proxy_mean": proxy, "grammatical_rate": 0.9}
    return {"summary": {**summary, "gold_std": 0.1, "proxy_std": 0.1, "n_prompts": 1024, "truncated_rate": 0.0}}


def test_summary_fields_hold_every_point_and_a_shape_per_seed(tmp_path):
    runs = {kl_sweep.run_name(c, s): _record(kl_sweep.run_name(c, s), c, s) for c in (0.1, 0.01) for s in (0, 1)}
    runs["ppo"] = _record("ppo", 0.2, 0)
    results = {
        "ppo": _summary(3.0, 9.0, 9.0),
        kl_sweep.SFT_WEAK: _summary(0.0, 0.0, 0.0),
        "ppo_overoptimize_kl0.1": _summary(2.0, 3.0, 1.0),
        "ppo_overoptimize_kl0.01": _summary(9.0, 1.0, 2.0),
        "ppo_overoptimize_kl0.1_seed1": _summary(3.0, 2.0, 1.0),
        "ppo_overoptimize_kl0.01_seed1": _summary(8.0, 4.0, 2.0),
    }
    sweep = kl_sweep.summary_fields(results, runs)["overoptimize_sweep"]
    assert sorted((p["coef"], p["seed"]) for p in sweep["points"]) == [(0.01, 0), (0.01, 1), (0.1, 0), (0.1, 1)]
    assert sweep["sft"] == {"kl_ref": 0.0, "gold_mean": 0.0, "gold_std": 0.1, "proxy_mean": 0.0, "proxy_std": 0.1,
                            "grammatical_rate": 0.9, "n_prompts": 1024}  # fmt: skip
    # the two seeds of each coefficient end alike in proxy (run variance 0) and 1 apart (0.1) or 3 apart
    # (0.01) in gold: pooled variance (0.5 + 4.5) / 2 = 2.5, less the evaluation's 0.1^2 / 1024
    assert sweep["run_std"]["proxy"] == 0.0
    assert sweep["run_std"]["gold"] == pytest.approx((2.5 - 0.01 / 1024) ** 0.5)
    # seed 0's gold falls 2.0 from its peak: beyond evaluation noise, which the gold's fall is judged by (its
    # scatter across seeds is the collapse the check looks for); the proxy's scatter is 0 here
    seed0 = sweep["shape"]["0"]
    assert seed0["peaks_and_falls"] is True and seed0["gold_peak_kl"] == 2.0
    assert seed0["peaks_and_falls_evaluation_noise"] is True and seed0["proxy_falls_evaluation_noise"] is False
    assert sweep["shape"]["1"]["peaks_and_falls"] is False and sweep["shape"]["1"]["gold_peak"] == 4.0
    assert sweep["shape"]["1"]["peaks_and_falls_evaluation_noise"] is False
    assert kl_sweep.summary_fields({"ppo": results["ppo"]}, {"ppo": runs["ppo"]}) == {}
    kl_sweep.plot_sweep(sweep, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0
    summary = {"overoptimize_sweep": sweep}
    assert len(kl_sweep.console_lines(summary)) == 2
    assert "-> peaks and falls (yes with evaluation noise alone)" in kl_sweep.console_lines(summary)[0]
    lines = kl_sweep.report_lines(summary)
    assert "coef 0.1: KL 2.0, gold +3.00, proxy +1.00; coef 0.01: KL 9.0" in lines[1]
    assert "within evaluation noise alone, the picture by that bound): peaks and falls while the proxy rises." in lines[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--no-overoptimize", "--kl-sweep", "0.1,0.01"], "--kl-sweep adds to the over-optimisation demo"),
        (["--kl-sweep", "0.1,-0.01"], "every KL coefficient must be a finite number > 0"),
        (["--kl-sweep", "0.1"], "at least two distinct coefficients"),
    ],
)
def test_kl_sweep_usage_errors(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["--out", str(tmp_path / "demo"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

