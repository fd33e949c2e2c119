"""An online fit resumed from a checkpoint written at the end of an epoch's last rollout.

In the uninterrupted run the next epoch's DataLoader iterator draws its base seed from the global RNG before
the next rollout samples; a resumed run creates its iterator before the checkpoint's RNG state is put back, so
the module records that the checkpoint ends an epoch and replays that one draw after restoring the state.
Mid-epoch checkpoints (the other resume tests) put it back at the first rollout, after the iterator.
"""

from __future__ import annotations

import json

import torch
from conftest import gpt2_config, make_corpus
from ppo_helpers import tiny_critic_free, trainer
from test_ppo import assert_resumed_rows_equal, read_metrics, uninterrupted_and_resumed

from lit_rlhf.data import PromptDataModule


def test_resume_at_an_epoch_boundary_reproduces_the_uninterrupted_run(tokenizer_dir, tmp_path):
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:  # 8 prompts, 4 a rollout: 2 rollouts an epoch
        for i, text in enumerate(make_corpus(8, seed=5)):
            f.write(json.dumps({"prompt": " ".join(text.split()[:3]) + f" {i}"}) + "\n")

    def run(root, callbacks=(), ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=4)
        data = PromptDataModule(tokenizer_dir, str(path), max_prompt_length=16, batch_size=4, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(module, data, ckpt_path=ckpt_path)
        return read_metrics(root)

    full, resumed = uninterrupted_and_resumed(run, tmp_path, stop_after=2)  # stopped at epoch 0's last rollout
    assert len(full) == 4
    assert_resumed_rows_equal(full, resumed, stop_after=2)
