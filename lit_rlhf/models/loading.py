"""Building, exporting and freezing the Hugging Face models of RLHF.

Four roles, two architectures (as in InstructGPT, Ouyang et al. 2022, arXiv:2203.02155 sec. 3.5): the actor and the reference are causal LMs
(``AutoModelForCausalLM``); the reward model and the critic are both
``AutoModelForSequenceClassification`` with one label. Loading a causal-LM folder (e.g. the SFT export)
as a sequence classifier keeps the backbone and adds a fresh ``score`` head ("critic initialised from
the policy"); loading a reward-model export gives the whole reward model ("critic initialised from the
reward model", as InstructGPT initialises its value function).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lit_rlhf.guards import check_finite_weights
from lit_rlhf.models.folders import adapter_base, check_one_label, load_pretrained
from lit_rlhf.models.last_layer import set_scored_last_layer
from lit_rlhf.models.lm_head import set_logits_chunking
from lit_rlhf.models.spec import ModelSpec


@contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Run the block with the CPU RNG seeded by ``seed`` (when given), restoring the global RNG after.

    Random init happens on the CPU, so forking only the CPU generator is enough and leaves the
    training RNG stream (Lightning's ``seed_everything``) untouched.
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _inline_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, **overrides) -> PretrainedConfig:
    fields = copy.deepcopy(spec.config)
    # A vocabulary sized to the tokenizer is the only sensible default for a random-init model, and
    # its special ids must be the tokenizer's (library defaults such as GPT-2's 50256 are out of range).
    fields.setdefault("vocab_size", len(tokenizer))
    fields.update(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **overrides,
    )
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _set_special_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model agree with the tokenizer on pad/EOS (the tokenizer is the source of truth).

    A generation config's further stop tokens (an instruct model's end of turn: Gemma's ``<end_of_turn>``,
    Llama 3's ``<|eom_id|>``) are kept after the tokenizer's EOS: the rollout engines stop at them too
    (:func:`generation_stop_ids`), and an export generates as the model did."""
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        extra = [i for i in generation_stop_ids(model) if i not in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
        generation.pad_token_id = tokenizer.pad_token_id
        generation.eos_token_id = [tokenizer.eos_token_id, *extra] if extra else tokenizer.eos_token_id


def learned_position_limit(model: nn.Module) -> int | None:
    """The most positions ``model`` can embed when it has a learned position table (GPT-2, GPT-Neo, OPT):
    an index past it fails inside the forward (a device-side assert on a GPU). None for rotary and ALiBi
    models, which run past their trained context."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not limit:
        return None
    words = model.get_input_embeddings()
    for module in model.modules():  # OPT's table has 2 more rows (an offset)
        if isinstance(module, nn.Embedding) and module is not words and module.num_embeddings in (limit, limit + 2):
            return int(limit)
    return None


def check_positions(model: nn.Module, length: int | torch.Tensor, owner: str, what: str) -> None:
    """Refuse a forward of ``length`` positions past ``model``'s learned position table (built models
    record it), naming ``what`` made them (``owner`` starts the message). A tensor ``length`` is read (a
    host sync) only for a model that has such a table."""
    limit = getattr(model, "_lit_rlhf_position_limit", None)
    if limit is not None and int(length) > limit:
        raise ValueError(
            f"{owner}: {what} make {int(length)} positions, past the {limit} the model's "
            f"learned position table holds (its config's n_positions / max_position_embeddings)"
        )


def generation_stop_ids(model: nn.Module) -> list[int]:
    """The stop token ids of ``model``'s generation config (``eos_token_id``, one id or a list; [] without)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    # Non-reentrant checkpointing lets gradients reach LoRA weights even though the (frozen) inputs
    # of each block do not require grad. transformers >= 5 renamed the method.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def _prepare(model: PreTrainedModel, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, task_type: str):
    """Train mode; resize embeddings to the tokenizer, set pad/EOS ids, checkpointing and LoRA (in that order)."""
    # from_pretrained returns eval mode and Lightning keeps each submodule's mode as it finds it, so without
    # this a loaded SFT or reward model would train with its configured dropout silently off. Frozen
    # models go through frozen_copy (eval); PPO switches dropout off explicitly (disable_dropout).
    model.train()
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        # The dedicated pad token (and chat-template tokens) may be new to a pretrained vocabulary.
        model.resize_token_embeddings(len(tokenizer))
    _set_special_token_ids(model, tokenizer)
    if spec.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    if spec.lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    _refuse_lora_on_tied_embeddings(model, spec.lora)
    # For SEQ_CLS peft appends the `score` head to modules_to_save (in place, hence the copy), so the
    # head stays fully trainable.
    return get_peft_model(model, LoraConfig(task_type=task_type, **copy.deepcopy(spec.lora)))


def _refuse_lora_on_tied_embeddings(model: PreTrainedModel, lora: dict) -> None:
    """Refuse LoRA adapters (or ``modules_to_save``) on the input or output embeddings of a model that ties
    them: the adapter of one is not the other's, so the merged export (one shared matrix) would not be the
    trained model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return
    tied = {model.get_input_embeddings(), model.get_output_embeddings()} - {None}
    names = [name for name, module in model.named_modules() if module in tied]

    def matches(targets, name: str) -> bool:
        if isinstance(targets, str):  # peft: a regex over the full name ("all-linear" skips the output layer)
            return targets != "all-linear" and re.fullmatch(targets, name) is not None
        return any(name == t or name.endswith(f".{t}") for t in targets or ())

    for key in ("target_modules", "modules_to_save"):
        hit = [name for name in names if matches(lora.get(key), name)]
        if hit:
            raise ValueError(
                f"lora.{key} includes {hit}, an embedding this model ties to the other (tie_word_embeddings): "
                "an adapter on one of the shared matrix's two uses cannot be merged into the export; leave it "
                "out, or untie the embeddings (tie_word_embeddings: false) in a copy of the model"
            )


def build_causal_lm(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """Actor / reference / SFT model: ``AutoModelForCausalLM`` from a folder or hub id, or from an
    inline config (random init seeded by ``spec.seed``), prepared for ``tokenizer``. A saved peft adapter
    folder is merged into its base at load (``lit_rlhf.models.folders``): the model starts as the
    adapter's policy, fully trainable, or with new adapters on top when ``spec.lora`` is set.

    Returns a ``PreTrainedModel``, or a peft ``PeftModelForCausalLM`` when ``spec.lora`` is set.
    """
    with _seeded(spec.seed):
        if spec.config is not None:
            model = AutoModelForCausalLM.from_config(
                _inline_config(spec, tokenizer),
                dtype=spec.torch_dtype,
                trust_remote_code=spec.trust_remote_code,
            )
        else:
            model = load_pretrained(AutoModelForCausalLM, spec)
        model = _prepare(model, spec, tokenizer, "CAUSAL_LM")
    set_logits_chunking(model, spec.logits_chunking, spec.fused_lm_head)
    set_scored_last_layer(model, spec.scored_last_layer)
    model._lit_rlhf_position_limit = learned_position_limit(model)
    return model


def build_score_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """Reward model or critic: ``AutoModelForSequenceClassification`` with ``num_labels=1``.

    From a causal-LM folder the backbone is loaded and the ``score`` head is new (seeded by
    ``spec.seed``); from a reward-model export the whole model, head included, is loaded (a classifier
    with other than one label is refused: ValueError naming the folder); a peft adapter folder is merged
    into its base, as in :func:`build_causal_lm`. Returns a
    ``PreTrainedModel``, or a peft ``PeftModelForSequenceClassification`` when ``spec.lora`` is set.
    """
    with _seeded(spec.seed):
        if spec.config is not None:
            model = AutoModelForSequenceClassification.from_config(
                _inline_config(spec, tokenizer, num_labels=1),
                dtype=spec.torch_dtype,
                trust_remote_code=spec.trust_remote_code,
            )
        else:
            check_one_label(adapter_base(spec.name_or_path) or spec.name_or_path, spec.trust_remote_code)
            model = load_pretrained(AutoModelForSequenceClassification, spec, num_labels=1)
        model = _prepare(model, spec, tokenizer, "SEQ_CLS")
    set_scored_last_layer(model, spec.scored_last_layer)
    model._lit_rlhf_position_limit = learned_position_limit(model)
    return model


def export_pretrained(model: nn.Module, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> Path:
    """Write ``model`` and ``tokenizer`` to ``folder`` with ``save_pretrained``.

    A peft model is merged first (on a copy, so ``model`` keeps training with its adapters): the folder
    then holds plain weights that ``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification``
    load without peft, with the same outputs. Returns the folder. Non-finite weights are refused
    (:class:`~lit_rlhf.guards.NonFiniteError` naming the parameter) before anything is written.
    """
    from peft import PeftModel

    folder = Path(folder)
    check_finite_weights(model, f"export to {folder}")
    if isinstance(model, PeftModel):
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(folder)
    _restore_source_dropout(folder / "config.json")
    tokenizer.save_pretrained(folder)
    return folder


def _restore_source_dropout(path: Path) -> None:
    """Put back into a written ``config.json`` the dropout probabilities :func:`disable_dropout` zeroed in the
    live config (recorded under :data:`_SOURCE_DROPOUT`, which is removed): an export describes the model's
    architecture as its source did, so a later stage that trains from it (a reward model or critic on a DPO
    or PPO export) trains with the source's dropout, not with the 0 that only this run's ratio needed."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())

    def restore(node: dict) -> bool:
        changed = False
        if isinstance(node.get(_SOURCE_DROPOUT), dict):
            node.update(node.pop(_SOURCE_DROPOUT))
            changed = True
        for value in node.values():
            changed = (isinstance(value, dict) and restore(value)) or changed
        return changed

    if restore(config):
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # save_pretrained's format


def frozen_copy(model: nn.Module) -> nn.Module:
    """An independent copy of ``model`` in eval mode with no trainable parameters (e.g. the reference)."""
    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


@contextmanager
def reference_logits_context(actor: nn.Module) -> Iterator[None]:
    """Within the block a LoRA ``actor`` computes with its adapters disabled, i.e. *is* the reference
    policy, so no second copy of the base weights is needed. For any other model it does nothing
    (the caller then uses a separate frozen reference model)."""
    from peft import PeftModel

    if isinstance(actor, PeftModel):
        with actor.disable_adapter():
            yield
    else:
        yield


# A dropout probability kept as a float, not an nn.Dropout: OPT's ``dropout`` and ``layerdrop``, Llama's and
# most decoders' attention ``attention_dropout`` (applied inside the attention kernel), ``activation_dropout``,
# GPT-2's config ``attn_pdrop``. Modules copy them from the config at init, so the config alone is not enough.
_DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop")


def _zero_float_dropouts(owner: object, record: dict[str, float] | None = None) -> None:
    """Set ``owner``'s float attributes named like a dropout probability (:data:`_DROPOUT_NAME`) to 0 (their
    first values noted in ``record``, when given)."""
    for name, value in list(vars(owner).items()):
        if isinstance(value, float) and _DROPOUT_NAME.search(name):
            if record is not None:
                record.setdefault(name, value)
            setattr(owner, name, 0.0)


# Config attribute holding the dropout probabilities a config had before disable_dropout zeroed them (the
# config carries it through copies, a merged LoRA export and FSDP's gathered copy); export_pretrained writes
# them back into config.json in its place.
_SOURCE_DROPOUT = "lit_rlhf_source_dropout"


def _zero_config_dropouts(config: PretrainedConfig) -> None:
    """Zero ``config``'s dropout probabilities, the source values recorded once (a second call keeps them)."""
    record = dict(getattr(config, _SOURCE_DROPOUT, None) or {})
    _zero_float_dropouts(config, record)
    if record:
        setattr(config, _SOURCE_DROPOUT, record)


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: PPO's ratio must be exactly 1 before the first update, and
    the rollout and update forwards must describe the same policy (standard practice, e.g. TRL).

    Zeroes every ``nn.Dropout``, the float probabilities modules copy from the config at init (OPT's
    ``dropout``/``layerdrop``, attention modules' ``attention_dropout``, ...) and the config's own (its text
    config's too: some models read them at forward time, e.g. GPT-Neo's and Persimmon's attention dropout).
    The config's values before are recorded in it, and :func:`export_pretrained` writes those to the
    export's ``config.json``: only the live model trains without dropout, not a later stage trained from
    its export."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        _zero_float_dropouts(module)
    config = getattr(model, "config", None)
    if config is not None:
        _zero_config_dropouts(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text is not config:
            _zero_config_dropouts(text)
