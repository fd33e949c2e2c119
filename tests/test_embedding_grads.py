"""Input-embedding gradients accumulated in place (lit_rlhf.models.embedding_grads): the same dense gradient
as the plain backward, seen dense by everything that reads it, and only where it changes nothing else."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer
from torch import nn

from lit_rlhf.models import ModelSpec, embedding_grads, fused_head
from lit_rlhf.models.embedding_grads import EmbeddingGradAccumulator, accumulated_embeddings

V, H = 50, 6


@pytest.fixture
def no_size_floor(monkeypatch):
    """Every embedding is big enough (the tests' tables are tiny)."""
    monkeypatch.setattr(embedding_grads, "ACCUMULATE_MIN_ELEMENTS", 0)


class Tiny(nn.Module):
    """An embedding, a linear layer on top; optionally tied (the linear layer reads the table)."""

    def __init__(self, tied: bool = False, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H, padding_idx=padding_idx)
        self.head = nn.Linear(H, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, L) -> scalar
        return self.head(torch.tanh(self.embed(ids))).logsumexp(-1).pow(2).mean()


def _grads(model: Tiny, micro_batches: list[torch.Tensor], accumulate: bool, steps: int = 1) -> list[torch.Tensor]:
    """The embedding's gradient after each of ``steps`` optimiser steps' accumulations of ``micro_batches``."""
    out = []
    with EmbeddingGradAccumulator([model], enabled=accumulate):
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            for ids in micro_batches:
                model(ids).backward()
                assert not model.embed.weight.grad.is_sparse
            out.append(model.embed.weight.grad.clone())
    return out


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 7)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    padding=st.booleans(),
)
def test_accumulated_gradient_equals_the_dense_backward(shapes, seed, padding):
    embedding_grads.ACCUMULATE_MIN_ELEMENTS, saved = 0, embedding_grads.ACCUMULATE_MIN_ELEMENTS
    try:
        gen = torch.Generator().manual_seed(seed)
        batches = [torch.randint(0, V, shape, generator=gen) for shape in shapes]  # repeated ids included
        torch.manual_seed(seed)
        model = Tiny(padding_idx=0 if padding else None)
        dense = _grads(model, batches, accumulate=False, steps=2)
        rowwise = _grads(model, batches, accumulate=True, steps=2)
        for a, b in zip(dense, rowwise):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        if padding:
            assert torch.equal(rowwise[0][0], torch.zeros(H))
        assert not model.embed.sparse
    finally:
        embedding_grads.ACCUMULATE_MIN_ELEMENTS = saved


def test_one_dense_buffer_made_at_the_first_backward_reused_and_seen_dense_by_hooks(no_size_floor):
    model = Tiny()
    seen = []
    model.embed.weight.register_post_accumulate_grad_hook(lambda p: seen.append((p.grad.is_sparse, id(p.grad))))
    ids = torch.tensor([[1, 2, 2, 3]])
    with EmbeddingGradAccumulator([model]):
        assert model.embed.sparse
        loss = model(ids)
        assert model.embed.weight.grad is None  # nothing (V, H) held through the forward
        loss.backward()
        first = model.embed.weight.grad
        assert not first.is_sparse and first.shape == (V, H)
        assert first[1].abs().sum() > 0 and torch.equal(first[4], torch.zeros(H))
        model(ids).backward()
        assert model.embed.weight.grad is first  # accumulated in place
        assert seen == [(False, id(first))] * 2
        model.zero_grad(set_to_none=True)
        model(ids).backward()
        assert model.embed.weight.grad is first  # zeroed and reused at the next step
        torch.testing.assert_close(first, _dense_grad(model, ids))
        model.embed.weight.grad = kept = torch.ones(V, H)
        model(ids).backward()  # a gradient already there is accumulated into
        assert model.embed.weight.grad is kept and kept[4].eq(1).all() and not kept[1].eq(1).all()
    assert not model.embed.sparse
    model.zero_grad(set_to_none=True)
    model(ids).backward()  # the hook is gone: the plain dense backward
    assert not model.embed.weight.grad.is_sparse


def _dense_grad(model: Tiny, ids: torch.Tensor) -> torch.Tensor:
    """The plain dense backward's embedding gradient of one micro-batch, on a fresh model with ``model``'s weights
    (no hooks, dense embedding)."""
    plain = Tiny()
    plain.load_state_dict(model.state_dict())
    plain(ids).backward()
    return plain.embed.weight.grad


def test_a_sparse_gradient_left_inside_is_dense_again_on_exit(no_size_floor):
    model = Tiny()
    with EmbeddingGradAccumulator([model]):
        model.embed.weight.grad = torch.zeros(V, H).to_sparse()
    grad = model.embed.weight.grad
    assert not grad.is_sparse and not model.embed.sparse


def test_an_error_inside_restores_the_dense_embedding(no_size_floor):
    model = Tiny()
    with pytest.raises(RuntimeError, match="boom"):
        with EmbeddingGradAccumulator([model]):
            raise RuntimeError("boom")
    assert not model.embed.sparse


def test_only_where_it_changes_nothing_else(monkeypatch):
    assert accumulated_embeddings(Tiny()) == []  # 300 elements: below the size floor
    monkeypatch.setattr(embedding_grads, "ACCUMULATE_MIN_ELEMENTS", 0)
    plain = Tiny()
    assert accumulated_embeddings(plain) == [plain.embed]
    assert accumulated_embeddings(Tiny(tied=True)) == []  # the tied head's gradient is dense
    frozen = Tiny()
    frozen.embed.weight.requires_grad_(False)
    assert accumulated_embeddings(frozen) == []
    own = Tiny()
    own.embed.sparse = True  # the user's own sparse embedding: not ours to touch
    assert accumulated_embeddings(own) == []
    with EmbeddingGradAccumulator([own]):
        own(torch.tensor([[1, 2]])).backward()
        assert own.embed.weight.grad.is_sparse  # left as the user made it
    assert own.embed.sparse
    assert EmbeddingGradAccumulator([plain], enabled=False).embeddings == []
    shared = EmbeddingGradAccumulator([plain, plain])  # one model listed twice (a shared backbone)
    assert shared.embeddings == [plain.embed]


def _trained(module, tokenizer_dir, tmp_path, name):
    torch.manual_seed(0)
    trainer(tmp_path / name, deterministic=False).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=8))
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_an_online_fit_trains_as_with_dense_gradients(algorithm, tokenizer_dir, tmp_path, monkeypatch):
    """The same tiny fit with every embedding (actor, critic) accumulated row by row and with
    ``update.embedding_grads: dense``."""
    monkeypatch.setattr(embedding_grads, "ACCUMULATE_MIN_ELEMENTS", 0)
    attached = []  # the embeddings accumulated row by row, per update
    enter = EmbeddingGradAccumulator.__enter__
    monkeypatch.setattr(
        EmbeddingGradAccumulator, "__enter__", lambda self: (attached.append(len(self.embeddings)), enter(self))[1]
    )

    targets = []  # the fused LM head's weight gradient added in place (models.fused_head) under "auto"
    in_place_target = fused_head._in_place_target
    monkeypatch.setattr(fused_head, "_in_place_target", lambda w: targets.append(in_place_target(w)) or targets[-1])

    def build(mode: str):
        if algorithm == "ppo":  # the LM head route, two micro-batches a minibatch
            actor = ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0, logits_chunking="on")
            return tiny_ppo(
                tokenizer_dir, llama_config(), actor=actor, max_rollouts=2, scoring={"forward_batch_size": 2},
                update={"epochs": 2, "embedding_grads": mode},
            )  # fmt: skip
        return tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=2, update={"embedding_grads": mode})

    dense = _trained(build("dense"), tokenizer_dir, tmp_path, "dense")
    assert attached and set(attached) == {0}
    assert set(targets) <= {None}
    attached.clear(), targets.clear()
    module = build("auto")
    before = [p.detach().clone() for p in module.parameters()]
    rowwise = _trained(module, tokenizer_dir, tmp_path, "rowwise")
    # PPO on Llama: the actor's and the critic's token tables; GRPO on GPT-2: the position table (its token
    # table is tied to the LM head)
    assert attached and set(attached) == {2 if algorithm == "ppo" else 1}
    if algorithm == "ppo":
        assert targets and None not in targets
    assert all(not m.sparse for m in module.modules() if isinstance(m, nn.Embedding))
    # AdamW (lr 1e-2) moves every weight by ~1e-2 a step: the rounding of the sums stays far below one step
    assert max((a - b).abs().max().item() for a, b in zip(before, rowwise)) > 1e-2
    for a, b in zip(dense, rowwise):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-3)


def test_the_switch_is_checked():
    from lit_rlhf.modules.online_settings import UpdateSettings

    assert UpdateSettings().embedding_grads == "auto"
    with pytest.raises(ValueError, match="update.embedding_grads must be one of"):
        UpdateSettings(embedding_grads="sparse")
