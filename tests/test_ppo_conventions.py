"""PPOModule with a CSVLogger and the rollout progress bar: sample rows at the rollout index of the scalars."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_ppo, trainer

from lit_rlhf.progress import RolloutProgressBar


def test_ppo_csv_samples_share_the_rollout_step_and_the_bar_counts_rollouts(tokenizer_dir, tmp_path, capsys):
    module = tiny_ppo(tokenizer_dir, gpt2_config(), samples={"every": 2, "rows": 2}, max_rollouts=4)
    bar = RolloutProgressBar(tty=False, log_every_s=0)
    run = trainer(tmp_path, enable_progress_bar=True, callbacks=[bar])
    run.fit(module, prompt_loader(tokenizer_dir, n=16, batch_size=4))

    log_dir = Path(run.logger.log_dir)
    with (log_dir / "metrics.csv").open() as f:
        score_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("rollout/score")]
    samples = [json.loads(line) for line in (log_dir / "samples.jsonl").read_text().splitlines()]
    assert score_steps == [0, 1, 2, 3]  # one row of scalars per rollout, at the rollout index
    assert [s["step"] for s in samples] == [0, 0, 2, 2]  # rollouts 1 and 3 (samples.every=2)
    assert {s["tag"] for s in samples} == {"rollout/samples"} and set(samples[0]) >= {"prompt", "response", "score"}

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all("score=" in line and "kl=" in line and "s/rollout=" in line for line in lines)
