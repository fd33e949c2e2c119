"""Preference losses on sequence log-probs of (chosen, rejected) pairs: DPO, conservative DPO, IPO, SimPO
(``(loss, stats)`` as every loss of :mod:`lit_rlhf.functional.losses`), and the pairs of online DPO: the
best and the worst of each prompt's sampled responses.

Shapes: B pairs (``dpo_loss``); B = G * K rollout rows, G prompts of K responses (``best_worst_pairs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_rlhf.functional._checks import as_float, check_number, check_same_shape
from lit_rlhf.functional.stats import as_groups

__all__ = ["DPO_LOSS_TYPES", "best_worst_pairs", "chosen_nll", "dpo_loss", "kl_regularized_scores"]


DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Offline preference losses on sequence log-probs of (chosen, rejected) pairs.

    With the log-ratio difference h = (pc - rc) - (pr - rr) and label smoothing eps:

    - ``sigmoid`` (DPO, Rafailov et al. 2023, arXiv 2305.18290 eq. 7; with eps > 0 the conservative
      DPO of Mitchell 2023, "A note on DPO with noisy preferences", which assumes labels flipped with
      probability eps): mean(-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)).
    - ``ipo`` (Azar et al. 2023, arXiv 2310.12036 eq. 17, beta = their tau): mean((h - 1 / (2 beta))^2),
      a squared distance that stops pushing once h reaches 1 / (2 beta). The paper's log-likelihoods
      are per token: pass length-averaged log-probs.
    - ``simpo`` (Meng et al. 2024, arXiv 2405.14734 eq. 6): reference-free, on length-averaged
      log-probs, mean(-(1 - eps) log sigmoid(beta (pc - pr) - gamma) - eps log sigmoid(-(...))) with
      the target reward margin gamma = ``simpo_gamma``. The reference arguments must be None.

    Args:
        policy_chosen_logps: (B,) policy log-probs of the chosen responses (with grad), summed over the
            response tokens (``sigmoid``) or averaged over them (``ipo``, ``simpo``).
        policy_rejected_logps: (B,) the same for the rejected responses.
        ref_chosen_logps: (B,) reference log-probs of the chosen responses, reduced like the policy's;
            None for ``simpo``.
        ref_rejected_logps: (B,) the same for the rejected responses; None for ``simpo``.
        beta: > 0, the strength of the implicit KL constraint (DPO's beta, IPO's tau, SimPO's beta).
        loss_type: "sigmoid", "ipo" or "simpo".
        label_smoothing: eps in [0, 0.5), the assumed probability that a pair's label is flipped
            (``sigmoid`` and ``simpo``; must be 0 for ``ipo``).
        simpo_gamma: >= 0, SimPO's target margin gamma (``simpo`` only).

    Returns:
        (loss, stats): the float32 scalar loss, and detached float32 means over the pairs under TRL's
        names: ``rewards/chosen`` and ``rewards/rejected`` (the implicit rewards beta * (pc - rc) and
        beta * (pr - rr); beta * pc and beta * pr for ``simpo``), ``rewards/margins`` (chosen - rejected),
        ``rewards/accuracies`` (share of pairs whose chosen reward is the larger), ``logps/chosen`` and
        ``logps/rejected`` (the policy's log-probs as passed).
    """
    _check_dpo_args(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
        beta, loss_type, label_smoothing, simpo_gamma,
    )  # fmt: skip
    reference_free = loss_type == "simpo"
    chosen = as_float(policy_chosen_logps)  # (B,)
    rejected = as_float(policy_rejected_logps)  # (B,)
    if not reference_free:
        chosen = chosen - as_float(ref_chosen_logps)  # (B,) log pi/pi_ref of the chosen response
        rejected = rejected - as_float(ref_rejected_logps)  # (B,)
    h = chosen - rejected  # (B,)
    losses = _preference_losses(h, beta, loss_type, label_smoothing, simpo_gamma)  # (B,)
    return losses.mean(), _dpo_stats(beta, chosen, rejected, policy_chosen_logps, policy_rejected_logps)


def chosen_nll(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The per-token negative log-likelihood of the chosen responses, the term RPO adds to DPO.

    Pang et al. (2024, arXiv 2404.19733 eq. 1-3: loss = DPO + alpha * NLL(chosen) / length) add it to keep the
    likelihood of the chosen responses from falling with the rejected ones' (the DPO loss only sees their
    difference: both may drift down together and move the policy's mass onto text of neither; Liu et al. 2024,
    arXiv 2405.16436, derive the same term as a regulariser against over-optimisation).

    Args:
        chosen_logps: (B,) policy log-probs of the chosen responses, summed over their tokens (with grad).
        chosen_tokens: (B,) their token counts (>= 1 where counted; 0 is taken as 1).

    Returns:
        The float32 scalar mean over the pairs of -chosen_logps / chosen_tokens.
    """
    check_same_shape("chosen_nll", chosen_logps=chosen_logps, chosen_tokens=chosen_tokens)
    per_token = -as_float(chosen_logps) / chosen_tokens.clamp(min=1).float()  # (B,)
    return per_token.mean()


def _check_dpo_args(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    simpo_gamma: float,
) -> None:
    """Raise ValueError for arguments of :func:`dpo_loss` outside its Args (same names and meanings)."""
    fn = "dpo_loss"
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"{fn}: `loss_type` must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    check_number(fn, "beta", beta, low=0.0, low_inclusive=False)
    check_number(fn, "label_smoothing", label_smoothing, low=0.0, low_inclusive=True, high=0.5)
    if label_smoothing == 0.5:
        raise ValueError(f"{fn}: `label_smoothing` must be < 0.5 (0.5 makes every pair a coin flip)")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError(f"{fn}: `label_smoothing` is not defined for loss_type='ipo'; got {label_smoothing}")
    check_number(fn, "simpo_gamma", simpo_gamma, low=0.0, low_inclusive=True)
    if loss_type != "simpo" and simpo_gamma:
        raise ValueError(f"{fn}: `simpo_gamma` applies to loss_type='simpo' only; got {simpo_gamma}")
    reference_free = loss_type == "simpo"
    if reference_free != (ref_chosen_logps is None) or reference_free != (ref_rejected_logps is None):
        need = "must be None (SimPO is reference-free)" if reference_free else "are required"
        raise ValueError(f"{fn}: `ref_chosen_logps` and `ref_rejected_logps` {need} for loss_type={loss_type!r}")
    tensors = {"policy_chosen_logps": policy_chosen_logps, "policy_rejected_logps": policy_rejected_logps}
    if not reference_free:
        tensors |= {"ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps}
    check_same_shape(fn, **tensors)
    if policy_chosen_logps.dim() != 1:
        raise ValueError(f"{fn}: log-probs must be 1-D (B,), got shape {tuple(policy_chosen_logps.shape)}")


def _preference_losses(
    h: torch.Tensor, beta: float, loss_type: str, label_smoothing: float, simpo_gamma: float
) -> torch.Tensor:
    """(B,) log-ratio differences h (SimPO: pc - pr) -> (B,) per-pair losses of :func:`dpo_loss`."""
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)).square()  # (B,)
    logits = beta * h - simpo_gamma  # (B,)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)  # (B,)


def _dpo_stats(
    beta: float,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """:func:`dpo_loss`'s stats from the (B,) float log-ratios of the chosen and of the rejected responses
    (SimPO: the policy's log-probs) and the (B,) policy log-probs as passed."""
    chosen_rewards = beta * chosen.detach()  # (B,)
    rejected_rewards = beta * rejected.detach()  # (B,)
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": as_float(policy_chosen_logps).detach().mean(),
        "logps/rejected": as_float(policy_rejected_logps).detach().mean(),
    }


def best_worst_pairs(
    scores: torch.Tensor, group_size: int, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The online preference pair of each prompt: its best-scored response (chosen) and its worst (rejected).

    Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv
    2402.04792, Algorithm 1) samples two responses per prompt from the current policy and lets the
    annotator (here the scores of a reward model, an ensemble or a function) pick the preferred one; with
    K > 2 samples the pair is the best and the worst of the K, as in online iterative DPO (Dong et al.
    2024, "RLHF Workflow", arXiv 2405.07863). A prompt whose best and worst kept scores
    are equal (a tie), or with fewer than two kept responses, has no pair: it must give no gradient.
    Among equal best (or worst) scores the first response is taken.

    Args:
        scores: (B,) sequence scores, each prompt's K = ``group_size`` responses contiguous.
        group_size: K >= 2.
        keep: (B,) bool, False for rows that may not be chosen or rejected (dropped non-finite scores);
            None = every row.

    Returns:
        (chosen, rejected, paired): (G,) long rollout rows g*K + k of each prompt's chosen and rejected
        response, and (G,) bool, whether the prompt has a pair (where False, chosen and rejected are
        its first row and carry no meaning).
    """
    fn = "best_worst_pairs"
    if group_size < 2:
        raise ValueError(f"{fn}: `group_size` must be >= 2 (a pair needs two responses), got {group_size}")
    grouped = as_groups(scores, group_size, fn)  # (G, K)
    if keep is not None and keep.shape != scores.shape:
        raise ValueError(f"{fn}: `keep` has shape {tuple(keep.shape)} but `scores` has {tuple(scores.shape)}")
    kept = torch.ones_like(grouped, dtype=torch.bool) if keep is None else keep.view(-1, group_size).bool()  # (G, K)
    best = torch.where(kept, grouped, -torch.inf).argmax(dim=1)  # (G,) first maximum among kept rows
    worst = torch.where(kept, grouped, torch.inf).argmin(dim=1)  # (G,) first minimum among kept rows
    high = grouped.gather(1, best[:, None]).squeeze(1)  # (G,)
    low = grouped.gather(1, worst[:, None]).squeeze(1)  # (G,)
    paired = (kept.sum(dim=1) >= 2) & (high > low)  # (G,) NaN compares False: no pair
    offsets = torch.arange(grouped.shape[0], device=scores.device) * group_size  # (G,)
    chosen = torch.where(paired, offsets + best, offsets)  # (G,)
    rejected = torch.where(paired, offsets + worst, offsets)  # (G,)
    return chosen, rejected, paired


def kl_regularized_scores(scores: torch.Tensor, sequence_kl: torch.Tensor, coef: float) -> torch.Tensor:
    """Each sampled response's score less ``coef`` times its KL to the reference: the KL-regularised reward
    r(x, y) - c log(pi(y|x) / pi_ref(y|x)) (Ziegler et al. 2019, arXiv 1909.08593 eq. 2), by which online DPO
    may rank its samples.

    Ranked by the score alone, the DPO loss on the policy's own samples has no force back towards the
    reference: DPO's beta only slows the drift. Ranked by the regularised reward, a response that drifted far
    (a large log-ratio) loses to one that stayed close at a similar score, so the pairs themselves pull
    back. Where the ranking were by Bradley-Terry preferences of this reward, DPO's fixed point
    log pi/pi_ref = (r - c log pi/pi_ref) / beta gives log pi/pi_ref = r / (beta + c): the policy of
    DPO with beta + c (Rafailov et al. 2023, arXiv 2305.18290 eq. 4).

    Args:
        scores: (B,) sequence scores of the reward source.
        sequence_kl: (B,) each response's KL to the reference summed over its tokens (with the k1 estimator
            its log-ratio log pi/pi_ref under the sampling policy).
        coef: c >= 0; 0 returns ``scores`` itself (whatever ``sequence_kl`` holds).

    Returns:
        (B,) regularised scores, at least float32.
    """
    fn = "kl_regularized_scores"
    check_same_shape(fn, scores=scores, sequence_kl=sequence_kl)
    check_number(fn, "coef", coef, low=0.0, low_inclusive=True)
    if coef == 0:
        return as_float(scores)  # (B,)
    return as_float(scores) - coef * as_float(sequence_kl)  # (B,)
