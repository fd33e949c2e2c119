"""Faults under data parallelism: SIGTERM and one rank's non-finite rewards, 2 CPU processes (DDP, gloo).

Every run is ``tests/faults_worker.py`` under ``torch.distributed.run --standalone --nproc_per_node=2``: a
tiny PPO fit of 4 sampled rollouts (4 prompts per rank) with a SigtermCheckpoint; each rank reports its
exit status, error, rollouts done and a digest of its trainable weights in a JSON file (also as the fit
stops on an exception), rank 0's metrics are in a CSV file. Every launch has a timeout, so a hang fails.

* SIGTERM, (a) to the torchrun launcher (it forwards the signal to both workers) while rank 0 waits at
  the start of rollout 2 and rank 1 is inside that rollout's collectives, and (b) to rank 1's process
  only (its pid file) while it waits at the start of rollout 2 and rank 0 is inside the collectives:
  both ranks finish rollout 2 and exit 143 (torchrun non-zero); one ``last-sigterm.ckpt`` is written,
  holding the step, rollout count and weights both ranks had (equal digests); a fit with
  ``ckpt_path="last"`` resumes it and its 2 rollouts complete the metrics and the final weights of the
  uninterrupted 2-rank run. Before the fix in ``SigtermCheckpoint`` (Lightning's SIGTERM handler runs a
  broadcast inside the handler) (a) ended with rank 0 stuck until torchrun's SIGKILL and (b) hung.
* A reward NaN on rank 1 only (2 of its 4 rows in rollout 2): under ``scoring.on_nonfinite='raise'``
  rank 1 raises NonFiniteError naming the rows and rank 0 the "on another rank" NonFiniteError, both in
  rollout 2, and torchrun exits non-zero; under ``'drop'`` the fit completes, ``rollout/nonfinite_scores``
  reads 2 (the rows of all ranks, logged once) in rollout 2 only, and both ranks end with the same
  optimiser step count and identical weights.

Marked ``distributed``, part of ``make test`` (alone: ``pytest -m distributed
tests/test_distributed_faults.py``); about a minute: 7 launches of ~8 s.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults_worker import weights_digest
from ppo_helpers import PROMPTS

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "faults_worker.py"
TOL = 1e-4
KEYS = ("rollout/score", "rollout/kl_ref", "ppo/policy_loss", "ppo/value_loss", "rollout/nonfinite_scores")
TIMEOUT = 150  # seconds per launch: a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """24 prompts: 3 rollouts per epoch at 4 per rank, so rollout 2 is inside an epoch."""
    path = tmp_path_factory.mktemp("faults_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{PROMPTS[i % 8]} {i}"}) + "\n" for i in range(24)))
    return path


def start(tokenizer_dir: str, prompts: Path, out: Path, name: str, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
        "--tokenizer", tokenizer_dir, "--prompts", str(prompts), "--out", str(out), "--name", name, *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # a session of its own: a hung launch is killed with its workers
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, what: str, timeout: float = TIMEOUT) -> str:
    """Wait for the launch; its stdout + stderr. Past ``timeout`` (a hang), kill it and fail."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: kill them by pid (they hold the pipes
        # open), then the launcher's session
        for pid_file in out.glob("pid_rank*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"{what}: no exit within {timeout} s (a hang)\n{stderr[-4000:]}")
    return stdout + stderr


def run(tokenizer_dir: str, prompts: Path, out: Path, name: str, *extra: str) -> tuple[int, str]:
    proc = start(tokenizer_dir, prompts, out, name, *extra)
    log = finish(proc, out, name)
    return proc.returncode, log


def rank_reports(out: Path, name: str, log: str = "") -> list[dict]:
    paths = [out / f"{name}_rank{r}.json" for r in range(2)]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"no report from {missing} (killed before it ended?)\n{log[-4000:]}"
    return [json.loads(p.read_text()) for p in paths]


def metrics(out: Path, *names: str) -> dict[str, list[float]]:
    """Rank 0's logged values of ``KEYS``, one per rollout, of the runs ``names`` in turn."""
    rows = []
    for name in names:
        with open(out / name / "version_0" / "metrics.csv") as f:
            rows += [r for r in csv.DictReader(f) if r["ppo/policy_loss"]]
    return {key: [float(r[key]) for r in rows] for key in KEYS}


def assert_close_lists(actual: list[float], expected: list[float], what: str) -> None:
    assert len(actual) == len(expected), (what, actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= TOL, f"{what}[{i}]: {a} != {e}"


@pytest.fixture(scope="module")
def uninterrupted(tokenizer_dir, prompts, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("faults_full")
    rc, log = run(tokenizer_dir, prompts, out, "full")
    assert rc == 0, log[-4000:]
    reports = rank_reports(out, "full")
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["rollouts_done"] == 4
    assert [r["gloo_threads_left"] for r in reports] == [0, 0], "process groups released before exit"
    return {"metrics": metrics(out, "full"), "digest": reports[0]["digest"], "global_step": reports[0]["global_step"]}


@pytest.mark.parametrize("target", ["launcher", "one_rank"])
def test_sigterm_stops_every_rank_after_the_same_rollout_and_resume_reproduces_the_run(
    target, uninterrupted, tokenizer_dir, prompts, tmp_path
):
    # (a) launcher: rank 0 waits at rollout 2 for the forwarded signal, rank 1 is in rollout 2's first
    # collective; (b) one_rank: rank 1 waits for a signal sent to it alone, rank 0 is in the collective
    waiting = "0" if target == "launcher" else "1"
    proc = start(tokenizer_dir, prompts, tmp_path, "part", "--wait-for-sigterm", "2", "--wait-ranks", waiting)
    ready = tmp_path / f"part_ready_rank{waiting}"
    deadline = time.monotonic() + TIMEOUT
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not ready.exists():
        log = finish(proc, tmp_path, "part", timeout=1)
        pytest.fail(f"rank {waiting} never reached rollout 2\n{log[-4000:]}")
    time.sleep(0.3)  # let the other rank block in its collective
    pid = proc.pid if target == "launcher" else int((tmp_path / "pid_rank1").read_text())
    os.kill(pid, signal.SIGTERM)
    log = finish(proc, tmp_path, f"SIGTERM to {target}")

    assert proc.returncode != 0, "an interrupted fit must not report success"
    reports = rank_reports(tmp_path, "part", log)
    for rank, report in enumerate(reports):
        assert report["exit"] == 143, (rank, report, log[-4000:])
    if target == "one_rank":
        # torchrun's failure summary: the first rank to exit shows 143; the other shows 143 too, or -15
        # when torchrun's own SIGTERM (sent to the rest once one worker fails) reached it after its
        # checkpoint barrier, as Lightning's teardown had restored the default SIGTERM action
        status = dict(re.findall(r"rank\s+: (\d) \(local_rank: \d\)\s+exitcode\s+: (-?\d+) ", log))
        assert status.keys() == {"0", "1"} and "143" in status.values(), log[-3000:]
        assert set(status.values()) <= {"143", "-15"}, log[-3000:]
    state = reports[0]["at_exception"]
    assert reports[1]["at_exception"] == state, "both ranks stopped at the same step boundary, in sync"
    assert state["rollouts_done"] == 2, "the rollout in progress is finished, then saved"

    # one checkpoint, written once (by rank 0), holding what both ranks held
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last-sigterm.ckpt"]
    assert log.count("SIGTERM: saved") == 1, log[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "last-sigterm.ckpt", weights_only=False)
    assert saved["online_state"]["rollouts_done"] == 2
    assert saved["global_step"] == state["global_step"]
    assert weights_digest(saved["state_dict"]) == state["digest"]

    rc, log = run(tokenizer_dir, prompts, tmp_path, "rest", "--ckpt-path", "last")
    assert rc == 0, log[-4000:]
    resumed = metrics(tmp_path, "rest")
    assert len(resumed["rollout/score"]) == 2, "the resumed fit makes rollouts 3 and 4 only"
    full, parts = uninterrupted["metrics"], metrics(tmp_path, "part", "rest")
    for key, values in full.items():
        assert_close_lists(parts[key], values, f"{target} resume {key}")
    for report in rank_reports(tmp_path, "rest"):
        assert report["global_step"] == uninterrupted["global_step"]
        assert report["digest"] == uninterrupted["digest"], "the resumed run ends with the same weights"


def test_nonfinite_reward_on_one_rank_raises_on_both(tokenizer_dir, prompts, tmp_path):
    rc, log = run(tokenizer_dir, prompts, tmp_path, "nf", "--reward", "faults_worker:nan_on_rank1", "--on-nonfinite", "raise")
    assert rc != 0, log[-3000:]
    other, bad = rank_reports(tmp_path, "nf")
    assert bad["error"].startswith("NonFiniteError: rollout 2:"), bad
    assert "non-finite scores for 2 of 4 rows" in bad["error"], bad
    assert other["error"].startswith("NonFiniteError: rollout 2:"), other
    assert "2 non-finite scores on another rank" in other["error"], other
    # both stopped in rollout 2, before its update, with the same weights
    assert other["at_exception"] == bad["at_exception"] and bad["at_exception"]["rollouts_done"] == 1


def test_nonfinite_reward_on_one_rank_is_dropped_and_counted_once(uninterrupted, tokenizer_dir, prompts, tmp_path):
    rc, log = run(tokenizer_dir, prompts, tmp_path, "nf", "--reward", "faults_worker:nan_on_rank1", "--on-nonfinite", "drop")
    assert rc == 0, log[-4000:]
    logged = metrics(tmp_path, "nf")
    assert logged["rollout/nonfinite_scores"] == [0.0, 2.0, 0.0, 0.0], "rank 1's 2 rows, counted over all ranks once"
    assert all(math.isfinite(v) for v in logged["ppo/policy_loss"] + logged["ppo/value_loss"])
    full = uninterrupted["metrics"]
    for key in ("rollout/score", "ppo/policy_loss"):
        assert_close_lists(logged[key][:1], full[key][:1], f"rollout 1 {key}")  # before the NaN: as the full run
    assert abs(logged["ppo/policy_loss"][1] - full["ppo/policy_loss"][1]) > TOL, "rollout 2 learnt without the rows"
    # the same optimiser steps on both ranks: equal step counts and identical weights (DDP in step)
    rank0, rank1 = rank_reports(tmp_path, "nf")
    assert rank0["rollouts_done"] == rank1["rollouts_done"] == 4
    assert rank0["global_step"] == rank1["global_step"] == uninterrupted["global_step"]
    assert rank0["digest"] == rank1["digest"] and rank0["finite_weights"] and rank1["finite_weights"]
