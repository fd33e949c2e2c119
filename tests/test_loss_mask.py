"""Two masks in a rollout: tokens that exist (attention) and tokens learned from (the loss mask, with holes
where tool or environment tokens are). A hole gives exactly the advantages of the same rollout with the
hole's tokens removed; an engine that returns holes drives a fit (the functional tests hand-compute GAE,
REINFORCE++ returns and every loss with holes: tests/test_functional_holes.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer
from test_online_contract import ReplayEngine, read_metrics

from lit_rlhf import functional as F
from lit_rlhf.engines import Responses


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with the masked-out tokens removed (kept tokens moved left), and their right-padded mask."""
    out, kept = torch.zeros_like(x), torch.zeros_like(mask)
    for i in range(x.shape[0]):
        row = x[i][mask[i]]
        out[i, : len(row)], kept[i, : len(row)] = row, True
    return out, kept


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "grpo", "rloo"])
def test_advantages_with_a_hole_equal_those_with_the_hole_removed(tokenizer_dir, estimator):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), advantage={"estimator": estimator, "gamma": 0.9},
                              kl={"coef": 0.1, "estimator": "k3"}, generation={"num_samples": 2})  # fmt: skip
    module.whiten = lambda x, mask, shift_mean=True: F.masked_whiten(x, mask, shift_mean)  # one process
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]]).bool()
    old, ref = torch.randn(4, 7), torch.randn(4, 7)
    old[~mask], ref[~mask] = float("nan"), 1e6  # what sits in a hole never reaches a learned token
    scores = torch.tensor([1.0, 3.0, -2.0, 0.5])
    with_hole = module.estimate_advantages(scores, old, ref, mask)
    old_c, kept = compact(old, mask)
    ref_c, _ = compact(ref, mask)
    removed = module.estimate_advantages(scores, old_c, ref_c, kept)
    assert torch.allclose(with_hole[mask], removed[kept], atol=1e-6), (with_hole, removed)
    assert (with_hole[~mask] == 0).all()


class ToolEngine(ReplayEngine):
    """Replayed responses whose middle third is 'tool output': attended to, not learned from."""

    def generate(self, prompt_ids, prompt_mask, settings, *, greedy=False):
        out = super().generate(prompt_ids, prompt_mask, settings)
        loss_mask = out.mask.clone()
        loss_mask[:, 1:3] = False
        return Responses(out.ids, out.mask, out.truncated, loss_mask=loss_mask)


def test_an_engine_returning_holes_trains_on_the_policy_tokens_only(tokenizer_dir, tmp_path):
    engine = ToolEngine(tokenizer_dir, ["the food was good", "the the the the", "it was bad and the"])
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), engine=engine, max_rollouts=2, kl={"coef": 0.05})
    seen = []
    loss = module.policy_loss

    def spy(part):
        seen.append(part.loss_mask.clone())
        return loss(part)

    module.policy_loss = spy
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert seen and all(not m[:, 1:3].any() for m in seen), "the hole's tokens are never learned from"
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(list(r.values()))).all() for r in rows)
