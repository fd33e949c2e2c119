"""Default optimiser and learning-rate schedule, injectable from YAML the LightningCLI way.

Modules take ``optimizer: OptimizerCallable`` and ``scheduler: LRSchedulerCallable`` arguments; in YAML
either is a ``class_path`` + ``init_args`` (e.g. ``torch.optim.AdamW`` with ``lr``). The default schedule
is :class:`WarmupCosineLR`, which learns its length from the trainer when left at ``total_steps=-1``.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler


class WarmupCosineLR(LRScheduler):
    """Linear warm-up from 0, then cosine decay to ``min_lr_ratio`` x the base learning rate.

    Args:
        optimizer: the wrapped optimiser.
        warmup_steps: optimiser steps of linear warm-up.
        total_steps: steps of the whole schedule; -1 lets the module set it from
            ``trainer.estimated_stepping_batches`` (see :func:`resolve_total_steps`).
        min_lr_ratio: final learning rate as a fraction of the base one (1.0 = constant after warm-up).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int = 0,
        total_steps: int = -1,
        min_lr_ratio: float = 0.1,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        # set by resolve_total_steps; kept in the state dict, so a resumed run can re-resolve the length
        self.total_steps_from_run = total_steps < 0
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer)

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.total_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def get_lr(self) -> list[float]:
        factor = self.lr_factor(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that runs torch's fused kernel wherever torch has one for the parameters.

    Same update rule and arguments; only the default kernel differs. torch defaults to its multi-tensor
    kernel on CUDA only and loops over the parameters in Python on CPU, which costs more than the
    update itself for small models; the fused kernel updates a whole parameter group in one call
    (transformers and TRL default to it too: ``optim="adamw_torch_fused"``). ``fused=False`` or
    ``foreach=True`` restores torch's choice, which is also kept for anything but plain floating-point
    ``nn.Parameter``s on a device with a fused kernel (e.g. FSDP's sharded DTensor/FlatParameter).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        params = [_materialised(item) for item in params]  # iterated twice: check, then torch
        if fused is None and foreach is None and not differentiable:
            fused = _fused_kernel_available(params)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused or None,
        )


class PolicyAdamW(AdamW):
    """:class:`AdamW` with the learning rate published for the policy of online RLHF on pretrained LMs:
    1e-6, the actor default of OpenRLHF's PPO/GRPO trainers (``--actor_learning_rate``, Hu et al. 2024,
    arXiv 2405.11143) and of TRL's ``GRPOConfig.learning_rate``. The default ``actor_optimizer`` of
    :class:`~lit_rlhf.modules.PPOModule` and :class:`~lit_rlhf.modules.CriticFreeModule`."""

    def __init__(
        self,
        params,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        fused: bool | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, fused=fused)


class CriticAdamW(AdamW):
    """:class:`AdamW` with the critic learning rate published for PPO on pretrained LMs: 9e-6, OpenRLHF's
    ``--critic_learning_rate`` default (Hu et al. 2024, arXiv 2405.11143). The default ``critic_optimizer``
    of :class:`~lit_rlhf.modules.PPOModule`."""

    def __init__(
        self,
        params,
        lr: float = 9e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        fused: bool | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, fused=fused)


def _materialised(item):
    """A parameter group's ``params`` as a list (a generator could be consumed only once)."""
    if isinstance(item, dict) and not isinstance(item["params"], torch.Tensor):
        return {**item, "params": list(item["params"])}
    return item


def _fused_kernel_available(params: list) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    groups = [item["params"] if isinstance(item, dict) else [item] for item in params]
    groups = [[group] if isinstance(group, torch.Tensor) else group for group in groups]
    # torch also accepts (name, parameter) pairs
    tensors = [p[1] if isinstance(p, tuple) else p for group in groups for p in group]
    devices = _get_fused_kernels_supported_devices()
    return all(
        type(p) is torch.nn.Parameter and p.is_floating_point() and p.device.type in devices for p in tensors
    )


def resolve_total_steps(scheduler: object, total_steps: int | float) -> None:
    """Fill in ``total_steps`` of a :class:`WarmupCosineLR` left at -1 (other schedulers are untouched).

    Called again after a resume, it replaces the length restored from the checkpoint (e.g. a larger
    ``max_rollouts`` given on the command line), as long as the schedule's length came from the run.
    """
    if isinstance(scheduler, WarmupCosineLR) and getattr(scheduler, "total_steps_from_run", False):
        if not math.isfinite(total_steps):
            raise ValueError(
                "WarmupCosineLR(total_steps=-1) needs a finite run: set trainer.max_steps or max_epochs (an online "
                "module: max_rollouts), "
                "or give the scheduler total_steps explicitly"
            )
        scheduler.total_steps = int(total_steps)
        # re-apply the current step's factor now that the schedule's length is known
        scheduler._last_lr = scheduler.get_lr()
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler._last_lr):
            group["lr"] = lr
