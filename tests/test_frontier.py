"""The best-of-n frontier's estimator and KL, by hand and against drawing the subsets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.demo.frontier import best_of_n_gold, best_of_n_kl, distance_to_frontier, frontier


def test_best_of_n_kl_by_hand():
    assert best_of_n_kl(1) == 0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(64) == pytest.approx(4.1588830834 - 63 / 64)
    with pytest.raises(ValueError, match="n must be >= 1"):
        best_of_n_kl(0)


def test_best_of_n_gold_by_hand():
    # 3 samples with proxy 0.1, 0.5, 0.3 and gold 1, 2, 3. best-of-2 subsets: {0,1}->2, {0,2}->3, {1,2}->2
    proxy, gold = torch.tensor([[0.1, 0.5, 0.3]]), torch.tensor([[1.0, 2.0, 3.0]])
    assert best_of_n_gold(proxy, gold, 1).item() == pytest.approx(2.0)  # the mean
    assert best_of_n_gold(proxy, gold, 2).item() == pytest.approx(7 / 3)
    assert best_of_n_gold(proxy, gold, 3).item() == pytest.approx(2.0)  # the proxy's best: gold 2
    with pytest.raises(ValueError, match=r"n must be in \[1, 3\]"):
        best_of_n_gold(proxy, gold, 4)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 7), st.data())
def test_the_estimator_is_the_mean_over_every_n_subset(N, data):
    ranks = data.draw(st.permutations(range(N)))  # distinct proxy scores
    proxy = torch.tensor([[float(r) for r in ranks]])
    gold = torch.tensor([data.draw(st.lists(st.floats(-5, 5), min_size=N, max_size=N))])
    n = data.draw(st.integers(1, N))
    subsets = list(itertools.combinations(range(N), n))
    brute = sum(gold[0, max(s, key=lambda j: proxy[0, j])].item() for s in subsets) / len(subsets)
    assert best_of_n_gold(proxy, gold, n).item() == pytest.approx(brute, abs=1e-4)


def test_frontier_and_the_distance_to_it():
    torch.manual_seed(0)
    gold = torch.randn(50, 16)
    proxy = gold + 0.5 * torch.randn(50, 16)  # a proxy correlated with the gold: the frontier rises
    points = frontier(proxy, gold)
    assert [p["n"] for p in points] == [1, 2, 4, 8, 16]
    golds = [p["gold_mean"] for p in points]
    assert golds == sorted(golds) and golds[0] == pytest.approx(gold.mean().item(), abs=1e-5)
    mid = points[2]
    assert distance_to_frontier(points, mid["kl"], mid["gold_mean"] + 0.25) == pytest.approx(0.25)
    assert distance_to_frontier(points, points[-1]["kl"] + 1, 0.0) is None
