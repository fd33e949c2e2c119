"""What the modules do differently under each Lightning strategy: sharding, generation, clipping, export.

The strategy is chosen only through the trainer (``trainer.strategy`` in YAML); a module calls these
helpers and they read the trainer to decide:

- ``single`` / ``ddp``: nothing to wrap (Lightning's DDP wraps the whole LightningModule).
- ``fsdp2`` (``ModelParallelStrategy``): ``fully_shard`` on every transformer block, then on each model,
  applied in ``configure_model`` over the data-parallel mesh (torch FSDP2 docs; Lightning's
  "model parallel" guide).
- ``fsdp1`` (``strategy: fsdp``): each model wraps itself in ``FullyShardedDataParallel`` with
  ``use_orig_params=True`` and an auto-wrap policy on its block classes. Lightning's default root
  wrapping breaks ``manual_backward`` of a manual-optimisation module (Lightning #19626, #19685); a
  module that already holds FSDP units is left unwrapped by the strategy.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from lit_rlhf.models import ModelSpec
from lit_rlhf.rollout import GenerationSettings

StrategyKind = Literal["single", "ddp", "fsdp1", "fsdp2"]

# Checkpoints hold the modules' hyperparameters, which include these dataclasses; resuming under
# torch.load(weights_only=True) (the default since torch 2.6) refuses unknown classes otherwise.
torch.serialization.add_safe_globals([ModelSpec, GenerationSettings])


def strategy_kind(trainer: Trainer | None) -> StrategyKind:
    """How the trainer distributes the module (``single`` when there is no trainer yet)."""
    strategy = None if trainer is None else trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp1"
    if isinstance(strategy, ParallelStrategy) and trainer.world_size > 1:
        return "ddp"
    return "single"


def _trainer(module: LightningModule) -> Trainer | None:
    return module._trainer


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The transformer-block classes of an HF model (plain or peft): its ``_no_split_modules``."""
    names: set[str] = set()
    for sub in model.modules():
        names |= set(getattr(sub, "_no_split_modules", None) or ())
    return {type(sub) for sub in model.modules() if type(sub).__name__ in names}


def _get(module: nn.Module, path: str) -> nn.Module | None:
    obj = module
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _set(module: nn.Module, path: str, value: nn.Module) -> None:
    *parents, name = path.split(".")
    owner = module
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, value)


def shard_models(module: LightningModule, paths: Iterable[str]) -> None:
    """Shard the models found at the dotted attribute ``paths`` of ``module`` (missing/None ones skipped).

    Call it from ``configure_model``; it is a no-op outside FSDP strategies and for models that are
    already sharded (``configure_model`` may run once per trainer entry point). Frozen models are
    sharded too: they have no optimiser state but their weights are the bulk of the memory.
    """
    kind = strategy_kind(_trainer(module))
    if kind not in ("fsdp1", "fsdp2"):
        return
    for path in paths:
        model = _get(module, path)
        if model is None:
            continue
        if kind == "fsdp2":
            _fully_shard(model, _data_parallel_mesh(module))
        else:
            _set(module, path, _fsdp1_wrap(model, module.trainer.strategy))


def _data_parallel_mesh(module: LightningModule):
    mesh = module.device_mesh
    if mesh["tensor_parallel"].size() != 1:
        raise ValueError(
            "lit_rlhf shards with FSDP only: use ModelParallelStrategy(data_parallel_size=<world size>, "
            f"tensor_parallel_size=1); got tensor_parallel_size={mesh['tensor_parallel'].size()}"
        )
    return mesh["data_parallel"]


def _fully_shard(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    if isinstance(model, FSDPModule):
        return
    blocks = block_classes(model)
    for sub in list(model.modules()):
        if type(sub) in blocks:
            fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if hasattr(model, "generate"):
        # A peft model's generate() does not go through its own forward, so the root's unshard hook
        # would never run; registering generate as a forward method adds the hooks around it.
        register_fsdp_forward_method(model, "generate")


def _fsdp1_wrap(model: nn.Module, strategy: FSDPStrategy) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(model, FSDP):
        return model
    blocks = block_classes(model)
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(blocks) if blocks else None,
        # mixed trainable/frozen parameters in one unit (LoRA) and optimisers built on the original
        # parameters need use_orig_params
        use_orig_params=True,
        sharding_strategy=strategy.sharding_strategy,
        cpu_offload=strategy.cpu_offload,
        mixed_precision=strategy.mixed_precision_config,
        device_id=strategy.root_device,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside an FSDP1 wrapper (FSDP2 and DDP leave the model's own class in place)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return model.module if isinstance(model, FSDP) else model


@contextmanager
def generation_context(module: LightningModule, model: nn.Module) -> Iterator[None]:
    """Make ``model.generate`` work (and be fast) under the module's strategy.

    FSDP1 generates inside ``summon_full_params(writeback=False)`` (its units cannot run the many
    small decode forwards otherwise). FSDP2 keeps the gathered parameters for the whole generation
    instead of all-gathering them again for every decoded token, then frees them. Under both, ranks
    whose prompts stop at different lengths must keep stepping together: pass ``synced_gpus=True``
    to ``generate`` whenever ``trainer.world_size > 1``.
    """
    kind = strategy_kind(_trainer(module))
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False, recurse=True):
            yield
    elif kind == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        # the root already keeps its parameters after forward (FSDP2's default for a root)
        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_reshard_after_forward(True, recurse=False)
                unit.reshard()
    else:
        yield


def clip_grad_norm(
    module: LightningModule, optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float
) -> None:
    """Clip the gradient norm of ``optimizer``'s parameters (all of them belonging to ``model``).

    FSDP1 needs the wrapped model's own ``clip_grad_norm_`` (the norm spans every rank's shards;
    Lightning refuses ``clip_gradients(norm)`` under FSDP1 precision). Elsewhere Lightning's
    ``clip_gradients`` is used so mixed-precision unscaling stays in Lightning's hands; under FSDP2
    the gradients are DTensors and ``clip_grad_norm_`` reduces their norm across ranks.
    """
    if strategy_kind(_trainer(module)) == "fsdp1":
        model.clip_grad_norm_(max_norm)
    elif not clip_without_scaler(module, optimizer, max_norm):
        module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")


def clip_each_model(
    module: LightningModule,
    optimizer: torch.optim.Optimizer,
    models: Iterable[nn.Module],
    clip_val: float | None,
    algorithm: str | None = None,
) -> bool:
    """Clip the gradient of each of ``models`` on its own (its norm, or by value: ``algorithm``), as each would
    be clipped trained alone; returns whether it did. It does not (False: clip as Lightning does) without a
    positive ``clip_val``, under FSDP1 (the wrapped model's own ``clip_grad_norm_`` spans its shards) and under a
    gradient scaler with an optimiser that unscales in its own step (the gradients here are still scaled:
    Lightning refuses that clipping with its message). Elsewhere the gradients are the true ones at this point
    (Lightning unscales before the clipping hook); under FSDP2 they are DTensors and ``clip_grad_norm_``
    reduces each model's norm across ranks."""
    trainer = _trainer(module)
    plugin = None if trainer is None else trainer.precision_plugin
    scaled = isinstance(plugin, MixedPrecision) and plugin.scaler is not None and _optimizer_handles_unscaling(optimizer)
    if not clip_val or clip_val <= 0 or strategy_kind(trainer) == "fsdp1" or scaled:
        return False
    by_value = GradClipAlgorithmType(algorithm or "norm") == GradClipAlgorithmType.VALUE
    for model in models:
        grads = [p for p in model.parameters() if p.grad is not None]
        if by_value:
            torch.nn.utils.clip_grad_value_(grads, clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(grads, clip_val)
    return True


def clip_without_scaler(
    module: LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None = None,
) -> bool:
    """Clip ``optimizer``'s gradients (by ``algorithm``, default norm) under a mixed precision without a
    gradient scaler (``bf16-mixed``); returns whether it did (False: another precision, left to Lightning).

    Lightning's ``MixedPrecision.clip_gradients`` refuses every optimiser that unscales gradients in its own
    step (``_step_supports_amp_scaling``: fused AdamW, the default optimiser of the modules here) under
    ``16-mixed`` and ``bf16-mixed`` alike, but only ``16-mixed`` has a gradient scaler whose unscaling
    that step would skip: under ``bf16-mixed`` the gradients are the true ones, clipped as under ``32-true``.
    """
    trainer = _trainer(module)
    plugin = None if trainer is None else trainer.precision_plugin
    if not isinstance(plugin, MixedPrecision) or plugin.scaler is not None:
        return False
    Precision.clip_gradients(plugin, optimizer, clip_val or 0.0, GradClipAlgorithmType(algorithm or "norm"))
    return True


def gather_for_export(module: LightningModule, model: nn.Module) -> nn.Module | None:
    """An unsharded copy of ``model`` on rank 0 (None on the other ranks) for ``save_pretrained``.

    Collective under FSDP: every rank must call it. The full state dict is gathered to CPU and loaded
    into a model of the same class (and peft adapters) built on the meta device, so rank 0 never holds
    two initialised copies.
    """
    trainer = _trainer(module)
    kind = strategy_kind(trainer)
    is_zero = trainer is None or trainer.is_global_zero
    if kind not in ("fsdp1", "fsdp2"):
        return model if is_zero else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # offloading to the CPU what already lives there segfaults FSDP1 (torch 2.13); it is a no-op anyway
    offload = module.device.type != "cpu"
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    if not is_zero:
        return None
    fresh = _empty_like(unwrap(model), next(t.dtype for t in state.values() if t.is_floating_point()))
    fresh.load_state_dict(state)
    copy_unloaded_buffers(fresh, unwrap(model), state.keys())
    return fresh


def copy_unloaded_buffers(fresh: nn.Module, source: nn.Module, loaded: Iterable[str]) -> None:
    """Copy into ``fresh`` the buffers a state dict does not carry (non-persistent ones, e.g. RoPE's
    ``inv_freq``), from ``source``, matched by name (FSDP1's wrapper segments removed): ``to_empty``
    leaves them uninitialised memory, which the export's finiteness check then read as NaN at random."""
    loaded = set(loaded)
    live = {_plain_name(name): buffer for name, buffer in source.named_buffers()}
    with torch.no_grad():
        for name, buffer in fresh.named_buffers():
            if name not in loaded and name in live:
                buffer.copy_(live[name].detach().to(buffer.device))


def _plain_name(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _original_class(model: nn.Module) -> type[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    # fully_shard swaps the class for a generated FSDP subclass; build the user's class instead
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _empty_like(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    from peft import PeftModel, get_peft_model

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    with torch.device("meta"):
        fresh = _original_class(base)._from_config(base.config, dtype=dtype)
        if isinstance(model, PeftModel):
            fresh = get_peft_model(fresh, copy.deepcopy(model.peft_config[model.active_adapter]))
    fresh = fresh.to_empty(device="cpu")
    # to_empty gives each use of a shared (tied) parameter its own tensor: tie them again, or a merged LoRA
    # export of tied embeddings comes out untied (an lm_head of its own)
    (fresh.get_base_model() if isinstance(fresh, PeftModel) else fresh).tie_weights()
    return fresh


def is_sharded_checkpoint(module: LightningModule) -> bool:
    """True when the trainer saves a sharded (torch.distributed.checkpoint) checkpoint.

    Lightning loads those with the module's full state dict as the template, and a key missing from
    the files is an error even with ``strict_loading=False``; frozen weights must then stay in the
    checkpoint (each rank writes only its shard of them).
    """
    trainer = _trainer(module)
    kind = strategy_kind(trainer)
    if kind == "fsdp2":
        return trainer.strategy._save_distributed_checkpoint
    return kind == "fsdp1" and trainer.strategy._state_dict_type == "sharded"
